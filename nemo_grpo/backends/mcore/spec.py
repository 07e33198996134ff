"""The Megatron-Core back end as the rest of the house sees it: policy.megatron_cfg, its layout (tp x cp x pp x dp,
expert parallelism carved out of a stage's ranks), its rules, and its memory model (backends/mcore/memory.py).

Light to import: the engine (Megatron-Core, torch.distributed) is imported on first use of `engine_class`.
"""

from __future__ import annotations

import importlib.util

from nemo_grpo.backends.registry import BackendSpec
from nemo_grpo.errors import ConfigError
from nemo_grpo.errors import require as _need
from nemo_grpo.errors import require_choice as _choice
from nemo_grpo.layout import ParallelLayout
from nemo_grpo.models.spec import check_divisible, check_rope, model_spec, moe_experts

ROUTER_REPLAY = ["none", "old_policy", "engine"]


def check_expert_split(experts: int, ep: int, megatron_key: str, model: str) -> None:
    """expert_model_parallel_size `ep` splits a model's `experts` per layer evenly, and is 1 for a dense model
    (experts 0); a one-line ConfigError naming `megatron_key`.expert_model_parallel_size otherwise. Training and
    the planner both refuse these."""
    key = f"{megatron_key}.expert_model_parallel_size"
    if not experts and ep != 1:
        raise ConfigError(f"config key '{key}': {ep}, but {model} is a dense model (no experts to split); set it to 1")
    if experts and experts % ep:
        raise ConfigError(f"config key '{key}': {ep} does not divide the model's {experts} experts")


def megatron_moe_unbuilt(experts: int, megatron_key: str, model: str, tp: int, sequence_parallel: bool
                         ) -> list[str]:
    """What the Megatron back end does not build yet for a Mixture-of-Experts model (one message per key, each
    naming it); [] for a dense model or a layout it builds (tp > 1 with sequence parallelism, the experts whole
    on every TP rank). Training refuses these; the planner sizes them (as Megatron-Core lays them out) and says
    so in a note."""
    if not experts:
        return []
    key, out = megatron_key + ".", []
    if tp > 1 and not sequence_parallel:
        out.append(f"config key '{key}sequence_parallel': false; megatron's Mixture-of-Experts layers ({model}) "
                   f"under tensor_model_parallel_size {tp} take each TP rank's share of the tokens: set it to true")
    return out


def check_megatron_experts(cfg, megatron_key: str, model: str, tp: int, ep: int, sequence_parallel: bool
                           ) -> None:
    """What the Megatron back end builds of a model's experts, a ConfigError naming the key otherwise
    (`megatron_key`: e.g. policy.megatron_cfg): MoE under TP with sequence_parallel (each expert whole on every
    TP rank), with an expert_model_parallel_size that divides the experts; 1 for a dense model."""
    experts = moe_experts(cfg)
    unbuilt = megatron_moe_unbuilt(experts, megatron_key, model, tp, sequence_parallel)
    if unbuilt:
        raise ConfigError(unbuilt[0])
    check_expert_split(experts, ep, megatron_key, model)


def _check_expert_parallel(ep, layout: ParallelLayout, key: str) -> None:
    """Megatron-Core takes the expert-parallel ranks out of a pipeline stage's tp x cp x dp ranks (expert tensor
    parallel size 1: each expert whole on its rank): ep must divide them (at tp = cp = 1, the data-parallel ranks)."""
    if not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"config key '{key}expert_model_parallel_size': must be an integer >= 1, got {ep!r}")
    ranks = layout.tp * layout.cp * layout.dp
    if ranks % ep:
        raise ConfigError(f"config key '{key}expert_model_parallel_size': {ep} does not divide the {ranks} ranks of "
                          f"tp x cp x dp ({layout}) that expert parallelism splits the experts over")


class MegatronSpec(BackendSpec):
    name = "megatron"
    section = "megatron_cfg"
    engine = "nemo_grpo.backends.mcore.engine:MegatronEngine"
    degree_keys = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                   "cp": "context_parallel_size"}

    def layout(self, p, world: int, prefix: str = "policy", where: str = "") -> ParallelLayout:
        layout = super().layout(p, world, prefix, where)
        _check_expert_parallel(self.cfg(p).expert_model_parallel_size, layout, self.key(prefix))
        return layout

    def describe(self, p) -> str:
        return f"tp={self.degree(p, 'tp')}, pp={self.degree(p, 'pp')}"

    # ------------------------------------------------------------------------------------ validation
    def validate(self, p, prefix: str) -> None:
        """Routing replay (read whichever back end is in use: it is built here only); in use, the layer spec
        and core attention."""
        self._validate_router_replay(p, prefix)
        if p.backend != self.name:
            return
        m, key = self.cfg(p), self.key(prefix)
        _choice(m.layer_spec, key + "layer_spec", ["local", "transformer_engine"])
        _choice(m.attention_backend, key + "attention_backend", ["sdpa", "unfused"])
        _need(not p.lora.enabled or m.layer_spec == "local", key + "layer_spec",
              "LoRA (policy.lora.enabled) adapts the local layer spec's linears only; Transformer Engine's fused "
              "norm + linear layers have no adapters: use local")
        _need(m.layer_spec == "local" or importlib.util.find_spec("transformer_engine") is not None,
              key + "layer_spec", "transformer_engine needs Transformer Engine installed (the gpu extra); use local")

    def _validate_router_replay(self, p, prefix: str) -> None:
        """moe_router_replay: a known mode (engine: with the torch engine, the one that records routes), on this
        back end, and not with activation checkpointing (the recomputed forward would need the routes a second
        time)."""
        m, key = self.cfg(p), self.router_replay_key(prefix)
        _choice(m.moe_router_replay, key, ROUTER_REPLAY)
        if m.moe_router_replay == "none":
            return
        _need(m.moe_router_replay != "engine" or p.generation.backend == "torch", key, "engine (R3: the generation "
              "engine's routes replayed in training) needs the torch engine (policy.generation.backend=torch), which "
              "records them; vLLM returns none here (its CPU build refuses enable_return_routed_experts)")
        _need(p.backend == self.name, key, f"{m.moe_router_replay}: routing replay is built on the megatron back end "
              f"only; set {prefix}.backend=megatron or {key}=none")
        _need(not m.activation_checkpointing, key, f"{m.moe_router_replay}: not with "
              f"{self.key(prefix, 'activation_checkpointing')} (the recomputed forward would route again); set one off")

    def sequence_split(self, p) -> tuple[int, str]:
        """Sequence parallelism splits each context-parallel chunk again over the tensor-parallel ranks."""
        m = self.cfg(p)
        tp = m.tensor_model_parallel_size
        if m.sequence_parallel and tp > 1:
            return tp, f" x tensor_model_parallel_size {tp} (sequence_parallel)"
        return 1, ""

    def validate_context_parallel(self, p, prefix: str, cp: int) -> None:
        """CP runs in our SDPA core attention: neither unfused attention nor the Transformer Engine spec (whose
        own CP is not wired)."""
        m, section = self.cfg(p), self.key(prefix)
        cp_key = section + "context_parallel_size"
        _need(m.attention_backend != "unfused", section + "attention_backend",
              f"'unfused' with {cp_key} {cp}: context parallelism is built in the SDPA core attention only; "
              f"use sdpa")
        _need(m.layer_spec != "transformer_engine", section + "layer_spec",
              f"'transformer_engine' with {cp_key} {cp}: Transformer Engine's own context parallelism is not "
              f"wired; use local")

    def validate_model(self, p, hf, model_path: str, prefix: str) -> None:
        """Its experts (MoE under TP with sequence parallelism, ep dividing them), routing replay on a MoE model,
        LoRA and CP on dense ones only, its RoPE, tied embeddings over stages, and tp / pp splitting the sizes."""
        m, key = self.cfg(p), self.key(prefix)
        check_megatron_experts(hf, self.section_key(prefix), model_path, m.tensor_model_parallel_size,
                               m.expert_model_parallel_size, m.sequence_parallel)
        _need(moe_experts(hf) or m.moe_router_replay == "none", key + "moe_router_replay",
              f"{m.moe_router_replay}, but {model_path} is a dense model (no routers to replay); set it to none")
        _need(not (moe_experts(hf) and p.lora.enabled), f"{prefix}.lora.enabled",
              "not with a Mixture-of-Experts model on megatron yet (no adapters on the experts or the router)")
        _need(not (moe_experts(hf) and m.context_parallel_size > 1), key + "context_parallel_size",
              f"{m.context_parallel_size}: not with a Mixture-of-Experts model yet (expert parallelism and context "
              "parallelism both ride on the data-parallel ranks; their combination is not built); set it to 1")
        check_rope(hf, f"{prefix}.model_name")
        overlap = m.use_distributed_optimizer and m.distributed_data_parallel_config.overlap_grad_reduce
        tied_over_stages = m.pipeline_model_parallel_size > 1 and getattr(hf, "tie_word_embeddings", False)
        _need(not (overlap and tied_over_stages), key + "distributed_data_parallel_config.overlap_grad_reduce",
              "the model ties its embeddings, whose gradient is summed over the first and last pipeline stages "
              "before the data-parallel reduction; set it to false with pipeline_model_parallel_size > 1")
        check_divisible(hf, m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                        key + "tensor_model_parallel_size", key + "pipeline_model_parallel_size")

    def router_replay(self, p) -> str:
        return self.cfg(p).moe_router_replay

    # ------------------------------------------------------------------------------------ planning
    def dense_packing_mask(self, p) -> bool:
        """Megatron's unfused attention takes a packed row's block-diagonal mask."""
        return self.cfg(p).attention_backend == "unfused"

    def model_spec(self, p, hf, scalar_head: bool, prefix: str):
        """At its tp and pp (which must split the model), with a RoPE it builds and ep dividing the experts."""
        m = self.cfg(p)
        spec = model_spec(hf, m.tensor_model_parallel_size, m.pipeline_model_parallel_size, scalar_head=scalar_head,
                          layout_key=self.section_key(prefix))
        check_expert_split(spec.experts, m.expert_model_parallel_size, self.section_key(prefix), p.model_name)
        return spec

    def plan_devices(self, p, spec, workload, world: int) -> tuple[list, dict[str, float]]:
        from nemo_grpo.backends.mcore import memory  # here: models.lora imports torch

        return memory.plan_devices(p, spec, workload, world)

    def describe_plan(self, p, layout: ParallelLayout) -> tuple[str, list[str]]:
        m = self.cfg(p)
        cp = f" x CP {layout.cp}" if layout.cp > 1 else ""
        ep = f" (EP {m.expert_model_parallel_size})" if m.expert_model_parallel_size > 1 else ""
        shape = f"megatron TP {layout.tp} x PP {layout.pp}{cp} x DP {layout.dp}{ep}"
        extras = [n for n, on in (("sequence parallel", m.sequence_parallel and layout.tp > 1),
                                  ("distributed optimizer", m.use_distributed_optimizer),
                                  ("recompute", m.activation_checkpointing)) if on]
        return shape, extras

    def moe_notes(self, p, spec, layout: ParallelLayout) -> list[str]:
        """The experts / EP per rank, whole over TP, and their expert-data-parallel group; what training does
        not build yet."""
        m = self.cfg(p)
        ep, edp = m.expert_model_parallel_size, layout.tp * layout.cp * layout.dp // m.expert_model_parallel_size
        sharded = " and their masters and optimizer state sharded over" if m.use_distributed_optimizer else ""
        notes = [f"experts: {spec.experts} per layer / EP {ep} = {spec.experts // ep} per rank, whole over TP "
                 f"(expert TP 1); expert data parallel {edp} (tp x cp x dp / ep), the group their gradients are "
                 f"reduced over{sharded}"]
        return notes + [f"training refuses this layout today: {u}" for u in megatron_moe_unbuilt(
            spec.experts, self.section_key(), p.model_name, layout.tp, m.sequence_parallel)]


SPEC = MegatronSpec()
