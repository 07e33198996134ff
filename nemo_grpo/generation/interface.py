"""The generation engine contract: token ids in, sampled tokens and their log-probs out, weights refit in place
(each worker actor is a WeightSink holding a WeightReceiver: weights/protocols.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import ray
import torch

from nemo_grpo.weights.receiver import WeightReceiver
from nemo_grpo.weights.refit import Receivers

@dataclass
class GenerationOutput:
    """One sampled response: its tokens, the engine's log-prob of each, and why it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS, stop token or stop string) | "length" (max_new_tokens reached)
    # a Mixture-of-Experts model, from an engine that records it (the torch engine): the experts each position of
    # prompt + response was routed to, [len(prompt) + len(token_ids), L, k] int16, -1 where the engine ran no
    # forward (the last sampled token)
    routed_experts: Optional[torch.Tensor] = None


class GenerationEngine(ABC):
    @abstractmethod
    def generate(self, prompts: list[list[int]], *, greedy: bool = False, seed: Optional[int] = None,
                 stop_strings: Optional[list[Optional[list[str]]]] = None,
                 max_new_tokens: Optional[int] = None) -> list[GenerationOutput]:
        """Sample one response per prompt (token-id lists). `seed` makes the sampling reproducible;
        `stop_strings` (per prompt, or None) adds to the configured ones."""

    actor = None  # the Ray actor of a single-replica engine (set by the engines here)

    # colocated memory hand-over (GRPOTrainer._generation_phase); no-ops unless an engine frees device memory
    def prepare_for_generation(self) -> None:
        """Before rollouts: take back the device memory given up in finish_generation (weights, KV cache)."""

    def finish_generation(self) -> None:
        """After rollouts: give device memory to the colocated policy (keep what a refit needs to restore)."""

    def workers(self) -> list:
        """The Ray actors holding the engine's model replicas, each a WeightSink with a `weight_receiver`
        (weights/protocols.py): the receiving end of a refit."""
        if self.actor is None:
            raise NotImplementedError(f"{type(self).__name__} has no worker actors to refit")
        return [self.actor]

    def refits_mid_generation(self) -> int:
        """Refits so far that landed while a generate call was under way (in-flight weight updates)."""
        return sum(Receivers(self.workers()).run(WeightReceiver.refits_mid_generation))

    def shutdown(self) -> None:
        """Free the engine's actors; safe twice."""
        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None
