"""algorithms/on_policy.py: which GRPO steps skip the separate old-log-prob pass (the training forward's log-probs
are the old ones), each row of the table against the one key that decides it."""

import pytest

from nemo_grpo.algorithms.on_policy import off_policy_reason
from nemo_grpo.config import MasterConfig


def one_step_config(**changes) -> MasterConfig:
    """4 prompts x 2 samples trained in one global batch of 8, then `changes` as "section.key": value."""
    cfg = MasterConfig()
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = 4, 2
    cfg.policy.train_global_batch_size = 8
    for key, value in changes.items():
        *path, name = key.split(".")
        obj = cfg
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, name, value)
    return cfg


@pytest.mark.parametrize("changes", [
    {},
    {"grpo.use_dynamic_sampling": True, "grpo.batch_multiplier": 2.0},  # dynamic sampling keeps exactly 8
    {"grpo.async_grpo.enabled": True, "grpo.async_grpo.max_trajectory_age_steps": 2},  # old = current weights
    {"grpo.async_grpo.enabled": True, "grpo.async_grpo.max_trajectory_age_steps": 0},
    {"loss_fn.force_on_policy_ratio": True},
    {"loss_fn.use_importance_sampling_correction": True},
    {"loss_fn.reference_policy_kl_penalty": 0.1},  # the reference's pass stays; the old one goes
    {"policy.lora.enabled": True, "policy.lora.dropout": 0.0},
], ids=["one_step", "dynamic_sampling", "async_age2", "async_age0", "force_on_policy_ratio", "is_correction",
        "kl_penalty", "lora"])
def test_one_optimizer_step_is_on_policy(changes):
    cfg = one_step_config(**changes)
    assert off_policy_reason(cfg) is None and off_policy_reason(cfg, "engine") is None
    assert off_policy_reason(cfg, "none") is None


@pytest.mark.parametrize("changes,replay,names", [
    ({"grpo.recompute_old_logprobs": True}, "none", "grpo.recompute_old_logprobs"),
    ({"policy.train_global_batch_size": 4}, "none", "2 optimizer steps"),
    ({"policy.train_global_batch_size": 2}, "none", "4 optimizer steps"),
    ({"loss_fn.reference_policy_kl_penalty": 0.1, "loss_fn.use_kl_in_reward": True}, "none", "use_kl_in_reward"),
    ({}, "old_policy", "old_policy"),
    ({"policy.lora.enabled": True, "policy.lora.dropout": 0.05}, "none", "policy.lora.dropout"),
], ids=["asked", "two_steps", "four_steps", "kl_in_reward", "old_policy_replay", "lora_dropout"])
def test_the_separate_pass_runs_and_says_why(changes, replay, names):
    cfg = one_step_config(**changes)
    reason = off_policy_reason(cfg, replay)
    assert reason is not None and names in reason
