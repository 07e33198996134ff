"""`ParallelLayout`: the one place a parallel layout (dp, tp, pp, cp over a world of ranks) is validated.

Config validation, both back ends, reward-model training and the planner build their layout here, so a bad
one fails everywhere with the same message, naming each degree and the config key that set it:

    layout = policy_layout(cfg.policy, world=4)        # ConfigError naming the key when impossible
    layout.dp, layout.tp, layout.pp                    # 2, 2, 1
Rank order is tp fastest, then cp, then dp, then pp (Megatron-Core's default "tp-cp-ep-dp-pp"); the DTensor back
end has no pp: world = dp x cp x tp, in the same order. Context-parallel ranks hold the same weights (like data-
parallel ones: weights and optimizer state shard over dp x cp, gradients sum over dp x cp), each a share of every
sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nemo_grpo.errors import ConfigError

DEGREE_NAMES = {"tp": "tensor parallel", "pp": "pipeline parallel", "cp": "context parallel", "dp": "data parallel"}
DTENSOR_KEYS = {"tp": "tensor_parallel_size", "cp": "context_parallel_size", "dp": "data_parallel_size"}
MEGATRON_KEYS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                 "cp": "context_parallel_size"}


@dataclass(frozen=True)
class ParallelLayout:
    """world = dp x cp x pp x tp ranks; `keys` maps each degree set by the config to its dotted key."""
    world: int
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @classmethod
    def build(cls, world: int, *, tp: int = 1, pp: int = 1, cp: int = 1, dp: Optional[int] = None,
              keys: Optional[dict[str, str]] = None, where: str = "") -> "ParallelLayout":
        """Check every degree and their product against `world` (dp None: whatever the others leave).
        keys: degree -> config key (for the message); where: what `world` is made of, for the message."""
        keys = keys or {}
        where = where or f"world size {world}"
        for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("dp", dp)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"config key '{keys.get(name, name)}': the {DEGREE_NAMES[name]} size must be "
                                  f"an integer >= 1, got {value!r}")
        model = tp * pp * cp
        named = {"tp": tp, "pp": pp, "cp": cp}
        shown = [d for d in named if d in keys] or list(named)  # the degrees the config sets, by their key
        degrees = " x ".join(f"{keys.get(d, d).rsplit('.', 1)[-1]} {named[d]}" for d in shown)
        if dp is None:
            if world % model:  # the key named: the first degree that alone does not divide the world, else tp's
                culprit = next((d for d in shown if world % named[d]), "tp")
                raise ConfigError(f"config key '{keys.get(culprit, culprit)}': {degrees} = {model} does not divide "
                                  f"{where}")
            dp = world // model
        elif dp * model != world:
            raise ConfigError(f"config key '{keys.get('dp', 'dp')}': {keys.get('dp', 'dp').rsplit('.', 1)[-1]} "
                              f"{dp} x {degrees} = {dp * model} != {where}")
        return cls(world=world, dp=dp, tp=tp, pp=pp, cp=cp)

    def rank_coords(self, rank: int) -> dict[str, int]:
        """Global rank -> its index along each axis (tp fastest, then cp, dp, pp)."""
        rank, tp = divmod(rank, self.tp)
        rank, cp = divmod(rank, self.cp)
        pp, dp = divmod(rank, self.dp)
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp}

    def __str__(self) -> str:
        return f"dp {self.dp} x tp {self.tp} x pp {self.pp} x cp {self.cp} = {self.world}"


def _check_expert_parallel(ep, layout: ParallelLayout, key: str) -> None:
    """Megatron-Core takes the expert-parallel ranks out of a pipeline stage's tp x cp x dp ranks (expert tensor
    parallel size 1: each expert whole on its rank): ep must divide them (at tp = cp = 1, the data-parallel ranks)."""
    if not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"config key '{key}expert_model_parallel_size': must be an integer >= 1, got {ep!r}")
    ranks = layout.tp * layout.cp * layout.dp
    if ranks % ep:
        raise ConfigError(f"config key '{key}expert_model_parallel_size': {ep} does not divide the {ranks} ranks of "
                          f"tp x cp x dp ({layout}) that expert parallelism splits the experts over")


def backend_layout(backend: str, dtensor_cfg, megatron_cfg, world: int, prefix: str = "policy",
                   where: str = "") -> ParallelLayout:
    """The layout of a back end's section (`<prefix>.dtensor_cfg` or `<prefix>.megatron_cfg`) on `world` ranks."""
    if backend == "megatron":
        m = megatron_cfg
        keys = {k: f"{prefix}.megatron_cfg.{v}" for k, v in MEGATRON_KEYS.items()}
        layout = ParallelLayout.build(world, tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                                      cp=m.context_parallel_size, keys=keys, where=where)
        _check_expert_parallel(m.expert_model_parallel_size, layout, f"{prefix}.megatron_cfg.")
        return layout
    d = dtensor_cfg
    keys = {k: f"{prefix}.dtensor_cfg.{v}" for k, v in DTENSOR_KEYS.items()}
    return ParallelLayout.build(world, tp=d.tensor_parallel_size, cp=d.context_parallel_size,
                                dp=d.data_parallel_size, keys=keys, where=where)


def policy_layout(policy_cfg, world: int, prefix: str = "policy", where: str = "") -> ParallelLayout:
    """The layout of a PolicyConfig (policy.*, or a reward model's section under `prefix`) on `world` ranks."""
    return backend_layout(policy_cfg.backend, policy_cfg.dtensor_cfg, policy_cfg.megatron_cfg, world, prefix, where)


def check_inactive_degrees(dtensor_cfg, megatron_cfg, prefix: str = "policy") -> None:
    """Degrees of both back ends' sections must be >= 1 even where that back end is not the one in use (a
    recipe switched to it later must not carry a silently impossible value)."""
    for section, names in (("dtensor_cfg", DTENSOR_KEYS), ("megatron_cfg", MEGATRON_KEYS)):
        cfg = dtensor_cfg if section == "dtensor_cfg" else megatron_cfg
        for degree, key in names.items():
            value = getattr(cfg, key)
            if value is not None and value < 1:
                raise ConfigError(f"config key '{prefix}.{section}.{key}': the {DEGREE_NAMES[degree]} size must "
                                  f"be >= 1, got {value}")
