"""The generation engine contract: token ids in, sampled tokens and their log-probs out, weights refit in place
(each worker actor is a WeightSink holding a WeightReceiver: weights/protocols.py).

An engine runs as data-parallel replicas, one Ray actor each (distributed/resource_plan.py places them: one per
TP group of every generation device, each within a node). `generate` spreads a call's prompts over them
(`split_by_work`): a prompt's group of samples (identical prompts) stays on one replica, where its prefix is
cached, and groups go to the replica with the least expected work so far. The outputs come back in the prompts'
order. Sampling is seeded per request (`request_seed(seed, index)`, index = the prompt's place in the call), so
a seeded call gives the same samples whatever the number of replicas and whichever replica runs a prompt (up
to the float rounding of a different batch, see docs/guides/generation-and-refit.md, "Replicas").
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
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


def request_seed(seed: int, index: int) -> int:
    """A 63-bit seed for request `index` of a call made with `seed`: distinct per index, fixed per pair."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def split_by_work(prompts: Sequence[Sequence[int]], replicas: int, max_new_tokens: int) -> list[list[int]]:
    """The prompt indices each replica runs, ascending. Identical prompts form a group (a GRPO prompt's samples)
    that goes whole to one replica; groups go, largest expected work first, to the replica with the least so
    far (ties: the lower replica). A group's expected work: its prompt's tokens once (prefilled once, then
    cached) + max_new_tokens per sample."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(i)
    loads, shares = [0] * replicas, [[] for _ in range(replicas)]
    for prompt, members in sorted(groups.items(), key=lambda g: -(len(g[0]) + len(g[1]) * max_new_tokens)):
        target = min(range(replicas), key=lambda r: (loads[r], r))
        shares[target] += members
        loads[target] += len(prompt) + len(members) * max_new_tokens
    return [sorted(share) for share in shares]


class GenerationEngine(ABC):
    """The driver's front of an engine: `cfg` (its GenerationConfig) and `replicas`, one Ray actor each (a
    WeightSink holding a WeightReceiver); `_generate_on` asks one replica to sample."""

    cfg = None
    replicas: Sequence = ()  # set by the engine: one Ray actor per replica

    @abstractmethod
    def _generate_on(self, replica, prompts: list[list[int]], indices: list[int], greedy: bool,
                     seed: Optional[int], stop_strings: list[Optional[list[str]]], max_new_tokens: Optional[int]):
        """An ObjectRef of the replica's outputs for `prompts`, the call's prompts `indices` (their seeds)."""

    def generate(self, prompts: list[list[int]], *, greedy: bool = False, seed: Optional[int] = None,
                 stop_strings: Optional[list[Optional[list[str]]]] = None,
                 max_new_tokens: Optional[int] = None) -> list[GenerationOutput]:
        """Sample one response per prompt (token-id lists), spread over the replicas; outputs in the prompts'
        order. `seed` makes the sampling reproducible; `stop_strings` (per prompt, or None) adds to the
        configured ones."""
        stops = stop_strings if stop_strings is not None else [None] * len(prompts)
        if len(stops) != len(prompts):
            raise ValueError(f"stop_strings has {len(stops)} entries for {len(prompts)} prompts")
        shares = split_by_work(prompts, len(self.replicas), max_new_tokens or self.cfg.max_new_tokens)
        shares = [(replica, share) for replica, share in zip(self.replicas, shares) if share]
        refs = [self._generate_on(replica, [prompts[i] for i in share], share, greedy, seed,
                                  [stops[i] for i in share], max_new_tokens) for replica, share in shares]
        outputs: list[Optional[GenerationOutput]] = [None] * len(prompts)
        for (_, share), results in zip(shares, ray.get(refs)):
            for i, out in zip(share, results):
                outputs[i] = out
        return outputs

    # colocated memory hand-over (GRPOTrainer._generation_phase); no-ops unless an engine frees device memory
    def prepare_for_generation(self) -> None:
        """Before rollouts: take back the device memory given up in finish_generation (weights, KV cache)."""

    def finish_generation(self) -> None:
        """After rollouts: give device memory to the colocated policy (keep what a refit needs to restore)."""

    def workers(self) -> list:
        """The Ray actors holding the engine's model replicas, each a WeightSink with a `weight_receiver`
        (weights/protocols.py): the receiving end of a refit."""
        if not self.replicas:
            raise RuntimeError(f"{type(self).__name__} has no replicas (shut down)")
        return list(self.replicas)

    def refits_mid_generation(self) -> int:
        """Refits so far that landed while a generate call was under way (in-flight weight updates), on the
        replica that saw the most (each replica counts the refits that met a generate call of its own)."""
        return max(Receivers(self.workers()).run(WeightReceiver.refits_mid_generation))

    def shutdown(self) -> None:
        """Free the engine's actors; safe twice."""
        for replica in self.replicas:
            ray.kill(replica)
        self.replicas = []
