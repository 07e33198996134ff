"""A multi-turn toy environment: guess a digit; the environment answers "higher" or "lower".

env_info: {"target": int 0-9}. Each turn the last digit in the model's reply is its guess; a right guess
ends the episode with reward 1, a wrong one continues with a hint (reward 0), a reply without a digit is
answered "say a digit". Used to exercise multi-turn rollouts (grpo.max_rollout_turns) end to end.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from nemo_grpo.envs.interface import EnvironmentInterface, EnvironmentReturn


def reply(guess_text: str, target: int) -> tuple[float, bool, str]:
    """(reward, terminated, hint) for one reply."""
    digits = re.findall(r"\d", guess_text)
    if not digits:
        return 0.0, False, " say a digit "
    guess = int(digits[-1])
    if guess == target:
        return 1.0, True, " correct "
    return 0.0, False, " higher " if target > guess else " lower "


class GuessingGameEnvironment(EnvironmentInterface):
    def __init__(self, cfg: Any = None):
        self.cfg = cfg

    def step(self, message_logs, env_infos) -> EnvironmentReturn:
        results = [reply(log[-1]["content"], int(info["target"])) for log, info in zip(message_logs, env_infos)]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": hint} for _, _, hint in results],
            metadata=list(env_infos), next_stop_strings=[None] * len(results),
            rewards=torch.tensor([r for r, _, _ in results]),
            terminateds=torch.tensor([t for _, t, _ in results]),
            answers=[log[-1]["content"] for log in message_logs])

    def global_post_process_and_metrics(self, batch):
        rewards = batch["rewards"]
        return batch, {"guess/accuracy": float(rewards.float().mean()) if len(rewards) else 0.0}
