"""`PolicyActor`: one rank of a policy, the one Ray actor class of every back end. The step sequence and the data
contract live here, once; the back end is a narrow `PolicyEngine` (backends/engine.py) picked by policy.backend.

Data contract (driver <-> actor): batches as in nemo_grpo/backends/batching.py.
Log-probs: logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t]) from logits / generation.temperature;
  column 0 and padding positions are 0.
Loss: `loss, metrics = loss_fn(logprobs [b, T], mb, global_valid_seqs, global_valid_toks)` (scalar-head models:
  scores [b] in place of the log-probs, e.g. the Bradley-Terry loss); the normalizers
  count the whole global batch (all micro-batches and data-parallel ranks); the loss and every metric are
  additive contributions, so the sum over micro-batches and ranks is the global value. The actor
  backpropagates the contribution as-is; an engine makes its data-parallel reduction a sum, not a mean.

The actor owns the Ray side (the driver API below), the training step (zero_grad -> the engine's forward_backward
over the micro-batches -> finish grads -> clip -> step -> schedule), the reference weights, offload, the
checkpoint's per-rank state and the exports; its `weight_sender` drives the engine, which is the rank's
WeightSource (weights/protocols.py). The optimizer's schedule and the clipping rule are
nemo_grpo/backends/optimizer.py's; per-rank checkpoint state is checkpoint_state.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from functools import partial
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from nemo_grpo.backends import checkpoint_state
from nemo_grpo.backends.batching import slice_batch, take_rows
from nemo_grpo.backends.context_parallel import context_group
from nemo_grpo.backends.engine import EngineSetup, PolicyEngine, on_device
from nemo_grpo.backends.model_inputs import ModelInputs
from nemo_grpo.backends.optimizer import clip_coefficient, lr_warmup_factor
from nemo_grpo.backends.registry import backend_spec, policy_layout
from nemo_grpo.distributed.interfaces import process_group_report
from nemo_grpo.distributed.worker_group import init_torch_distributed
from nemo_grpo.models import lora
from nemo_grpo.precision import choose_precision
from nemo_grpo.weights.sender import WeightSender


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


_ROW = "shard_row"  # an on-policy step's column: each row's index in the held shard


def _own_prev_logprobs(loss_fn, shard: dict[str, Any], logprobs: torch.Tensor, mb: dict[str, Any], gvs, gvt):
    """loss_fn with the micro-batch's "prev_logprobs" the training forward's own (logprobs [b, T], detached),
    written into the shard's "prev_logprobs" at the micro-batch's rows (an exactly on-policy step)."""
    prev = logprobs.detach()
    shard["prev_logprobs"][mb[_ROW].cpu()] = prev.float().cpu()
    return loss_fn(logprobs, {**mb, "prev_logprobs": prev}, gvs, gvt)


class PolicyActor:
    """One rank of a policy (a Ray actor started by WorkerGroup; the process group exists before the engine).

    self.engine is the back end's PolicyEngine; self.weight_sender the WeightSender over it that the refitters
    drive (weights/refit.py); self.reference the initial weights (a CPU copy of this rank's local shards; {} with
    LoRA, whose frozen base is the reference; None without init_reference).
    """

    def __init__(self, cfg, model_path: str, *, scalar_head: bool = False, init_reference: bool = False,
                 seed: int = 0):
        self.device = init_torch_distributed()
        self.precision = choose_precision(cfg.precision, self.device)  # "auto" -> this device's choice
        cfg = dataclasses.replace(cfg, precision=self.precision.precision)
        self.cfg, self.model_path, self.scalar_head = cfg, model_path, scalar_head
        self.rank, world_size = dist.get_rank(), dist.get_world_size()
        layout = policy_layout(cfg, world_size)
        torch.manual_seed(seed)
        self.engine: PolicyEngine = backend_spec(cfg.backend).engine_class()(EngineSetup(
            cfg, model_path, scalar_head, seed, self.device, self.rank, world_size, layout,
            context_group(layout, self.rank)))
        self.optimizer = self.engine.optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lr_warmup_factor(cfg.optimizer.warmup_steps))
        self.reference: Optional[dict[str, torch.Tensor]] = None
        if init_reference and cfg.lora.enabled:  # the frozen base model is the reference: nothing to copy
            self.reference = {}
        elif init_reference:  # the initial weights: a CPU copy of this rank's local shards
            self.reference = {n: t.detach().to("cpu", copy=True) for n, t in self.engine.local_weights().items()}
        self.weight_sender = WeightSender(self.engine)
        self.held: dict[str, dict[str, Any]] = {}  # key -> this rank's shard of a shipped batch (Policy.ship)

    def close(self) -> None:
        """Let go of the engine and what it made beyond its own objects (engine.close: e.g. Megatron's
        model-parallel state); the actor serves no call after it. Idempotent."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.close()

    # ------------------------------------------------------------------------------------------ driver API
    def layout(self) -> dict[str, Any]:
        """Where this rank sits: rank, dp_rank, dp_size, output_rank (1 if it returns its DP group's results),
        and what it runs on: device ("cuda:0" | "cpu"), dist_backend ("nccl" | "gloo") and precision (the
        PrecisionChoice, as a dict)."""
        e = self.engine
        return {"rank": self.rank, "dp_rank": e.dp_rank, "dp_size": e.dp_size, "output_rank": int(e.output_rank),
                "device": str(self.device), "dist_backend": dist.get_backend(), "precision": self.precision.as_dict()}

    def process_group_report(self) -> dict[str, Any]:
        """Where this rank's process groups are (distributed/interfaces.py): hostname, address (the node's Ray
        address), interface (what they bind; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME win when set) and peers
        (remote IPv4 addresses of its established TCP connections)."""
        return process_group_report()

    def save_pretrained(self, path: str) -> None:
        """Collective: a Hugging Face directory of the current weights (weights/sender.py)."""
        self.weight_sender.save_pretrained(path, self.model_path, self.engine.hf_config)

    def adapter_state(self) -> Optional[dict[str, torch.Tensor]]:
        """Collective: the adapters under peft's keys (rank 0; None elsewhere)."""
        state = self.engine.adapter_state()
        return state if self.rank == 0 else None

    def save_adapter(self, path: str) -> None:
        """Collective: a PEFT adapter directory that peft.PeftModel.from_pretrained loads on the base model."""
        state = self.engine.adapter_state()
        if self.rank == 0:
            lora.save_adapter_dir(path, state, self.cfg.lora, self.model_path)

    def save_checkpoint(self, path: str) -> None:
        """Collective: model + optimizer (the engine's format) + scheduler + RNG state of every rank under `path`."""
        os.makedirs(path, exist_ok=True)
        extra = self.engine.save_checkpoint(path)
        checkpoint_state.save_rank_state(path, self.rank, self.scheduler, **extra)
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Collective: restore what save_checkpoint wrote (at any layout the engine's format allows); the RNG
        states only when the checkpoint has this rank's file."""
        state = checkpoint_state.load_rank_state(path, self.rank)
        self.engine.load_checkpoint(path, state)
        checkpoint_state.restore_schedule_and_rng(state, self.scheduler, self.optimizer)

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
        self.engine.move(device)
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and k != "step":
                    state[k] = v.to(device)

    def optimizer_memory(self) -> dict[str, float]:
        """This rank's trainable parameter elements and optimizer-state bytes (e.g. LoRA vs full, bench/lora.py)."""
        state = sum(v.numel() * v.element_size() for s in self.optimizer.state.values() for k, v in s.items()
                    if isinstance(v, torch.Tensor) and k != "step")
        params = sum(p.numel() for g in self.optimizer.param_groups for p in g["params"])
        return {"trainable_parameters": float(params), "optimizer_state_bytes": float(state)}

    # ------------------------------------------------------------------------------------------ forward
    def _forward_logprobs(self, mb: dict[str, Any], inputs: Optional[ModelInputs] = None) -> torch.Tensor:
        """Micro-batch on device (and its model inputs, if made already) -> logprobs [b, T]."""
        inputs = self.engine.model_inputs(mb) if inputs is None else inputs
        return inputs.to_rows(self.engine.forward(inputs), mb["input_ids"].shape[1])

    def _forward_scores(self, mb: dict[str, Any]) -> torch.Tensor:
        """Micro-batch on device -> scalar-head scores [b] in fp32."""
        return self.engine.forward(self.engine.model_inputs(mb)).float()

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
        self.engine.model.eval()
        data = self.held[key]
        outs = [fn(on_device(take_rows(data, g), self.device)) for g in micro_batches]
        if not self.engine.output_rank and not keep:
            return None
        order = torch.tensor([i for g in micro_batches for i in g])

        def in_row_order(parts: list[torch.Tensor]) -> torch.Tensor:
            cat = torch.cat([p.cpu() for p in parts])
            return torch.empty_like(cat).index_copy_(0, order, cat)
        results = tuple(in_row_order(list(parts)) for parts in zip(*outs)) if isinstance(outs[0], tuple) \
            else in_row_order(outs)
        data.update(zip(keep, results if isinstance(results, tuple) else (results,)))
        return results if self.engine.output_rank else None

    def get_logprobs(self, key: str, micro_batches: list[list[int]], return_routes: bool = False,
                     keep: Optional[str] = None) -> Any:
        """The rows held under `key` (input_ids, input_lengths), in the row groups `micro_batches` -> logprobs
        [b, T] (None on non-output ranks); with return_routes (a Mixture-of-Experts model), (logprobs,
        routed_experts [b, T, L, k] int16: the experts each position was routed to in each MoE layer, -1 on
        padding). keep: also write the log-probs into the held shard under that name (and the routes under
        "routed_experts"), for train's loss."""
        if not return_routes:
            return self._chunked(key, self._forward_logprobs, micro_batches, (keep,) if keep else ())
        if self.engine.router is None:
            raise RuntimeError("get_logprobs(return_routes=True): the model has no Mixture-of-Experts layers")
        with self.engine.router.recorder.eval_routes():
            return self._chunked(key, self._logprobs_and_routes, micro_batches,
                                 (keep, "routed_experts") if keep else ())

    def _logprobs_and_routes(self, mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch on device -> (logprobs [b, T], routed_experts [b, T, L, k] int16, -1 on padding)."""
        router = self.engine.router
        inputs = self.engine.model_inputs(mb)
        router.recorder.start()
        logprobs = self._forward_logprobs(mb, inputs)
        _, routes = router.recorder.take()  # per layer of this rank's [r * t, k]
        r, t = inputs.token_mask.shape
        stacked = router.all_layers(routes).reshape(r, t, -1, router.top_k)
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
            with lora.adapters_disabled(self.engine.model):
                yield
            return
        live = self.engine.local_weights()
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
              loss_fn, on_policy: bool = False) -> list[dict[str, float]]:
        """The rows held under `key` (with what forwards kept there) and the call's per-row `columns` (same rows,
        same order) -> one optimizer step per entry {"rows": (start, stop) of them, "global_valid_seqs",
        "global_valid_toks", "global_input_toks", "micro_batches": row groups of those (Policy plans them)}.
        on_policy (one step): the loss's "prev_logprobs" are the training forward's log-probs, detached, and the
        ranks that run the loss keep them in the shard under "prev_logprobs" (`kept`).

        Returns per step: the loss-fn metrics (and "loss") summed over this rank's micro-batches, plus
        "grad_norm" (global, pre-clip) and "lr" (the rate the step used); a Mixture-of-Experts model adds
        "moe/aux_loss" (summed like the loss) and "moe/load_imbalance" (global) (backends/router.py).
        """
        self.engine.model.train()
        data = {**self.held[key], **columns}
        if on_policy:  # one step (Policy.train checks)
            self.held[key]["prev_logprobs"] = torch.zeros(data["input_ids"].shape, dtype=torch.float32)
            data[_ROW] = torch.arange(data["input_ids"].shape[0])
        loss_fn = partial(_own_prev_logprobs, loss_fn, self.held[key]) if on_policy else loss_fn
        return [self._train_step(slice_batch(data, *s["rows"]), loss_fn, s["global_valid_seqs"],
                                 s["global_valid_toks"], s["micro_batches"], s["global_input_toks"])
                for s in steps]

    def kept(self, key: str, name: str) -> Optional[torch.Tensor]:
        """What a call kept in the shard held under `key` under `name` ([r, ...], output ranks; None elsewhere)."""
        return self.held[key][name] if self.engine.output_rank else None

    def _train_step(self, data: dict[str, Any], loss_fn, global_valid_seqs, global_valid_toks,
                    groups: list[list[int]], global_input_toks) -> dict[str, float]:
        """zero_grad -> the engine's forward/backward over the micro-batches `groups` (row groups of `data`) ->
        finish grads -> clip -> step -> schedule; written once. A non-finite gradient norm skips the optimizer
        and scheduler step ("skipped_steps": 1). global_input_toks: the global batch's real tokens (prompts and
        responses), by which a Mixture-of-Experts model's router terms are weighted."""
        engine, router = self.engine, self.engine.router
        self.optimizer.zero_grad(set_to_none=True)
        if router is not None:
            router.start_step(global_input_toks)
        gvs = torch.as_tensor(global_valid_seqs, dtype=torch.float32, device=self.device)
        gvt = torch.as_tensor(global_valid_toks, dtype=torch.float32, device=self.device)
        micro_batches = [take_rows(data, g) for g in groups]
        totals: dict[str, float] = {}
        engine.forward_backward(micro_batches, partial(self._micro_batch_loss, loss_fn, gvs, gvt, totals))
        grad_norm = engine.reduce_gradients()
        coef = clip_coefficient(grad_norm, self.cfg.max_grad_norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        if coef is not None:
            if coef < 1.0:
                with torch.no_grad():
                    torch._foreach_mul_(engine.local_grads(), coef)
            engine.optimizer_step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if router is not None:
            totals.update(router.step_metrics(engine.data_parallel_group))
        return {**totals, "grad_norm": grad_norm, "lr": lr, "skipped_steps": float(coef is None),
                "micro_batches": float(len(micro_batches))}

    def _micro_batch_loss(self, loss_fn, gvs: torch.Tensor, gvt: torch.Tensor, totals: dict[str, float],
                          mb: dict[str, Any], inputs: ModelInputs, output: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss contribution to backpropagate (the engine's MicroBatchLoss): loss_fn on the
        log-probs [b, T] (or the scores [b] in fp32), plus a Mixture-of-Experts model's router terms
        (backends/router.py) over the positions the forward saw (unless each pipeline stage adds its own
        layers'); its metrics added to totals."""
        rows = output.float() if self.scalar_head else inputs.to_rows(output, mb["input_ids"].shape[1])
        loss, metrics = loss_and_metrics(loss_fn, rows, mb, gvs, gvt)
        router = self.engine.router
        if router is not None and router.stages is None:
            real = inputs.token_mask if inputs.context is None else inputs.context.take(inputs.token_mask)
            recorded = mb.get("routed_experts")
            if recorded is not None and inputs.context is None:
                recorded = inputs.from_rows(recorded, -1)  # [r, t, L, k]
            loss = loss + router.add(real, metrics, recorded)
        accumulate(totals, metrics)
        return loss
