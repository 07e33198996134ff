"""`RewardModelEnvironment`: rewards from a Bradley-Terry reward model (a sequence classifier with one label),
on either policy back end (`env.reward_model.backend`, its layout as configured).

Each conversation is re-rendered with the reward model's own tokenizer and chat template (the policy's may
differ), truncated to its last `max_model_len` tokens (counted, never an error), and scored through
`Policy.score` in chunks of `batch_size` per data-parallel rank. Every conversation terminates after scoring.

    env = create_env("reward_model", cfg.env.reward_model)   # a Ray actor; it starts the reward model's workers
    ret = ray.get(env.step.remote(message_logs, env_infos))  # ret.rewards [B]
    ray.get(env.shutdown.remote())                           # frees the reward model's actors
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from nemo_grpo.config import ClusterConfig
from nemo_grpo.data.preferences import pad_id_of, render_conversation, right_padded
from nemo_grpo.envs.interface import EnvironmentInterface, EnvironmentReturn, MessageLog
from nemo_grpo.models.tokenizer import load_tokenizer
from nemo_grpo.policy import Policy

log = logging.getLogger(__name__)
PREFIX = "reward_model_env"


def reward_model_tokenizer(cfg):
    """env.reward_model -> (its tokenizer, with tokenizer.chat_template applied when set; its pad id, else 0)."""
    tokenizer = load_tokenizer(cfg.tokenizer.name or cfg.model_name)
    if cfg.tokenizer.chat_template is not None:
        tokenizer.chat_template = cfg.tokenizer.chat_template
    return tokenizer, pad_id_of(tokenizer)


class RewardModelEnvironment(EnvironmentInterface):
    """Scores whole conversations with a reward model; started as a Ray actor by `create_env`."""

    def __init__(self, cfg, placement=None, placement_group=None):
        """cfg: env.reward_model; placement / placement_group: the reward model's share of the resource plan
        (resource_plan.Placement and its reserved group); without them, env.reward_model.resources."""
        if cfg.reward_model_cfg.reward_model_type != "bradley_terry":
            raise ValueError(f"env.reward_model.reward_model_cfg.reward_model_type="
                             f"'{cfg.reward_model_cfg.reward_model_type}' is not supported; known: bradley_terry")
        self.cfg = cfg
        self.tokenizer, self.pad_id = reward_model_tokenizer(cfg)
        r = cfg.resources
        cluster = placement.as_cluster() if placement is not None else \
            ClusterConfig(gpus_per_node=r.gpus_per_node or 1, num_nodes=r.num_nodes or 1)
        self.policy = Policy(cfg.policy_config(), cluster, cfg.model_name, scalar_head=True,
                             name="reward_model", placement_group=placement_group, config_key="env.reward_model")
        self._truncated = 0

    def step(self, message_logs: list[MessageLog], env_infos: list[dict[str, Any]]) -> EnvironmentReturn:
        """Rewards [B] = the reward model's score of each whole conversation; all terminated."""
        if self.policy is None:
            raise RuntimeError("RewardModelEnvironment.step called after shutdown()")
        rendered = [render_conversation(self.tokenizer, [_chat_message(m) for m in log_], self.cfg.max_model_len)
                    for log_ in message_logs]
        self._truncated += sum(truncated for _, truncated in rendered)
        rewards = self.policy.score(right_padded([ids for ids, _ in rendered], self.pad_id)).float()  # [B]
        n = len(message_logs)
        return EnvironmentReturn(observations=[{"role": "environment", "content": ""} for _ in range(n)],
                                 metadata=list(env_infos), next_stop_strings=[None] * n, rewards=rewards,
                                 terminateds=torch.ones(n, dtype=torch.bool), answers=[None] * n)

    def global_post_process_and_metrics(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        """reward_model_env/{num_samples, mean_reward, std_reward, min_reward, max_reward, num_truncated}."""
        rewards = torch.as_tensor(batch["rewards"], dtype=torch.float32)
        metrics = {"num_samples": float(rewards.numel()), "num_truncated": float(self._truncated)}
        if rewards.numel():
            metrics.update(mean_reward=float(rewards.mean()), std_reward=float(rewards.std(unbiased=False)),
                           min_reward=float(rewards.min()), max_reward=float(rewards.max()))
        self._truncated = 0
        return batch, {f"{PREFIX}/{k}": v for k, v in metrics.items()}

    def shutdown(self) -> None:
        """Free the reward model's worker actors; safe to call twice."""
        policy, self.policy = getattr(self, "policy", None), None
        if policy is not None:
            policy.shutdown()

    def __del__(self):  # a forgotten shutdown() still frees the workers when the actor goes away
        try:
            self.shutdown()
        except Exception as e:  # interpreter teardown: Ray may be gone already
            log.debug("RewardModelEnvironment: shutdown in __del__ failed: %s", e)


def _chat_message(message: dict[str, str]) -> dict[str, str]:
    """Our roles -> chat-template roles (an environment's observation speaks as the user)."""
    role = message.get("role", "user")
    return {"role": "user" if role == "environment" else role, "content": message.get("content", "")}
