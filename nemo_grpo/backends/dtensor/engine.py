"""`DTensorEngine`: Hugging Face models under FSDP2 + tensor parallelism (see parallelize.py for the layout).

The back end's PolicyEngine (backends/engine.py): building the HF model from a local directory (on the meta device,
sharded, then each rank's slices read from the safetensors: loading.py), the (dp, tp) parallelization, logits ->
log-probs (full-vocabulary logits on every TP rank), the scalar head's score, the forward and backward of a step's
micro-batches (a plain loop; FSDP's reduce-scatter deferred to the last), the gradient finish (Qwen3
q_norm/k_norm all-reduce), the DTensor-aware gradient norm, the weight export (`DTensor.full_tensor()` per HF
state_dict entry; for refit every rank writes its shards into shared memory) and the checkpoint format
(torch.distributed.checkpoint). Packed rows attend per segment (attention.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from nemo_grpo.backends.batching import next_token_logprobs
from nemo_grpo.backends.dtensor import loading
from nemo_grpo.backends.dtensor import lora as peft_lora
from nemo_grpo.backends.dtensor import parallelize as par
from nemo_grpo.backends.dtensor.attention import VARLEN, varlen_kwargs
from nemo_grpo.backends.engine import EngineSetup, MicroBatchLoss, PolicyEngine, move_parameters, on_device
from nemo_grpo.backends.model_inputs import ModelInputs
from nemo_grpo.backends.optimizer import build_optimizer
from nemo_grpo.backends.router import RouterLogits, RouterLosses
from nemo_grpo.models import lora
from nemo_grpo.models.experts import moe_routers
from nemo_grpo.weights.sender import write_gathered
from nemo_grpo.weights.transfer import TensorSpec


def _tied_aliases(model: torch.nn.Module) -> frozenset:
    """Names that alias an earlier parameter (tied embeddings: lm_head.weight); HF drops them when saving."""
    seen, aliases = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return frozenset(aliases)


def _record_router_logits(model: torch.nn.Module, recorder: RouterLogits) -> None:
    """A forward hook on every MoE router (moe_routers: logits [N, E] and top-k expert ids [N, k] of the
    layer's flattened [b, s] positions) hands both to `recorder`."""
    routers = moe_routers(model)
    if not routers:
        raise RuntimeError(f"{type(model).__name__}: no MoE router (mlp.gate) to record the routing of")

    def hook(module, args, out):
        recorder.record(module, par.full_tensor(out[0]))
        recorder.record_routes(module, par.full_tensor(out[2]))
    for router in routers:
        router.register_forward_hook(hook)


class DTensorEngine(PolicyEngine):
    """One rank: an HF causal LM (or sequence classifier with num_labels=1) sharded over a (dp, tp) mesh."""

    def __init__(self, setup: EngineSetup):
        super().__init__(setup)
        self._build_model()
        self.optimizer = build_optimizer([p for p in self.model.parameters() if p.requires_grad], self.cfg.optimizer)

    # ------------------------------------------------------------------------------------------ build
    def _build_model(self) -> None:
        cfg, layout = self.cfg, self.parallel_layout
        tp = layout.tp
        self.dp_size, self.tp_size = layout.dp, tp
        coords = layout.rank_coords(self.rank)
        self.dp_rank, self.tp_rank = coords["dp"], coords["tp"]
        self.output_rank = self.tp_rank == 0 and self.context.rank == 0
        self.mesh = par.build_mesh(self.device.type, self.dp_size * layout.cp, self.tp_size)  # FSDP over dp x cp
        # packed rows (per segment, or the dense mask) and context parallelism go through attention.py
        attn = VARLEN if cfg.sequence_packing.enabled or layout.cp > 1 else None
        model = loading.meta_model(self.model_path, self.scalar_head, attn)  # built sharded: loading.py
        if cfg.dtensor_cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.tied_aliases = _tied_aliases(model)
        if cfg.lora.enabled:
            lora.inject_adapters(model, cfg.lora)  # (on the meta device: dtensor/loading.py fills them)
        if tp > 1:
            par.apply_tensor_parallel(model, self.mesh["tp"])
        par.apply_fsdp(model, self.mesh["dp"], torch.bfloat16 if cfg.precision == "bfloat16" else None)
        # what building the model read: {"numel": elements in all, "largest": the largest single read}
        self.checkpoint_reads = loading.materialize(model, self.device, self.model_path, self.seed)
        self.model, self.hf_config = model, model.config
        self.data_parallel_group = self.mesh["dp"].get_group()
        self._partial_grad_params = par.local_head_params(model) if tp > 1 else []
        if getattr(model.config, "num_experts_per_tok", None):
            self.router = RouterLosses(cfg.dtensor_cfg, model.config.num_experts_per_tok)
            _record_router_logits(model, self.router.recorder)

    # ------------------------------------------------------------------------------------------ forward
    def _forward(self, inputs: ModelInputs):
        """The HF model on [r, t] ids with a 2D padding mask; a packed row with per-sequence position ids and its
        segment boundaries (attention per segment), or its 4D block-diagonal causal mask (SDPA does not isolate
        packed sequences from position ids alone); under context parallelism this rank's positions, their true
        position ids and the CP shard (no mask)."""
        if inputs.context is not None:
            extra = {"context_shard": inputs.context}
        else:
            extra = varlen_kwargs(inputs.cu_seqlens) if inputs.varlen else {}
        return self.model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                          position_ids=inputs.position_ids, use_cache=False, **extra)

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """-> log-probs [r, t], or the scalar head's scores [b]."""
        return self._scores(inputs) if self.scalar_head else self._logprobs(inputs)

    def _logprobs(self, inputs: ModelInputs) -> torch.Tensor:
        """-> [r, t]: full-vocabulary logits on every rank (lm_head replicated over tp), / temperature."""
        logits = par.full_tensor(self._forward(inputs).logits)  # [r, s, V] (s: this CP rank's positions)
        return inputs.logprobs_from_next(next_token_logprobs(logits, inputs.next_tokens,
                                                             self.cfg.generation.temperature))

    def _scores(self, inputs: ModelInputs) -> torch.Tensor:
        """-> [b]: the score head's output at each sequence's last token (captured by a forward hook, since HF's
        own pooling looks for pad ids in input_ids instead of using the lengths)."""
        captured = {}
        handle = self.model.score.register_forward_hook(lambda m, i, o: captured.__setitem__("out", o))
        try:
            pooled_by_hf = self._forward(inputs).logits
        finally:
            handle.remove()
        scores = inputs.last_tokens(par.full_tensor(captured["out"]))[:, 0]  # [r, t, 1] -> [b]
        # FSDP re-gathers the root's parameters (the score head among them) for backward from a hook on the
        # root's output: make the (training) graph run through it, with weight 0
        return scores + 0.0 * par.full_tensor(pooled_by_hf).sum()

    # ------------------------------------------------------------------------------------------ gradients
    def forward_backward(self, micro_batches: list[dict], loss: MicroBatchLoss) -> None:
        """One micro-batch after the other; FSDP's reduce-scatter deferred to the last of them (grads accumulate
        unsharded before)."""
        for i, mb in enumerate(micro_batches):
            mb = on_device(mb, self.device)
            self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            inputs = self.model_inputs(mb)
            if self.router is not None:
                self.router.recorder.start()
            loss(mb, inputs, self.forward(inputs)).backward()

    def reduce_gradients(self) -> float:
        """The TP all-reduce of the gradients tensor parallelism leaves partial; the global norm over DTensors."""
        if self._partial_grad_params:
            par.all_reduce_grads(self._partial_grad_params, self.mesh["tp"].get_group())
        return par.grad_norm([p.grad for p in self.model.parameters() if p.grad is not None])

    def local_grads(self) -> list[torch.Tensor]:
        return [par.local(p.grad) for p in self.model.parameters() if p.grad is not None]

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def move(self, device: torch.device) -> None:
        move_parameters(self.model, self.optimizer, device)

    # ------------------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def local_weights(self) -> dict[str, torch.Tensor]:
        """name -> the local shard (a detached alias: in-place writes reach the live parameter)."""
        out = {}
        for n, p in self.model.named_parameters():
            p = p.detach()
            out[n] = par.local(p)
        return out

    def _hf_keys(self, state: dict) -> dict[str, str]:
        """HF name -> state-dict key (they differ only for LoRA layers' base weights; adapters are not exported)."""
        return {hf: k for k in state if (hf := peft_lora.hf_name(k)) is not None}

    def weight_specs(self) -> list[TensorSpec]:
        state = self.model.state_dict()
        return [TensorSpec(n, tuple(state[k].shape), state[k].dtype) for n, k in self._hf_keys(state).items()]

    def gather_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Full HF tensors on rank 0; a LoRA layer's weight merged: W + scale * B @ A."""
        state = self.model.state_dict()
        keys = self._hf_keys(state)
        out = {}
        for name in names:
            full = par.full_tensor(state[keys[name]].detach())
            adapters = peft_lora.adapter_keys(keys[name])
            a, b = (par.full_tensor(state[k].detach()) for k in adapters) if adapters else (None, None)
            if self.rank == 0:  # (only rank 0 keeps the tensor: only it merges)
                if a is not None:
                    full = lora.merged(full, a, b, lora.scale(self.cfg.lora))
                out[name] = full.to("cpu", copy=True)
        return out

    def adapter_state(self) -> dict[str, torch.Tensor]:
        out = {}
        for key, t in self.model.state_dict().items():
            if lora.is_adapter(key):
                full = par.full_tensor(t.detach())
                if self.rank == 0:
                    out[lora.saved_key(key)] = full.to("cpu", copy=True)
        return out

    def write_weight_bucket(self, bucket: list[TensorSpec], views: Optional[dict[str, torch.Tensor]],
                            in_place: bool) -> None:
        """In place: every rank copies (and casts) its own shard of each tensor into its slice of the full view,
        then all wait for each other; no gather of weights. A shard replicated over tp is written by tp rank 0
        only. LoRA: the rank-r adapters are gathered (small) and each rank merges its own shard,
        W[rows, cols] + scale * B[rows] @ A[:, cols]."""
        if not in_place:
            return write_gathered(self, bucket, views)
        state = self.model.state_dict()
        keys = self._hf_keys(state)
        for spec in bucket:
            source = state[keys[spec.name]].detach()
            adapters = peft_lora.adapter_keys(keys[spec.name])
            a, b = (par.full_tensor(state[k].detach()) for k in adapters) if adapters else (None, None)
            if isinstance(source, DTensor) and not self._writes_shard(source):
                continue
            if not isinstance(source, DTensor) and self.rank != 0:
                continue
            source, region = par.local_region(source)
            if all(r.stop > r.start for r in region):
                if a is not None:  # region = (rows, cols) of a linear weight
                    source = lora.merged(source, a[:, region[1]], b[region[0]], lora.scale(self.cfg.lora))
                views[spec.name][region].copy_(source)
        dist.barrier()

    def _writes_shard(self, t: DTensor) -> bool:
        """Whether this rank writes its shard of `t`: one rank per distinct shard (coordinate 0 on every mesh
        dim that replicates it, and tp rank 0 for tensors whose mesh has no tp dim)."""
        if self.tp_size > 1 and "tp" not in (t.device_mesh.mesh_dim_names or ()) and self.tp_rank != 0:
            return False
        coordinate = t.device_mesh.get_coordinate()
        return all(c == 0 for c, p in zip(coordinate, t.placements) if p.is_replicate())

    # ------------------------------------------------------------------------------------------ checkpoints
    def _dcp_state(self, with_optimizer: bool) -> dict:
        """The state dicts DCP writes / fills in place: sharded model (+ optimizer) tensors under HF names."""
        state = {"model": get_model_state_dict(self.model, options=self._state_options())}
        if with_optimizer:  # (a never-stepped optimizer is not saved: DCP would initialize it with a fake step)
            state["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        return state

    def _state_options(self):
        """LoRA: checkpoints hold the adapters only (the frozen base comes from policy.model_name)."""
        frozen_out = self.cfg.lora.enabled
        return StateDictOptions(ignore_frozen_params=frozen_out, strict=not frozen_out)

    def save_checkpoint(self, path: str) -> dict:
        """DCP shards of model + optimizer (loadable at another layout); the rank file notes whether the
        optimizer has state."""
        has_optim = bool(self.optimizer.state)
        dcp.save(self._dcp_state(has_optim), checkpoint_id=path)
        return {"has_optim": has_optim}

    def load_checkpoint(self, path: str, extra: dict) -> None:
        state = self._dcp_state(extra["has_optim"])
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(self.model, state["model"], options=self._state_options())
        if extra["has_optim"]:
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        else:
            self.optimizer.state.clear()
