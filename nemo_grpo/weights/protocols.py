"""The two ends of a refit, declared: what a back end's rank provides (`WeightSource`) and what an engine's worker
provides (`WeightSink`). weights/ calls nothing else on either.

A policy rank (a back-end worker actor) implements WeightSource and holds `weight_sender =
WeightSender(self)` (weights/sender.py); an engine worker actor implements WeightSink and holds
`weight_receiver = WeightReceiver(self, ...)` (weights/receiver.py). The driver's refitters (weights/refit.py)
reach those objects through two handles, `Senders` (the policy's worker group) and `Receivers` (the engine's
workers), so no tensor passes through the driver.

Tensors are Hugging-Face-named full tensors: the names, shapes and dtypes of the HF model's `state_dict()`
(`TensorSpec`, weights/transfer.py), tied aliases such as `lm_head.weight` included.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from nemo_grpo.weights.transfer import TensorSpec


class WeightSource(Protocol):
    """One rank of a policy, as a refit and the HF export see it (every method runs on every rank).

    - `rank` (0 = the rank that returns gathered tensors), `device` (its torch device) and `tied_aliases`
      (state_dict names aliasing an earlier tensor; HF drops them when saving).
    - `weight_specs()`: (HF name, full shape, dtype) of every tensor of the HF state_dict, in order; the same
      on every rank, no collective.
    - `trained_weight_names(names)`: the subset of `names` a train step can change (all of them; LoRA: the
      engine's layers under adapters). Refits after the first send only these (a partial refit).
    - `gather_weights(names)`: collective; name -> full CPU tensor of spec shape and dtype, meaningful on rank
      0 (LoRA layers merged: W + scale * B @ A).
    - `write_weight_bucket(bucket, views, in_place)`: collective; the bucket's full tensors into `views`
      (name -> full-shape view [*spec.shape] in the plan's dtype, in host shared memory; None on ranks that
      could not map it). in_place: every rank mapped the region, so each may write its own shards; else rank
      0 writes gathered tensors (weights.sender.write_gathered does that).
    - LoRA, for a refit of the adapters alone (policy.lora.refit=adapters): `adapter_specs()` (peft's key, full
      shape, dtype of every adapter, in order; no collective) and `adapter_state()` (collective; peft key ->
      full CPU tensor on rank 0).
    """

    rank: int
    device: torch.device
    tied_aliases: frozenset

    def weight_specs(self) -> list[TensorSpec]: ...

    def trained_weight_names(self, names: list[str]) -> set[str]: ...

    def gather_weights(self, names: list[str]) -> dict[str, torch.Tensor]: ...

    def write_weight_bucket(self, bucket: list[TensorSpec], views: Optional[dict[str, torch.Tensor]],
                            in_place: bool) -> None: ...

    def adapter_specs(self) -> list[TensorSpec]: ...

    def adapter_state(self) -> dict[str, torch.Tensor]: ...


class WeightSink(Protocol):
    """One worker of a generation engine, as a refit sees it. A refit calls, in order: `prepare_for_refit()`
    (take back the weights' device memory, e.g. vLLM's sleep mode), `begin_refit()`, `load_bucket(bucket)` per
    bucket, `finish_refit()` (also after a failed load, so the engine can generate again).

    - `weight_dtype()`: the dtype it holds floating-point weights in; they are cast to it before they travel.
    - `weight_device()`: where its model lives (a cuda device lets the collective mode use NCCL).
    - `weight_names()`: the HF names it accepts (None: not known); a plan naming others fails before any send.
    - `takes_adapters()`: whether it was started for LoRA adapter refits: it then accepts the adapters' peft
      keys (`weight_names()`), not weights, and installs what a refit's buckets held as its LoRA adapter in
      `finish_refit`; its base weights stay those it started from.
    - `load_bucket(bucket)`: name -> full tensor [*spec.shape] in weight_dtype(), loaded in place; the views
      may be reused once it returns. Returns the number of tensors loaded.
    - `finish_refit()`: returns the tensors loaded since begin_refit (0 if none was open).
    """

    def weight_dtype(self) -> torch.dtype: ...

    def weight_device(self) -> torch.device: ...

    def weight_names(self) -> Optional[set[str]]: ...

    def takes_adapters(self) -> bool: ...

    def prepare_for_refit(self) -> None: ...

    def begin_refit(self) -> None: ...

    def load_bucket(self, bucket: dict[str, torch.Tensor]) -> int: ...

    def finish_refit(self) -> int: ...

