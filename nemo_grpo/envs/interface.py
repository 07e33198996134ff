"""The environment contract (NeMo RL's): a batch of conversations in, rewards and the next turn out.

An environment is a Ray actor. `step` receives one message log per sample (a list of
`{"role", "content"}` dicts, the last one the model's reply) and the per-sample `env_info` dicts
carried in the data (e.g. the ground-truth answer). It returns an `EnvironmentReturn`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple, Optional, Union

import torch

Message = dict[str, str]
MessageLog = list[Message]


class EnvironmentReturn(NamedTuple):
    """What `step` returns for a batch of B samples.

    observations: B messages to append to the conversation (role "environment" or "user").
    metadata: B dicts (or None) kept with the sample, passed back as env_info on the next turn.
    next_stop_strings: B lists of stop strings for the next turn (or None for the default).
    rewards: [B] float tensor; or a dict name -> [B] float tensor of reward components (for
        grpo.adv_estimator.name=gdpo, which normalises each on its own; the sample's reward is their sum).
    terminateds: [B] bool tensor; False asks for another turn (multi-turn environments).
    answers: B extracted answers (or None), for logging.
    """

    observations: list[Message]
    metadata: list[Optional[dict[str, Any]]]
    next_stop_strings: list[Optional[list[str]]]
    rewards: Union[torch.Tensor, dict[str, torch.Tensor]]
    terminateds: torch.Tensor
    answers: list[Optional[str]]


class EnvironmentInterface(ABC):
    @abstractmethod
    def step(self, message_logs: list[MessageLog], env_infos: list[dict[str, Any]]) -> EnvironmentReturn:
        """Score (and possibly continue) a batch of conversations."""

    @abstractmethod
    def global_post_process_and_metrics(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        """After all rollouts of a step: batch (possibly modified) and metrics named `<env>/<metric>`.

        batch holds the step's samples of this environment's task only (whole groups, in batch order; other
        tasks' samples go to their own environments): at least "rewards" [N], "text" (N response strings),
        "num_generations_per_prompt", "response_lengths" [N], "prompt_lengths" [N], "truncated" [N] bool.
        """

    def shutdown(self) -> None:
        """Free workers; safe to call twice."""
