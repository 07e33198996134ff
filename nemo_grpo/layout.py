"""`ParallelLayout`: the one place a parallel layout (dp, tp, pp, cp over a world of ranks) is validated.

Config validation, the back ends, reward-model training and the planner build their layout here (a back end's
keys map onto it in its BackendSpec, backends/registry.py), so a bad one fails everywhere with the same message,
naming each degree and the config key that set it:

    layout = ParallelLayout.build(4, tp=2, keys={"tp": "policy.<section>.<tp key>"})   # ConfigError naming the key
    layout.dp, layout.tp, layout.pp                    # 2, 2, 1
Rank order is tp fastest, then cp, then dp, then pp ("tp-cp-ep-dp-pp"); a layout without pipeline stages has
pp 1: world = dp x cp x tp, in the same order. Context-parallel ranks hold the same weights (like data-
parallel ones: weights and optimizer state shard over dp x cp, gradients sum over dp x cp), each a share of every
sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nemo_grpo.errors import ConfigError

DEGREE_NAMES = {"tp": "tensor parallel", "pp": "pipeline parallel", "cp": "context parallel", "dp": "data parallel"}


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
