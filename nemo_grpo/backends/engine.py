"""`PolicyEngine`: what a back end supplies to the one `PolicyActor` (backends/actor.py), and nothing more.

An engine is one rank's model under its back end's parallelism: it builds the model and its optimizer (the
constructor), runs the forward (`forward`), the forward and backward of all the micro-batches of a step
(`forward_backward`: DTensor's plain loop, Megatron's pipeline schedule), finishes the gradients and gives their
global norm and local tensors, steps the optimizer, moves itself between devices, and is the rank's
`WeightSource` (weights/protocols.py) and checkpoint format. The step sequence, the losses, the reference
weights, offload and the checkpoint's per-rank state are the actor's.

Abstract: 13 methods (forward, forward_backward, reduce_gradients, local_grads, optimizer_step, local_weights,
move, weight_specs, gather_weights, write_weight_bucket, adapter_state, save_checkpoint, load_checkpoint); one
hook (close).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from nemo_grpo.backends.context_parallel import ContextGroup
from nemo_grpo.backends.model_inputs import ModelInputs, model_inputs, split_context
from nemo_grpo.backends.router import RouterLosses
from nemo_grpo.layout import ParallelLayout
from nemo_grpo.models import lora
from nemo_grpo.weights.transfer import TensorSpec

# a micro-batch's loss, which forward_backward backpropagates: (micro-batch on device, its model inputs, the
# forward's output: per-position log-probs [r, t], or scores [b] with a scalar head) -> scalar
MicroBatchLoss = Callable[[dict[str, Any], ModelInputs, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class EngineSetup:
    """What the actor hands an engine: the policy config, the HF directory, the head, the seed, and this rank's
    place (torch.distributed is initialized; `layout` validated; `context` its context-parallel group)."""

    cfg: Any
    model_path: str
    scalar_head: bool
    seed: int
    device: torch.device
    rank: int
    world_size: int
    layout: ParallelLayout
    context: ContextGroup


def on_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A batch's tensors on `device` (other entries as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def move_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """The model and the tensors the optimizer steps (when they are not the model's) to `device`."""
    model.to(device)
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.data = p.data.to(device)


class PolicyEngine(ABC):
    """One rank's model, optimizer and weights under a back end (see the module). The constructor builds them and
    sets: model, optimizer, dp_rank, dp_size, output_rank (this rank returns its data-parallel group's results),
    hf_config (the transformers config of the model actually built), data_parallel_group (the ranks that take
    different rows, x context-parallel ranks: the router statistics' group), router (a Mixture-of-Experts
    model's terms, backends/router.py), tied_aliases (state_dict names aliasing an earlier one)."""

    tied_aliases: frozenset = frozenset()
    router: Optional[RouterLosses] = None
    width_factor: int = 1  # columns of a forward are also a multiple of width_factor x cp (Megatron's SP: tp)
    dense_mask_only: bool = False  # packed rows attend through the dense block-diagonal mask only

    def __init__(self, setup: EngineSetup):
        self.cfg, self.model_path, self.scalar_head, self.seed = (setup.cfg, setup.model_path, setup.scalar_head,
                                                                  setup.seed)
        self.device, self.rank, self.world_size = setup.device, setup.rank, setup.world_size
        self.parallel_layout, self.context = setup.layout, setup.context

    # ------------------------------------------------------------------------------------------ model inputs
    def width_multiple(self) -> int:
        """Columns of a forward are a multiple of this: policy.sequence_packing.sequence_length_round for packed
        rows, else 1; of 2 x cp under context parallelism; and of width_factor x cp."""
        packing = self.cfg.sequence_packing
        return math.lcm(packing.sequence_length_round if packing.enabled else 1, 2 * self.context.size,
                        self.width_factor * self.context.size)

    def model_inputs(self, mb: dict[str, Any], width: Optional[int] = None) -> ModelInputs:
        """A micro-batch on device -> what the model takes: padded rows, or one packed row with sequence packing
        on (backends/model_inputs.py; per segment, or the dense mask with policy.sequence_packing.attention=mask
        or dense_mask_only); this rank's share of their positions under context parallelism."""
        dense = self.cfg.sequence_packing.attention == "mask" or self.dense_mask_only
        inputs = model_inputs(mb, self.cfg.sequence_packing.enabled, self.width_multiple(), width,
                              dense_mask=dense and self.context.size == 1)
        return split_context(inputs, self.context)

    # ------------------------------------------------------------------------------------------ compute
    @abstractmethod
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Model inputs on device -> per-position log-probs [r, t] at generation.temperature (position p holds
        log p(token p | the tokens before it), 0 where inputs.token_mask is 0), or with a scalar head the
        head's output at each sequence's last token [b]. Grad follows the caller's mode."""

    @abstractmethod
    def forward_backward(self, micro_batches: list[dict[str, Any]], loss: MicroBatchLoss) -> None:
        """Forward and backward of every micro-batch of a step (CPU rows): backpropagate loss(mb, inputs, output)
        of each (on the ranks that hold the output; the last micro-batch's backward completes the gradients'
        data-parallel reduction where the back end defers it)."""

    @abstractmethod
    def reduce_gradients(self) -> float:
        """Collective, after the last backward of a step: finish the gradients (the reductions a parallelism
        leaves partial) and return the global L2 norm of what the optimizer steps, each element counted once."""

    @abstractmethod
    def local_grads(self) -> list[torch.Tensor]:
        """This rank's gradient tensors of what the optimizer steps (scaled in place when clipping)."""

    @abstractmethod
    def optimizer_step(self) -> None:
        """Step the optimizer and update what mirrors its tensors (e.g. bf16 parameters from fp32 masters)."""

    @abstractmethod
    def local_weights(self) -> dict[str, torch.Tensor]:
        """name -> this rank's local tensor aliasing the live parameter (for reference swaps)."""

    @abstractmethod
    def move(self, device: torch.device) -> None:
        """The model and the tensors the optimizer steps (not its state: the actor's) to `device`."""

    def close(self) -> None:
        """Release what the engine made beyond its own objects (e.g. a library's per-process state); the engine
        serves no call after it."""

    # ------------------------------------------------------------------------------------------ WeightSource
    @abstractmethod
    def weight_specs(self) -> list[TensorSpec]:
        """(HF name, full shape, dtype) of every tensor of the HF state_dict, in order; same on all ranks."""

    @abstractmethod
    def gather_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Collective: full CPU tensors for `names` (meaningful on rank 0; LoRA layers merged)."""

    def trained_weight_names(self, names: list[str]) -> set[str]:
        """All of `names`; LoRA: the engine's layers under adapters."""
        if not self.cfg.lora.enabled:
            return set(names)
        return lora.trained_names(names, lora.target_modules(self.cfg.lora))

    @abstractmethod
    def write_weight_bucket(self, bucket: list[TensorSpec], views: Optional[dict[str, torch.Tensor]],
                            in_place: bool) -> None:
        """Collective: the bucket into the refit region (weights/protocols.py; weights.sender.write_gathered
        when only rank 0 writes)."""

    @abstractmethod
    def adapter_state(self) -> dict[str, torch.Tensor]:
        """Collective (LoRA): every adapter as a full CPU tensor under peft's key (models/lora.py), on rank 0."""

    def adapter_specs(self) -> list[TensorSpec]:
        """LoRA: (peft key, full shape, fp32) of every adapter of adapter_state, as an adapter refit plans them."""
        return lora.adapter_specs(self.weight_specs(), self.cfg.lora)

    # ------------------------------------------------------------------------------------------ checkpoints
    @abstractmethod
    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """Collective: the model and optimizer state under `path` (the directory exists); returns what this
        rank's file (checkpoint_state.py) keeps beside the scheduler and RNG states."""

    @abstractmethod
    def load_checkpoint(self, path: str, extra: dict[str, Any]) -> None:
        """Collective: restore what save_checkpoint wrote; `extra` is this rank's file (or rank 0's)."""
