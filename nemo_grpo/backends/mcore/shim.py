"""Megatron-Core 0.16 on a CPU-only torch build (gloo): the few patches it needs; all no-ops when CUDA is available.

`apply()` once per process before a model is built; run every Megatron call inside `device_context()` (a
TorchFunctionMode is per thread, and Ray may run actor methods on another thread than the constructor).
What breaks on CPU, and the fix here (measured with megatron-core 0.16.1, torch 2.13 CPU):
- `model_parallel_cuda_manual_seed` asserts CUDA: a CPU RNG-states tracker answers it;
- ~175 `torch.cuda.current_device()` sites: they get the CPU device;
- hard-coded `device="cuda"` in schedules, optimizer and grad clipping: a TorchFunctionMode rewrites it to cpu;
- the distributed optimizer's `torch.cuda.FloatTensor` type check: `Tensor.type()` answers the CUDA name there;
- `torch.cuda.synchronize()` in pipeline p2p: a no-op;
- sequence parallelism refuses torch's norms: they are built anyway, their params tagged `sequence_parallel`;
- MoE's alltoall token dispatcher makes a `torch.cuda.Stream()` for the device-to-host copies of its all-to-all
  split sizes (which become numpy there, and gloo's all_to_all_single refuses a tensor of split sizes): its class
  stream is preset and its copy step (`_maybe_dtoh_and_synchronize`) only turns the split sizes into numpy.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.fusions import fused_softmax
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.transformer import torch_norm
from megatron.core.transformer.moe import token_dispatcher

_APPLIED = False


class _CpuRNGStatesTracker:
    """Answers `tensor_parallel.model_parallel_cuda_manual_seed` / `get_cuda_rng_tracker().fork()` (weight init,
    dropout, activation recompute): the CUDA tracker calls torch.cuda.get_rng_state(); this one keeps CPU states."""

    def __init__(self):
        self.reset()

    def reset(self):
        self._initialized, self.states_, self.seeds_ = False, {}, set()

    def is_initialized(self):
        return self._initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._initialized, self.states_ = True, states

    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self._initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _split_sizes_to_numpy(self, point: str, tokens_per_expert=None):
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize on CPU: at its copy point, the all-to-all split
    sizes as numpy (what its device-to-host copy makes of them on GPU); nothing to copy or synchronize."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _is_cuda(d) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)  # a bare ordinal means cuda:N


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Answers hard-coded `device="cuda"` / `.cuda()` / `.to("cuda")` in Megatron (the causal mask, every
    schedule's `total_num_tokens`, `LanguageModule.setup_embeddings_and_output_layer`'s `weight.data.cuda()`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # the distributed optimizer's type check
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()  # [sq, sq], True above the diagonal


def apply() -> None:
    """Patch torch.cuda / Megatron's RNG tracker for CPU; idempotent; a no-op with CUDA."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    _APPLIED = True
    cpu = torch.device("cpu")
    # ~175 sites `device=torch.cuda.current_device()` (attention buffers, TP all-gather outputs, p2p receive buffers)
    torch.cuda.current_device = lambda: cpu
    # pipeline p2p (`_batched_p2p_ops` / `_p2p_ops`) synchronizes the CUDA stream after its sends and receives
    torch.cuda.synchronize = lambda *a, **k: None
    # model_parallel_cuda_manual_seed and get_cuda_rng_tracker()
    mrandom._CUDA_RNG_STATE_TRACKER = _CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # CheckpointFunction (activation recomputation) saves and restores the CUDA RNG state
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # FusedScaleMaskSoftmax's causal mask (`get_default_causal_mask`, device="cuda"): the device mode does not
    # reach the forward that activation recomputation re-runs inside the backward pass
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    # MoEAlltoAllTokenDispatcher: `torch.cuda.Stream()` in its constructor unless the class has one; the
    # stream's copies of the split sizes per dispatch
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu: no side stream"
    token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _split_sizes_to_numpy


def allow_sequence_parallel_norm() -> None:
    """Answers `WrappedTorchNorm(...)` asserting "sequence parallel not supported by torch LayerNorm" (local
    spec): build the torch norm anyway and tag its parameters `sequence_parallel=True`; the worker all-reduces
    the gradients of tagged parameters over the TP group (as TE norms get). Idempotent; also needed on GPU
    without Transformer Engine."""
    if getattr(torch_norm.WrappedTorchNorm, "_nemo_grpo_sp", False):
        return
    original_new = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, *args, **kwargs):
        sp = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = sp
        for p in norm.parameters():
            p.sequence_parallel = sp
        return norm

    torch_norm.WrappedTorchNorm.__new__ = __new__
    torch_norm.WrappedTorchNorm._nemo_grpo_sp = True


def moe_router_without_transformer_engine() -> None:
    """Answers `NameError: te_general_gemm` in the MoE router's fp32 gating linear (moe_utils.
    RouterGatingLinearFunction) when Transformer Engine is absent: megatron-core 0.16.1 tests the name, which
    its failed TE import left undefined; None takes its own torch.mm path. Idempotent; also needed on GPU
    without Transformer Engine."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def device_context():
    """Context for every Megatron call: rewrites CUDA devices to CPU when there is no CUDA; else nothing."""
    return contextlib.nullcontext() if torch.cuda.is_available() else _CudaToCpuMode()
