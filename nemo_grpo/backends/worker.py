"""`PolicyWorker`: one rank of a policy. The step sequence and the data contract live here, once.

Data contract (driver <-> worker): batches as in nemo_grpo/backends/batching.py.
Log-probs: logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t]) from logits / generation.temperature;
  column 0 and padding positions are 0.
Loss: `loss, metrics = loss_fn(logprobs [b, T], mb, global_valid_seqs, global_valid_toks)` (scalar-head models:
  scores [b] in place of the log-probs, e.g. the Bradley-Terry loss); the normalizers
  count the whole global batch (all micro-batches and data-parallel ranks); the loss and every metric are
  additive contributions, so the sum over micro-batches and ranks is the global value. The worker
  backpropagates the contribution as-is; a back end makes its data-parallel reduction a sum, not a mean.

A back end subclasses PolicyWorker and supplies only what differs: building and parallelizing the model
(`_build_model`), the forward pass to log-probs / scores, gradient finishing, the global gradient norm and the
local gradients, the local weight tensors, the full-weight export (`weight_specs`, `gather_weights`, optionally
`write_weight_bucket`: the WeightSource of nemo_grpo/weights/protocols.py, which the worker's `weight_sender`
drives) and the checkpoint format. The optimizer, its schedule and the
clipping rule are nemo_grpo/backends/optimizer.py's; per-rank checkpoint state is checkpoint_state.py's.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from nemo_grpo.backends import checkpoint_state, context_parallel, varlen
from nemo_grpo.backends.batching import slice_batch, take_rows
from nemo_grpo.backends.context_parallel import context_group
from nemo_grpo.backends.model_inputs import ModelInputs, model_inputs, split_context
from nemo_grpo.backends.optimizer import build_optimizer, clip_coefficient, lr_warmup_factor
from nemo_grpo.backends.router import RouterLosses
from nemo_grpo.distributed.interfaces import process_group_report
from nemo_grpo.distributed.spare_workers import RestartableWorker
from nemo_grpo.distributed.worker_group import init_torch_distributed
from nemo_grpo.backends.registry import policy_layout
from nemo_grpo.layout import ParallelLayout
from nemo_grpo.models import lora
from nemo_grpo.weights.sender import WeightSender, write_gathered
from nemo_grpo.weights.transfer import TensorSpec


def _as_float(value) -> float:
    return float(value.detach().float().sum()) if isinstance(value, torch.Tensor) else float(value)


def loss_and_metrics(loss_fn, logprobs: torch.Tensor, mb: dict[str, Any], gvs: torch.Tensor,
                     gvt: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """loss_fn on one micro-batch: (loss contribution, its metrics with "loss" added unless the loss fn set it)."""
    loss, metrics = loss_fn(logprobs, mb, gvs, gvt)
    metrics = dict(metrics)
    metrics.setdefault("loss", loss)
    return loss, metrics


def accumulate(totals: dict[str, float], metrics: dict[str, Any]) -> None:
    """totals[k] += float(metrics[k]) for every metric (in place)."""
    for k, v in metrics.items():
        totals[k] = totals.get(k, 0.0) + _as_float(v)


# ---------------------------------------------------------------------------------------------- the worker
class PolicyWorker(RestartableWorker, ABC):
    """One rank of a policy (a Ray actor started by WorkerGroup; the process group exists before the model), and
    a WeightSource (weights/protocols.py) whose `weight_sender` the refitters drive.

    self.parallel_layout is the validated (dp, tp, pp, cp) layout; self.context this rank's context-parallel
    group (backends/context_parallel.py: its ranks get the same rows, each runs a share of their positions).
    Subclasses set in `_build_model`:
    self.model, self.dp_rank, self.dp_size, self.output_rank (this rank returns the results of its data-parallel
    group) and, for tied weights, self.tied_aliases.
    """

    tied_aliases: frozenset = frozenset()  # state_dict names aliasing an earlier one (HF drops them when saving)
    router: Optional[RouterLosses] = None  # a Mixture-of-Experts model's router terms (set by _build_model)

    def __init__(self, cfg, model_path: str, *, scalar_head: bool = False, init_reference: bool = False,
                 seed: int = 0):
        self.cfg, self.model_path, self.scalar_head, self.seed = cfg, model_path, scalar_head, seed
        self.device = init_torch_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.parallel_layout: ParallelLayout = policy_layout(cfg, self.world_size)
        self.context = context_group(self.parallel_layout, self.rank)
        torch.manual_seed(seed)
        self._build_model()
        self.optimizer = self._make_optimizer([p for p in self.model.parameters() if p.requires_grad])
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lr_warmup_factor(cfg.optimizer.warmup_steps))
        self.reference: Optional[dict[str, torch.Tensor]] = None
        if init_reference and cfg.lora.enabled:  # the frozen base model is the reference: nothing to copy
            self.reference = {}
        elif init_reference:  # the initial weights: a CPU copy of this rank's local shards
            self.reference = {n: t.detach().to("cpu", copy=True) for n, t in self._local_weights().items()}
        self.weight_sender = WeightSender(self)
        self.held: dict[str, dict[str, Any]] = {}  # key -> this rank's shard of a shipped batch (Policy.ship)

    def teardown(self) -> None:
        """Drop the model, the optimizer and the process groups (spare_workers.py: this process may host another
        policy's rank next), and this process's kernel call counts, which describe the rank it hosted."""
        varlen.CALLS.clear()
        context_parallel.CALLS.clear()
        super().teardown()

    # ------------------------------------------------------------------------------------------ back end
    @abstractmethod
    def _build_model(self) -> None:
        """Load, parallelize and place the model; set model, dp_rank, dp_size, output_rank."""

    @abstractmethod
    def _logprobs(self, inputs: ModelInputs) -> torch.Tensor:
        """A micro-batch's model inputs (padded rows or one packed row, on device) -> per-position log-probs
        [r, t]: position p holds log p(token p | the tokens before it), 0 where inputs.token_mask is 0."""

    @abstractmethod
    def _scores(self, inputs: ModelInputs) -> torch.Tensor:
        """Model inputs -> the scalar head's output at each sequence's last token, [b]."""

    @abstractmethod
    def _grad_norm(self) -> float:
        """Collective: the global L2 norm of the gradients the optimizer steps, each element counted once."""

    @abstractmethod
    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's local gradient tensors of what the optimizer steps (scaled in place when clipping)."""

    @abstractmethod
    def _local_weights(self) -> dict[str, torch.Tensor]:
        """name -> this rank's local tensor aliasing the live parameter (for reference swaps)."""

    # WeightSource (weights/protocols.py)
    @abstractmethod
    def weight_specs(self) -> list[TensorSpec]:
        """(HF name, full shape, dtype) of every tensor of the HF state_dict, in order; same on all ranks."""

    @abstractmethod
    def gather_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Collective: full CPU tensors for `names` (meaningful on rank 0)."""

    def trained_weight_names(self, names: list[str]) -> set[str]:
        """All of `names`; LoRA: the engine's layers under adapters."""
        if not self.cfg.lora.enabled:
            return set(names)
        return lora.trained_names(names, lora.target_modules(self.cfg.lora))

    def write_weight_bucket(self, bucket: list[TensorSpec], views: Optional[dict[str, torch.Tensor]],
                            in_place: bool) -> None:
        """Collective: the bucket into the refit region, gathered on rank 0; a back end whose ranks can each
        write their own shards overrides it for `in_place`."""
        write_gathered(self, bucket, views)

    def save_pretrained(self, path: str) -> None:
        """Collective: a Hugging Face directory of the current weights (weights/sender.py)."""
        self.weight_sender.save_pretrained(path, self.model_path, self._hf_config())

    def _adapter_state(self) -> dict[str, torch.Tensor]:
        """Collective (LoRA): every adapter as a full CPU tensor under peft's key (models/lora.py), on rank 0."""
        raise NotImplementedError(f"{type(self).__name__} has no LoRA adapters")

    def adapter_state(self) -> Optional[dict[str, torch.Tensor]]:
        """Collective: the adapters under peft's keys (rank 0; None elsewhere)."""
        state = self._adapter_state()
        return state if self.rank == 0 else None

    def save_adapter(self, path: str) -> None:
        """Collective: a PEFT adapter directory that peft.PeftModel.from_pretrained loads on the base model."""
        state = self._adapter_state()
        if self.rank == 0:
            lora.save_adapter_dir(path, state, self.cfg.lora, self.model_path)

    @abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Collective: model + optimizer + scheduler + RNG state of every rank under `path`."""

    @abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Collective: restore what save_checkpoint wrote."""

    def _make_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over this rank's trainable parameters (policy.optimizer)."""
        return build_optimizer(params, self.cfg.optimizer)

    def _after_optimizer_step(self) -> None:
        """Hook right after optimizer.step() (e.g. copy fp32 master weights into low-precision parameters)."""

    def _hf_config(self):
        """The transformers config of the model actually built (architecture, num_labels), saved with it."""
        return self.model.config

    def _finish_gradients(self) -> None:
        """Hook after the last backward of a step (e.g. reduce gradients a parallelism leaves partial)."""

    def _data_parallel_group(self):
        """The process group of the ranks that take different rows (x context-parallel ranks), for the router
        statistics; None: one rank."""
        return None

    def _set_gradient_sync(self, enabled: bool) -> None:
        """Before a micro-batch's backward: False lets the back end defer its data-parallel gradient reduction
        (the last micro-batch of a step always has it True)."""

    def offload(self) -> None:
        """Move model, optimizer parameters (e.g. fp32 masters) and optimizer state off the accelerator (no-op
        on CPU), e.g. while a colocated engine generates."""
        if self.device.type == "cuda":
            self._move(torch.device("cpu"))
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Bring them back (no-op on CPU)."""
        if self.device.type == "cuda":
            self._move(self.device)

    def _move(self, device: torch.device) -> None:
        self._move_parameters(device)
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and k != "step":
                    state[k] = v.to(device)

    def _move_parameters(self, device: torch.device) -> None:
        """The model and the tensors the optimizer steps (e.g. fp32 masters) to `device`."""
        self.model.to(device)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.data = p.data.to(device)

    def optimizer_memory(self) -> dict[str, float]:
        """This rank's trainable parameter elements and optimizer-state bytes (e.g. LoRA vs full, bench/lora.py)."""
        state = sum(v.numel() * v.element_size() for s in self.optimizer.state.values() for k, v in s.items()
                    if isinstance(v, torch.Tensor) and k != "step")
        params = sum(p.numel() for g in self.optimizer.param_groups for p in g["params"])
        return {"trainable_parameters": float(params), "optimizer_state_bytes": float(state)}

    # ------------------------------------------------------------------------------------------ checkpoint helpers
    def _save_rank_state(self, path: str, **extra: Any) -> None:
        checkpoint_state.save_rank_state(path, self.rank, self.scheduler, **extra)

    def _load_rank_state(self, path: str) -> dict[str, Any]:
        return checkpoint_state.load_rank_state(path, self.rank)

    def _restore_schedule_and_rng(self, state: dict[str, Any]) -> None:
        checkpoint_state.restore_schedule_and_rng(state, self.scheduler, self.optimizer)

    # ------------------------------------------------------------------------------------------ driver API
    def layout(self) -> dict[str, Any]:
        """Where this rank sits: rank, dp_rank, dp_size, output_rank (1 if it returns its DP group's results),
        and what it runs on: device ("cuda:0" | "cpu") and dist_backend ("nccl" | "gloo")."""
        return {"rank": self.rank, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "output_rank": int(self.output_rank), "device": str(self.device), "dist_backend": dist.get_backend()}

    def process_group_report(self) -> dict[str, Any]:
        """Where this rank's process groups are (distributed/interfaces.py): hostname, address (the node's Ray
        address), interface (what they bind; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME win when set) and peers
        (remote IPv4 addresses of its established TCP connections)."""
        return process_group_report()

    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _width_multiple(self) -> int:
        """Columns of a forward are a multiple of this: policy.sequence_packing.sequence_length_round for packed
        rows, else 1; and of 2 x cp under context parallelism (a back end may need more, e.g. Megatron's
        sequence parallelism)."""
        packing = self.cfg.sequence_packing
        return math.lcm(packing.sequence_length_round if packing.enabled else 1, 2 * self.context.size)

    def _model_inputs(self, mb: dict[str, Any], width: Optional[int] = None) -> ModelInputs:
        """A micro-batch on device -> what the model takes: padded rows, or one packed row with sequence
        packing on (nemo_grpo/backends/model_inputs.py); this rank's share of their positions under context
        parallelism."""
        inputs = model_inputs(mb, self.cfg.sequence_packing.enabled, self._width_multiple(), width,
                              dense_mask=self._dense_packing_mask() and self.context.size == 1)
        return split_context(inputs, self.context)

    def _dense_packing_mask(self) -> bool:
        """Packed rows attend through a dense block-diagonal mask (policy.sequence_packing.attention=mask), not
        per segment (a back end whose attention cannot go per segment says so too)."""
        return self.cfg.sequence_packing.attention == "mask"

    def _forward_logprobs(self, mb: dict[str, Any], inputs: Optional[ModelInputs] = None) -> torch.Tensor:
        """Micro-batch on device (and its model inputs, if made already) -> logprobs [b, T] (grad follows the
        caller's mode)."""
        inputs = self._model_inputs(mb) if inputs is None else inputs
        return inputs.to_rows(self._logprobs(inputs), mb["input_ids"].shape[1])

    def _forward_scores(self, mb: dict[str, Any], inputs: Optional[ModelInputs] = None) -> torch.Tensor:
        """Micro-batch on device (and its model inputs, if made already) -> scalar-head scores [b] in fp32."""
        return self._scores(self._model_inputs(mb) if inputs is None else inputs).float()

    def _train_output(self, mb: dict[str, Any], inputs: ModelInputs) -> torch.Tensor:
        """Micro-batch on device and its model inputs -> what the loss takes: log-probs [b, T] of a causal LM,
        or the scalar head's scores [b] (reward-model training)."""
        return self._forward_scores(mb, inputs) if self.scalar_head else self._forward_logprobs(mb, inputs)

    def _train_loss(self, loss_fn, output: torch.Tensor, mb: dict[str, Any], inputs: ModelInputs,
                    gvs: torch.Tensor, gvt: torch.Tensor, totals: dict[str, float]) -> torch.Tensor:
        """A micro-batch's loss contribution to backpropagate: loss_fn's, plus a Mixture-of-Experts model's
        router terms (backends/router.py) over the positions the forward saw (unless each pipeline stage adds its
        own layers'); its metrics added to totals."""
        loss, metrics = loss_and_metrics(loss_fn, output, mb, gvs, gvt)
        if self.router is not None and self.router.stages is None:
            real = inputs.token_mask if inputs.context is None else inputs.context.take(inputs.token_mask)
            recorded = mb.get("routed_experts")
            if recorded is not None and inputs.context is None:
                recorded = inputs.from_rows(recorded, -1)  # [r, t, L, k]
            loss = loss + self.router.add(real, metrics, recorded)
        accumulate(totals, metrics)
        return loss

    def hold(self, key: str, rows: dict[str, Any]) -> None:
        """Keep this rank's shard of a shipped batch under `key` until release(key) (Policy.ship)."""
        self.held[key] = rows

    def release(self, key: str) -> None:
        """Drop the shard held under `key` and what forwards kept in it."""
        self.held.pop(key, None)

    @torch.no_grad()
    def _chunked(self, key: str, fn, micro_batches: list[list[int]], keep: tuple[str, ...] = ()) -> Any:
        """Run fn in eval mode over the row groups `micro_batches` of the shard held under `key` (Policy plans
        them); the results in row order on output ranks (None elsewhere). keep: the names under which every rank
        also writes them into the shard, one per result (fn's tuple, or its one tensor)."""
        self.model.eval()
        data = self.held[key]
        outs = [fn(self._to_device(take_rows(data, g))) for g in micro_batches]
        if not self.output_rank and not keep:
            return None
        order = torch.tensor([i for g in micro_batches for i in g])

        def in_row_order(parts: list[torch.Tensor]) -> torch.Tensor:
            cat = torch.cat([p.cpu() for p in parts])
            return torch.empty_like(cat).index_copy_(0, order, cat)
        results = tuple(in_row_order(list(parts)) for parts in zip(*outs)) if isinstance(outs[0], tuple) \
            else in_row_order(outs)
        data.update(zip(keep, results if isinstance(results, tuple) else (results,)))
        return results if self.output_rank else None

    def get_logprobs(self, key: str, micro_batches: list[list[int]], return_routes: bool = False,
                     keep: Optional[str] = None) -> Any:
        """The rows held under `key` (input_ids, input_lengths), in the row groups `micro_batches` -> logprobs
        [b, T] (None on non-output ranks); with return_routes (a Mixture-of-Experts model), (logprobs,
        routed_experts [b, T, L, k] int16: the experts each position was routed to in each MoE layer, -1 on
        padding). keep: also write the log-probs into the held shard under that name (and the routes under
        "routed_experts"), for train's loss."""
        if not return_routes:
            return self._chunked(key, self._forward_logprobs, micro_batches, (keep,) if keep else ())
        if self.router is None:
            raise RuntimeError("get_logprobs(return_routes=True): the model has no Mixture-of-Experts layers")
        with self.router.recorder.eval_routes():
            return self._chunked(key, self._logprobs_and_routes, micro_batches,
                                 (keep, "routed_experts") if keep else ())

    def _logprobs_and_routes(self, mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch on device -> (logprobs [b, T], routed_experts [b, T, L, k] int16, -1 on padding)."""
        inputs = self._model_inputs(mb)
        self.router.recorder.start()
        logprobs = self._forward_logprobs(mb, inputs)
        _, routes = self.router.recorder.take()  # per layer of this rank's [r * t, k]
        r, t = inputs.token_mask.shape
        stacked = self.router.all_layers(routes).reshape(r, t, -1, self.router.top_k)
        return logprobs, inputs.to_rows(stacked, mb["input_ids"].shape[1], column_0=True, fill=-1).to(torch.int16)

    def get_reference_logprobs(self, key: str, micro_batches: list[list[int]], keep: Optional[str] = None
                               ) -> Optional[torch.Tensor]:
        """Like get_logprobs, with the initial weights swapped in for the forward and swapped back after."""
        if self.reference is None:
            raise RuntimeError("get_reference_logprobs: this policy was built with init_reference=False")
        with self._reference_weights():
            return self.get_logprobs(key, micro_batches, keep=keep)

    def score(self, key: str, micro_batches: list[list[int]]) -> Optional[torch.Tensor]:
        """The rows held under `key` -> scalar-head scores [b] at the last real token (None on non-output
        ranks)."""
        if not self.scalar_head:
            raise RuntimeError("score: this policy has no scalar head (build it with scalar_head=True)")
        return self._chunked(key, self._forward_scores, micro_batches)

    @contextlib.contextmanager
    def _reference_weights(self) -> Iterator[None]:
        if self.cfg.lora.enabled:  # the base model: adapters off
            with lora.adapters_disabled(self.model):
                yield
            return
        live = self._local_weights()
        saved = {n: t.detach().to("cpu", copy=True) for n, t in live.items()}
        with torch.no_grad():
            for n, t in live.items():
                t.copy_(self.reference[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, t in live.items():
                    t.copy_(saved[n])

    # ------------------------------------------------------------------------------------------ training
    def train(self, key: str, columns: dict[str, Any], steps: list[dict[str, Any]],
              loss_fn) -> list[dict[str, float]]:
        """The rows held under `key` (with what forwards kept there) and the call's per-row `columns` (same rows,
        same order) -> one optimizer step per entry {"rows": (start, stop) of them, "global_valid_seqs",
        "global_valid_toks", "global_input_toks", "micro_batches": row groups of those (Policy plans them)}.

        Returns per step: the loss-fn metrics (and "loss") summed over this rank's micro-batches, plus
        "grad_norm" (global, pre-clip) and "lr" (the rate the step used); a Mixture-of-Experts model adds
        "moe/aux_loss" (summed like the loss) and "moe/load_imbalance" (global) (backends/router.py).
        """
        self.model.train()
        data = {**self.held[key], **columns}
        return [self._train_step(slice_batch(data, *s["rows"]), loss_fn, s["global_valid_seqs"],
                                 s["global_valid_toks"], s["micro_batches"], s["global_input_toks"])
                for s in steps]

    def _train_step(self, data: dict[str, Any], loss_fn, global_valid_seqs, global_valid_toks,
                    groups: list[list[int]], global_input_toks) -> dict[str, float]:
        """zero_grad -> forward/backward over the micro-batches `groups` (row groups of `data`) -> finish grads
        -> clip -> step; written once. A non-finite gradient norm skips the optimizer and scheduler step
        ("skipped_steps": 1). global_input_toks: the global batch's real tokens (prompts and responses), by
        which a Mixture-of-Experts model's router terms are weighted."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.router is not None:
            self.router.start_step(global_input_toks)
        gvs = torch.as_tensor(global_valid_seqs, dtype=torch.float32, device=self.device)
        gvt = torch.as_tensor(global_valid_toks, dtype=torch.float32, device=self.device)
        micro_batches = [take_rows(data, g) for g in groups]
        totals = self._forward_backward(micro_batches, loss_fn, gvs, gvt)
        self._finish_gradients()
        grad_norm = self._grad_norm()
        coef = clip_coefficient(grad_norm, self.cfg.max_grad_norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        if coef is not None:
            if coef < 1.0:
                with torch.no_grad():
                    torch._foreach_mul_(self._local_grads(), coef)
            self.optimizer.step()
            self._after_optimizer_step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.router is not None:
            totals.update(self.router.step_metrics(self._data_parallel_group()))
        return {**totals, "grad_norm": grad_norm, "lr": lr, "skipped_steps": float(coef is None),
                "micro_batches": float(len(micro_batches))}

    def _forward_backward(self, micro_batches: list[dict[str, Any]], loss_fn, gvs: torch.Tensor,
                          gvt: torch.Tensor) -> dict[str, float]:
        """Forward + backward of every micro-batch (CPU rows, sliced from this rank's data); returns the loss-fn
        metrics (and "loss") summed over them. A back end whose forward is a pipeline schedule overrides this
        loop and calls `_train_loss` from its schedule's loss closure."""
        totals: dict[str, float] = {}
        for i, mb in enumerate(micro_batches):
            mb = self._to_device(mb)
            self._set_gradient_sync(i == len(micro_batches) - 1)
            inputs = self._model_inputs(mb)
            if self.router is not None:
                self.router.recorder.start()
            self._train_loss(loss_fn, self._train_output(mb, inputs), mb, inputs, gvs, gvt, totals).backward()
        return totals
