"""`PolicyWorker`: one rank of a policy. The step sequence, micro-batching and the data contract live here, once.

Data contract (driver <-> worker). A batch is a dict of tensors with the samples along dim 0:
  input_ids [B, T] long, right-padded; input_lengths [B] long (the attention mask is derived from it);
  for training also token_mask [B, T] float (1 on trained tokens), sample_mask [B] float, advantages [B, T],
  prev_logprobs [B, T], generation_logprobs [B, T], optionally reference_policy_logprobs [B, T].
  Any other key (tensor or list with B entries) reaches the loss unchanged, sliced along dim 0.
Log-probs: logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t]) from logits / generation.temperature;
  column 0 and padding positions are 0.
Loss: `loss, metrics = loss_fn(logprobs [b, T], mb, global_valid_seqs, global_valid_toks)` (scalar-head models:
  scores [b] in place of the log-probs, e.g. the Bradley-Terry loss); the normalizers
  count the whole global batch (all micro-batches and data-parallel ranks); the loss and every metric are
  additive contributions, so the sum over micro-batches and ranks is the global value. The worker
  backpropagates the contribution as-is; a back end makes its data-parallel reduction a sum, not a mean.

A back end subclasses PolicyWorker and supplies only what differs: building and parallelizing the model
(`_build_model`), the forward pass to log-probs / scores, gradient finishing and the clipped norm, the local
weight tensors, the full-weight export (`_export_specs`, `_export_tensors`) and the checkpoint format. The
weight export feeds three consumers written once here: `export_weight_bucket` (buckets through Ray's object
store), `send_weights` (buckets broadcast over a weight-transfer group to separate engine workers, see
nemo_grpo/generation/refit.py) and `save_pretrained`.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterator, Optional

import torch

from nemo_grpo.distributed import weight_transfer as wt
from nemo_grpo.distributed.weight_transfer import TensorSpec

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


# ---------------------------------------------------------------------------------------------- pure helpers
def batch_size_of(batch: dict[str, Any]) -> int:
    return int(batch["input_ids"].shape[0])


def slice_batch(batch: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Rows [start, stop) of every per-sample entry (tensors and lists with B entries); other values as-is."""
    n = batch_size_of(batch)
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n:
            out[key] = value[start:stop]
        elif isinstance(value, (list, tuple)) and len(value) == n:
            out[key] = value[start:stop]
        else:
            out[key] = value
    return out


def split_sizes(n: int, parts: int) -> list[int]:
    """n rows into `parts` contiguous shards as even as possible (the first n % parts get one more)."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def attention_mask_from_lengths(input_lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B] lengths -> [B, seq_len] long mask, 1 on the first input_lengths[i] positions (right padding)."""
    return (torch.arange(seq_len, device=input_lengths.device)[None, :] < input_lengths[:, None]).long()


def pool_last_token(out: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
    """Scalar-head output [b, s, 1] -> [b], taken at each row's last real token (input_lengths - 1)."""
    rows = torch.arange(out.shape[0], device=out.device)
    return out[rows, (input_lengths.to(out.device) - 1).clamp(min=0), 0]


def token_logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                               temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V] (full vocabulary), input_ids [B, T], attention_mask [B, T] -> logprobs [B, T].

    logprobs[:, t] = log_softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]; column 0 and padding are 0.
    """
    scaled = logits[:, :-1].float() / temperature  # [B, T-1, V]
    target = input_ids[:, 1:, None]  # [B, T-1, 1]
    lp = scaled.gather(-1, target).squeeze(-1) - torch.logsumexp(scaled, dim=-1)  # [B, T-1]
    lp = torch.where(attention_mask[:, 1:].bool(), lp, torch.zeros_like(lp))
    return torch.nn.functional.pad(lp, (1, 0))  # [B, T]


def lr_warmup_factor(warmup_steps: int) -> Callable[[int], float]:
    """LambdaLR factor: linear warm-up lr * (s + 1) / warmup_steps for the first warmup_steps steps, then lr."""
    def factor(step: int) -> float:
        return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)
    return factor


def optimizer_class(opt_cfg) -> tuple[type, dict[str, Any]]:
    """policy.optimizer (adamw | sgd) -> (torch optimizer class, its keyword arguments)."""
    if opt_cfg.name == "adamw":
        return torch.optim.AdamW, dict(lr=opt_cfg.lr, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps,
                                       weight_decay=opt_cfg.weight_decay)
    if opt_cfg.name == "sgd":
        return torch.optim.SGD, dict(lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay)
    raise ValueError(f"policy.optimizer.name '{opt_cfg.name}' is unknown; known: adamw, sgd")


def build_optimizer(params, opt_cfg) -> torch.optim.Optimizer:
    """policy.optimizer over `params`."""
    cls, kwargs = optimizer_class(opt_cfg)
    return cls(params, **kwargs)


def plan_buckets(sizes: list[tuple[str, int]], bucket_bytes: float) -> list[list[str]]:
    """Group (name, nbytes) in order into buckets of at most bucket_bytes (always >= 1 tensor per bucket)."""
    buckets, current, used = [], [], 0
    for name, nbytes in sizes:
        if current and used + nbytes > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current:
        buckets.append(current)
    return buckets


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
class PolicyWorker(ABC):
    """One rank of a policy (a Ray actor started by WorkerGroup; the process group exists before the model).

    Subclasses set in `_build_model`: self.model, self.dp_rank, self.dp_size, self.output_rank (this rank
    returns the results of its data-parallel group) and, for tied weights, self.tied_aliases.
    """

    tied_aliases: frozenset = frozenset()  # state_dict names aliasing an earlier one (HF drops them when saving)

    def __init__(self, cfg, model_path: str, *, scalar_head: bool = False, init_reference: bool = False,
                 seed: int = 0):
        import torch.distributed as dist

        from nemo_grpo.distributed.worker_group import init_torch_distributed

        self.cfg, self.model_path, self.scalar_head = cfg, model_path, scalar_head
        self.device = init_torch_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(seed)
        self._build_model()
        self.optimizer = self._make_optimizer([p for p in self.model.parameters() if p.requires_grad])
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lr_warmup_factor(cfg.optimizer.warmup_steps))
        self.reference: Optional[dict[str, torch.Tensor]] = None
        if init_reference:  # the initial weights: a CPU copy of this rank's local shards
            self.reference = {n: t.detach().to("cpu", copy=True) for n, t in self._local_weights().items()}
        self._export_plan: list[list[str]] = []
        self._transfers: dict[str, dict[str, Any]] = {}  # open weight transfers (to separate engines), by name

    # ------------------------------------------------------------------------------------------ back end
    @classmethod
    def check_layout(cls, cfg, world_size: int) -> None:
        """Raise ValueError when cfg's parallel layout cannot run on world_size ranks (before any start-up)."""

    @abstractmethod
    def _build_model(self) -> None:
        """Load, parallelize and place the model; set model, dp_rank, dp_size, output_rank."""

    @abstractmethod
    def _logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask [b, t] on device -> per-token log-probs [b, t] (contract above)."""

    @abstractmethod
    def _scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                input_lengths: torch.Tensor) -> torch.Tensor:
        """[b, t] -> the scalar head's output at the last real token (input_lengths - 1), [b]."""

    @abstractmethod
    def _clip_grad_norm(self, max_norm: Optional[float]) -> float:
        """Global gradient norm over all shards (pre-clip); scale grads to max_norm when set and exceeded."""

    @abstractmethod
    def _local_weights(self) -> dict[str, torch.Tensor]:
        """name -> this rank's local tensor aliasing the live parameter (for reference swaps)."""

    @abstractmethod
    def _export_specs(self) -> list[TensorSpec]:
        """(HF name, full shape, dtype) of every tensor of the HF state_dict, in order; same on all ranks."""

    @abstractmethod
    def _export_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Collective: full CPU tensors for `names` (meaningful on rank 0)."""

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

    @property
    def _local_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer that holds this rank's state: itself, or the local one of a sharded (ZeRO) wrapper."""
        return getattr(self.optimizer, "optim", self.optimizer)

    def _move(self, device: torch.device) -> None:
        self.model.to(device)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.data = p.data.to(device)
        for state in self._local_optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and k != "step":
                    state[k] = v.to(device)

    # ------------------------------------------------------------------------------------------ checkpoint helpers
    def _rank_file(self, path: str) -> str:
        return os.path.join(path, f"worker_state_rank{self.rank:05d}.pt")

    def _save_rank_state(self, path: str, **extra: Any) -> None:
        """This rank's file beside a checkpoint's shards: scheduler, RNG states and the back end's `extra`."""
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
               "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
        torch.save({"scheduler": self.scheduler.state_dict(), "rng": rng, **extra}, self._rank_file(path))

    def _load_rank_state(self, path: str) -> dict[str, Any]:
        """save_rank_state's dict (rank 0's when the checkpoint has no file of this rank: another world size),
        with "own" telling which."""
        own = os.path.isfile(self._rank_file(path))
        extra = torch.load(self._rank_file(path) if own else os.path.join(path, "worker_state_rank00000.pt"),
                           weights_only=False)
        return {**extra, "own": own}

    def _restore_schedule_and_rng(self, extra: dict[str, Any]) -> None:
        """The scheduler (and the lr it sets) always; the RNG states only from this rank's own file."""
        self.scheduler.load_state_dict(extra["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        if extra["own"]:
            torch.set_rng_state(extra["rng"]["torch"])
            random.setstate(extra["rng"]["python"])
            if extra["rng"]["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(extra["rng"]["cuda"])

    # ------------------------------------------------------------------------------------------ driver API
    def layout(self) -> dict[str, Any]:
        """Where this rank sits: rank, dp_rank, dp_size, output_rank (1 if it returns its DP group's results),
        and what it runs on: device ("cuda:0" | "cpu") and dist_backend ("nccl" | "gloo")."""
        import torch.distributed as dist

        return {"rank": self.rank, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "output_rank": int(self.output_rank), "device": str(self.device), "dist_backend": dist.get_backend()}

    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _trimmed_inputs(self, mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Drop the padding columns no row of this micro-batch uses: (input_ids [b, t], mask [b, t], full T)."""
        ids, lengths = mb["input_ids"], mb["input_lengths"]
        full_t = ids.shape[1]
        t = max(1, min(full_t, int(lengths.max()))) if lengths.numel() else 1
        return ids[:, :t], attention_mask_from_lengths(lengths, t), full_t

    def _forward_logprobs(self, mb: dict[str, Any]) -> torch.Tensor:
        """Micro-batch on device -> logprobs [b, T] (grad follows the caller's mode)."""
        ids, mask, full_t = self._trimmed_inputs(mb)
        lp = self._logprobs(ids, mask)  # [b, t]
        return torch.nn.functional.pad(lp, (0, full_t - lp.shape[1]))

    def _train_output(self, mb: dict[str, Any]) -> torch.Tensor:
        """Micro-batch on device -> what the loss takes: log-probs [b, T] of a causal LM, or the scalar head's
        scores [b] (reward-model training)."""
        if self.scalar_head:
            ids, mask, _ = self._trimmed_inputs(mb)
            return self._scores(ids, mask, mb["input_lengths"]).float()
        return self._forward_logprobs(mb)

    @torch.no_grad()
    def _chunked(self, data: dict[str, Any], fn) -> Optional[torch.Tensor]:
        """Run fn over chunks of policy.logprob_batch_size rows in eval mode; the concatenation on output ranks."""
        self.model.eval()
        n, size = batch_size_of(data), self.cfg.logprob_batch_size
        outs = [fn(self._to_device(slice_batch(data, s, min(s + size, n)))).cpu() for s in range(0, n, size)]
        return torch.cat(outs) if self.output_rank else None

    def get_logprobs(self, data: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """This DP rank's rows (input_ids, input_lengths) -> logprobs [b, T] (None on non-output ranks)."""
        return self._chunked(data, self._forward_logprobs)

    def get_reference_logprobs(self, data: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """Like get_logprobs, with the initial weights swapped in for the forward and swapped back after."""
        if self.reference is None:
            raise RuntimeError("get_reference_logprobs: this policy was built with init_reference=False")
        with self._reference_weights():
            return self.get_logprobs(data)

    def score(self, data: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """This DP rank's rows -> scalar-head scores [b] at the last real token (None on non-output ranks)."""
        if not self.scalar_head:
            raise RuntimeError("score: this policy has no scalar head (build it with scalar_head=True)")

        def fn(mb):
            ids, mask, _ = self._trimmed_inputs(mb)
            return self._scores(ids, mask, mb["input_lengths"]).float()

        return self._chunked(data, fn)

    @contextlib.contextmanager
    def _reference_weights(self) -> Iterator[None]:
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
    def train(self, steps: list[dict[str, Any]], loss_fn) -> list[dict[str, float]]:
        """One optimizer step per entry {"data": this rank's rows, "global_valid_seqs", "global_valid_toks"}.

        Returns per step: the loss-fn metrics (and "loss") summed over this rank's micro-batches, plus
        "grad_norm" (global, pre-clip) and "lr" (the rate the step used).
        """
        self.model.train()
        return [self._train_step(s["data"], loss_fn, s["global_valid_seqs"], s["global_valid_toks"]) for s in steps]

    def _train_step(self, data: dict[str, Any], loss_fn, global_valid_seqs, global_valid_toks) -> dict[str, float]:
        """zero_grad -> forward/backward over micro-batches -> finish grads -> clip -> step; written once."""
        self.optimizer.zero_grad(set_to_none=True)
        n, size = batch_size_of(data), self.cfg.train_micro_batch_size
        gvs = torch.as_tensor(global_valid_seqs, dtype=torch.float32, device=self.device)
        gvt = torch.as_tensor(global_valid_toks, dtype=torch.float32, device=self.device)
        micro_batches = [slice_batch(data, s, min(s + size, n)) for s in range(0, n, size)]
        totals = self._forward_backward(micro_batches, loss_fn, gvs, gvt)
        self._finish_gradients()
        grad_norm = self._clip_grad_norm(self.cfg.max_grad_norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self._after_optimizer_step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**totals, "grad_norm": grad_norm, "lr": lr}

    def _forward_backward(self, micro_batches: list[dict[str, Any]], loss_fn, gvs: torch.Tensor,
                          gvt: torch.Tensor) -> dict[str, float]:
        """Forward + backward of every micro-batch (CPU rows, sliced from this rank's data); returns the loss-fn
        metrics (and "loss") summed over them. A back end whose forward is a pipeline schedule overrides this
        loop and calls `loss_and_metrics` from its schedule's loss closure."""
        totals: dict[str, float] = {}
        for i, mb in enumerate(micro_batches):
            mb = self._to_device(mb)
            self._set_gradient_sync(i == len(micro_batches) - 1)
            loss, metrics = loss_and_metrics(loss_fn, self._train_output(mb), mb, gvs, gvt)
            loss.backward()
            accumulate(totals, metrics)
        return totals

    # ------------------------------------------------------------------------------------------ weights out
    def _export_sizes(self) -> list[tuple[str, int]]:
        return [(s.name, s.nbytes) for s in self._export_specs()]

    def plan_weight_export(self, bucket_size_mb: float) -> int:
        """Collective-free: group the HF state_dict into buckets of ~bucket_size_mb; returns the bucket count."""
        self._export_plan = plan_buckets(self._export_sizes(), bucket_size_mb * 1024 * 1024)
        return len(self._export_plan)

    def export_weight_bucket(self, index: int) -> Optional[dict[str, torch.Tensor]]:
        """Collective on all ranks: bucket `index` of the current plan as full CPU tensors (rank 0; None elsewhere)."""
        tensors = self._export_tensors(self._export_plan[index])
        return tensors if self.rank == 0 else None

    def save_pretrained(self, path: str, shard_size_mb: float = 2048.0) -> None:
        """Collective: a Hugging Face directory (weights as safetensors shards, config and tokenizer files copied)."""
        from safetensors.torch import save_file

        sizes = [(n, b) for n, b in self._export_sizes() if n not in self.tied_aliases]
        plan = plan_buckets(sizes, shard_size_mb * 1024 * 1024)
        files = ["model.safetensors"] if len(plan) == 1 else \
            [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            for name in os.listdir(self.model_path):  # config, tokenizer, generation config, chat template
                src = os.path.join(self.model_path, name)
                if os.path.isfile(src) and not name.endswith(WEIGHT_SUFFIXES):
                    shutil.copy2(src, os.path.join(path, name))
            self._hf_config().save_pretrained(path)  # the config of the model actually built (head, labels)
        weight_map = {}
        for names, fname in zip(plan, files):
            tensors = self._export_tensors(names)
            if self.rank == 0:
                save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, fname),
                          metadata={"format": "pt"})
                weight_map.update({k: fname for k in tensors})
        if self.rank == 0 and len(files) > 1:
            import json

            total = sum(b for _, b in sizes)
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    # ------------------------------------------------------------------------------------------ weights to engines
    def open_weight_transfer(self, name: str, bucket_size_mb: float, timeout_s: float) -> Optional[dict[str, Any]]:
        """Collective-free, on every rank: plan transfer `name`: the HF state_dict in buckets of ~bucket_size_mb,
        tied aliases included, as in the export (vLLM's layerwise reload expects a tied lm_head.weight too).
        Rank 0 also opens the transfer group's store on a free port and returns {"host", "port", "plan",
        "device"}, the plan as lists of TensorSpec (what the receivers allocate); None on other ranks."""
        import ray

        specs = {s.name: s for s in self._export_specs()}
        plan = [[specs[n] for n in names]
                for names in plan_buckets(self._export_sizes(), bucket_size_mb * 1024 * 1024)]
        transfer: dict[str, Any] = {"plan": plan, "group": None, "timeout_s": timeout_s}
        self._transfers[name] = transfer
        if self.rank != 0:
            return None
        host = ray.util.get_node_ip_address()
        transfer["store"], port = wt.open_store(host, timeout_s)
        return {"host": host, "port": port, "plan": plan, "device": self.device.type}

    def join_weight_transfer(self, name: str, world_size: int, backend: str) -> None:
        """Rank 0 joins transfer `name` as its rank 0 (returns once every receiver has joined); no-op elsewhere."""
        transfer = self._transfers[name]
        if self.rank == 0:
            transfer["device"] = self.device if backend == "nccl" else torch.device("cpu")
            transfer["group"] = wt.join_group("", 0, 0, world_size, backend, transfer["timeout_s"],
                                              store=transfer["store"])

    def send_weights(self, name: str) -> Optional[dict[str, float]]:
        """Collective on all ranks: every bucket of transfer `name` is gathered to full tensors (as the export
        does) and rank 0 broadcasts it, one flat buffer per dtype. Rank 0 returns {"bytes", "buckets",
        "seconds"}; None elsewhere."""
        transfer = self._transfers.get(name)
        if transfer is None:
            raise RuntimeError(f"send_weights: no weight transfer '{name}' (call open_weight_transfer first)")
        start, sent = time.perf_counter(), 0
        in_flight: list = []  # bucket i's broadcast proceeds while bucket i + 1 is gathered
        for bucket in transfer["plan"]:
            tensors = self._export_tensors([s.name for s in bucket])
            if self.rank == 0:
                flats = wt.pack(tensors, bucket, transfer["device"])
                wt.wait(in_flight)
                in_flight = wt.broadcast_async(transfer["group"], flats)
                sent += sum(f.numel() * f.element_size() for f in flats)
        wt.wait(in_flight)
        if self.rank != 0:
            return None
        return {"bytes": float(sent), "buckets": float(len(transfer["plan"])), "seconds": time.perf_counter() - start}
