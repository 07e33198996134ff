"""`DTensorPolicyWorker`: Hugging Face models under FSDP2 + tensor parallelism (see parallelize.py for the layout).

Only what differs from `PolicyWorker` is here: building the HF model from a local directory, the (dp, tp)
parallelization, logits -> log-probs (full-vocabulary logits on every TP rank), the scalar head's score, the
gradient finish (Qwen3 q_norm/k_norm all-reduce), the DTensor-aware clipped norm, the weight export
(`DTensor.full_tensor()` per HF state_dict entry) and the checkpoint format (torch.distributed.checkpoint).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nemo_grpo.backends.base import PolicyWorker, pool_last_token, token_logprobs_from_logits
from nemo_grpo.backends.dtensor import parallelize as par
from nemo_grpo.distributed.weight_transfer import TensorSpec


def _tied_aliases(model: torch.nn.Module) -> frozenset:
    """Names that alias an earlier parameter (tied embeddings: lm_head.weight); HF drops them when saving."""
    seen, aliases = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return frozenset(aliases)


class DTensorPolicyWorker(PolicyWorker):
    """One rank: an HF causal LM (or sequence classifier with num_labels=1) sharded over a (dp, tp) mesh."""

    # ------------------------------------------------------------------------------------------ build
    @classmethod
    def check_layout(cls, cfg, world_size: int) -> None:
        d = cfg.dtensor_cfg
        tp = d.tensor_parallel_size
        if tp < 1 or world_size % tp:
            raise ValueError(f"policy.dtensor_cfg.tensor_parallel_size={tp} does not divide the world size "
                             f"{world_size} (cluster.gpus_per_node x cluster.num_nodes)")
        if d.data_parallel_size is not None and d.data_parallel_size * tp != world_size:
            raise ValueError(f"policy.dtensor_cfg.data_parallel_size={d.data_parallel_size} x "
                             f"tensor_parallel_size={tp} != world size {world_size}")

    def _build_model(self) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        cfg = self.cfg
        self.check_layout(cfg, self.world_size)
        tp = cfg.dtensor_cfg.tensor_parallel_size
        self.dp_size, self.tp_size = self.world_size // tp, tp
        self.dp_rank, self.tp_rank = divmod(self.rank, tp)
        self.output_rank = self.tp_rank == 0
        self.mesh = par.build_mesh(self.device.type, self.dp_size, self.tp_size)
        if self.scalar_head:
            model = AutoModelForSequenceClassification.from_pretrained(self.model_path, num_labels=1,
                                                                       dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        model.config.architectures = [type(model).__name__]
        if cfg.dtensor_cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.tied_aliases = _tied_aliases(model)
        model.to(self.device)
        if tp > 1:
            par.apply_tensor_parallel(model, self.mesh["tp"])
        par.apply_fsdp(model, self.mesh["dp"], torch.bfloat16 if cfg.precision == "bfloat16" else None)
        self.model = model
        self._partial_grad_params = par.local_head_params(model) if tp > 1 else []

    # ------------------------------------------------------------------------------------------ forward
    def _logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[b, t] -> [b, t]: full-vocabulary logits on every rank (lm_head replicated over tp), / temperature."""
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        logits = par.full_tensor(logits)  # [b, t, V]
        return token_logprobs_from_logits(logits, input_ids, attention_mask, self.cfg.generation.temperature)

    def _scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                input_lengths: torch.Tensor) -> torch.Tensor:
        """[b, t] -> [b]: the score head's output at position input_lengths - 1 (captured by a forward hook,
        since HF's own pooling looks for pad ids in input_ids instead of using the lengths)."""
        captured = {}
        handle = self.model.score.register_forward_hook(lambda m, i, o: captured.__setitem__("out", o))
        try:
            pooled_by_hf = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        finally:
            handle.remove()
        scores = pool_last_token(par.full_tensor(captured["out"]), input_lengths)  # [b, t, 1] -> [b]
        # FSDP re-gathers the root's parameters (the score head among them) for backward from a hook on the
        # root's output: make the (training) graph run through it, with weight 0
        return scores + 0.0 * par.full_tensor(pooled_by_hf).sum()

    # ------------------------------------------------------------------------------------------ gradients
    def _set_gradient_sync(self, enabled: bool) -> None:
        """Defer FSDP's reduce-scatter to the last micro-batch of a step (grads accumulate unsharded before)."""
        self.model.set_requires_gradient_sync(enabled)

    def _finish_gradients(self) -> None:
        if self._partial_grad_params:
            par.all_reduce_grads(self._partial_grad_params, self.mesh["tp"].get_group())

    def _clip_grad_norm(self, max_norm: Optional[float]) -> float:
        return par.clip_grad_norm_(self.model.parameters(), max_norm)

    # ------------------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def _local_weights(self) -> dict[str, torch.Tensor]:
        """name -> the local shard (a detached alias: in-place writes reach the live parameter)."""
        out = {}
        for n, p in self.model.named_parameters():
            p = p.detach()
            out[n] = p.to_local() if isinstance(p, DTensor) else p
        return out

    def _export_specs(self) -> list[TensorSpec]:
        return [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in self.model.state_dict().items()]

    def _export_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        out = {}
        for name in names:
            full = par.full_tensor(state[name].detach())
            if self.rank == 0:
                out[name] = full.to("cpu", copy=True)
        return out

    # ------------------------------------------------------------------------------------------ checkpoints
    def _dcp_state(self, with_optimizer: bool) -> dict:
        """The state dicts DCP writes / fills in place: sharded model (+ optimizer) tensors under HF names."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state = {"model": get_model_state_dict(self.model)}
        if with_optimizer:  # (a never-stepped optimizer is not saved: DCP would initialize it with a fake step)
            state["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        return state

    def save_checkpoint(self, path: str) -> None:
        """DCP shards of model + optimizer (loadable at another layout), plus a per-rank file with the
        scheduler and RNG states."""
        import torch.distributed.checkpoint as dcp

        os.makedirs(path, exist_ok=True)
        has_optim = bool(self.optimizer.state)
        dcp.save(self._dcp_state(has_optim), checkpoint_id=path)
        self._save_rank_state(path, has_optim=has_optim)
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore save_checkpoint's state; from another world size the RNG states are left as they are."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        extra = self._load_rank_state(path)
        state = self._dcp_state(extra["has_optim"])
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(self.model, state["model"])
        if extra["has_optim"]:
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        else:
            self.optimizer.state.clear()
        self._restore_schedule_and_rng(extra)
