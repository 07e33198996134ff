"""`WeightReceiver`: an engine worker's side of a refit (weights/refit.py), in both modes, over a WeightSink.

The engine's worker holds `weight_receiver = WeightReceiver(self, in_flight_updates)`. Colocated: the policy
ranks write each bucket of the plan into a region of host shared memory (weights/sender.py) that the worker has
mapped (`attach_region`); it loads the bucket from there in place (`load_region_bucket`). Non-colocated:
policy rank 0 broadcasts each bucket over the transfer group as one flat buffer per dtype
(weights/transfer.py); the receiver receives into buffers of the planned layout and loads the bucket. Either
way the sink sees `begin_refit` / `load_bucket` / `finish_refit` (weights/protocols.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Optional

import ray
import torch

from nemo_grpo.weights import transfer as wt
from nemo_grpo.weights.protocols import WeightSink
from nemo_grpo.weights.transfer import TensorSpec


class WeightReceiver:
    """The receiving end on one engine worker, and the turn-taking of its forward steps with refits.

    in_flight_updates: the actor runs two calls at once (max_concurrency=2), so a refit may land between two
    forward steps of a generate call under way; the sink's generation wraps each forward step in
    `model_turn()` and each generate call in `generation()`.
    """

    def __init__(self, sink: WeightSink, in_flight_updates: bool = False):
        self.sink = sink
        self._receiver: Optional[dict] = None  # the transfer group and its buffers (non-colocated)
        self._region: Optional[dict] = None  # the mapped shared region (colocated)
        self._model_lock = threading.Lock() if in_flight_updates else None  # forward steps and refits alternate
        self._generations = 0  # generate calls under way
        self._refits_waiting = 0  # refits waiting for the model
        self._refits_mid_generation = 0  # refits that landed while a generate call was under way

    @contextlib.contextmanager
    def model_turn(self, refit: bool = False) -> Iterator[None]:
        """Held around each forward step of generation and around a whole refit (a no-op without in-flight
        updates, where the actor runs one call at a time). A waiting refit goes before the next step."""
        if self._model_lock is None:
            yield
            return
        if refit:
            self._refits_waiting += 1
        else:
            while self._refits_waiting:
                time.sleep(0.001)
        with self._model_lock:
            if refit:
                self._refits_waiting -= 1
            yield

    @contextlib.contextmanager
    def generation(self) -> Iterator[None]:
        """Around a generate call: counts it as under way."""
        self._generations += 1
        try:
            yield
        finally:
            self._generations -= 1

    def refits_mid_generation(self) -> int:
        """How many refits so far landed while a generate call was under way (in-flight weight updates)."""
        return self._refits_mid_generation

    def weight_dtype(self) -> str:
        """The dtype the sink holds its weights in ("bfloat16", "float32"): they are cast to it before they travel."""
        return str(self.sink.weight_dtype()).removeprefix("torch.")

    def takes_adapters(self) -> bool:
        """Whether the sink takes LoRA adapter refits (the plan then holds the adapters, not weights)."""
        return bool(self.sink.takes_adapters())

    def node_ip(self) -> str:
        """The address of the worker's node (a colocated region is shared within one node)."""
        return ray.util.get_node_ip_address()

    def transfer_device(self) -> str:
        """"cuda" | "cpu": where received weights end up (NCCL is used only when every member says cuda)."""
        return self.sink.weight_device().type

    def check_names(self, names: list[str]) -> None:
        """A plan naming a tensor the sink does not accept fails here, before anything is sent."""
        known = self.sink.weight_names()
        unknown = sorted(n for n in names if n not in known) if known is not None else []
        if unknown:
            what = "LoRA adapters" if self.sink.takes_adapters() else "weights"
            raise KeyError(f"refit: the engine's model has no parameter(s) {unknown[:5]} (it takes {what})")

    def close(self) -> None:
        """Drop the region's mapping and the transfer group (their memory goes with them)."""
        self._region = self._receiver = None

    # ------------------------------------------------------------------------------------------ colocated
    def attach_region(self, path: str, plan: list[list[TensorSpec]]) -> None:
        """Map the policy's shared region of `plan` (weights/transfer.py SharedRegion) for the refits to come."""
        self.check_names([s.name for bucket in plan for s in bucket])
        region = wt.SharedRegion(path, wt.region_nbytes(plan))
        self._region = {"region": region, "views": wt.bucket_views(wt.bucket_buffers(region.tensor, plan), plan)}

    def load_region_bucket(self, index: int, *written) -> int:
        """Load bucket `index` from the shared region (`written`: the policy ranks' writes of it, which Ray
        resolves before this runs); returns the number of tensors loaded."""
        if self._region is None:
            raise RuntimeError("load_region_bucket: no shared weight region (attach_region first)")
        return self.sink.load_bucket(self._region["views"][index])

    # ------------------------------------------------------------------------------------------ non-colocated
    def join_transfer(self, host: str, port: int, rank: int, world_size: int, backend: str,
                      plan: list[list[TensorSpec]], timeout_s: float) -> None:
        """Join the transfer group as `rank`; `plan` is the layout of every refit's buckets, in order."""
        self.check_names([s.name for bucket in plan for s in bucket])
        device = self.sink.weight_device() if backend == "nccl" else torch.device("cpu")
        group = wt.join_group(host, port, rank, world_size, backend, timeout_s)
        buffers = None
        if device.type == "cpu":  # one region for every refit: no page faults after the first
            buffers = wt.bucket_buffers(torch.empty(wt.region_nbytes(plan), dtype=torch.uint8), plan)
        self._receiver = {"group": group, "plan": plan, "device": device, "buffers": buffers}

    def _receive_async(self, index: int) -> tuple[list, list[torch.Tensor]]:
        """Bucket `index` into its buffers: views of the region (CPU), or fresh ones on the device (a loader
        may keep views of a bucket until a later one completes a layer: vLLM's layerwise reload)."""
        receiver = self._receiver
        buffers = receiver["buffers"]
        flats = buffers[index] if buffers is not None else wt.empty_buffers(receiver["plan"][index],
                                                                             receiver["device"])
        return wt.broadcast_async(receiver["group"], flats), flats

    def receive(self, first: int = 0) -> int:
        """One refit: receive every bucket of the plan from index `first` on and load it; returns the number of
        tensors loaded. After a failed load the remaining buckets are still received (and dropped), so the
        sender is not left waiting; the error is raised at the end."""
        if self._receiver is None:
            raise RuntimeError("receive: not in a weight-transfer group (join_transfer first)")
        with self.model_turn(refit=True):
            self._refits_mid_generation += self._generations > 0
            return self._receive_all(self._receiver["plan"], first)

    def _receive_all(self, plan: list[list[TensorSpec]], first: int) -> int:
        """receive's protocol, with the model to itself."""
        error: Optional[BaseException] = None
        loaded = 0
        try:
            self.sink.begin_refit()
        except Exception as e:
            error = e
        try:
            incoming = self._receive_async(first) if first < len(plan) else None
            for index in range(first, len(plan)):
                bucket, (works, flats) = plan[index], incoming
                wt.wait(works)
                if index + 1 < len(plan):  # bucket i + 1 arrives while bucket i is loaded
                    incoming = self._receive_async(index + 1)
                if error is None:
                    try:
                        loaded += self.sink.load_bucket(wt.unpack(flats, bucket))
                    except Exception as e:  # keep the protocol in step; report after the last bucket
                        error = e
        finally:
            self.sink.finish_refit()
        if error is not None:
            raise error
        return loaded
