"""Environments by name. `create_env(name, cfg)` starts the Ray actor for one."""

from __future__ import annotations

from typing import Any

from nemo_grpo.utils.registry import load_registered

# name -> "module:Class"; the class is a plain Python class, started as a Ray actor by create_env
ENVIRONMENTS = {
    "math": "nemo_grpo.envs.math_env:MathEnvironment",
    "guess": "nemo_grpo.envs.guessing_game:GuessingGameEnvironment",
    "reward_model": "nemo_grpo.envs.reward_model_env:RewardModelEnvironment",
    "code": "nemo_grpo.envs.code_env:CodeEnvironment",
    "llm_judge": "nemo_grpo.envs.llm_judge_env:LlmJudgeEnvironment",
}


def environment_class(name: str):
    return load_registered(ENVIRONMENTS, name, "environment")


def create_env(name: str, cfg: Any, runtime_env: dict | None = None, **kwargs: Any):
    """Start environment `name` as a Ray actor with its config dataclass (and constructor `kwargs`, e.g. the
    reward model's placement); returns the actor handle."""
    import ray  # here, not at the top: validation reads ENVIRONMENTS for every config check; ray takes ~0.5 s

    cls = environment_class(name)
    return ray.remote(cls).options(num_cpus=0, runtime_env=runtime_env or {}).remote(cfg, **kwargs)
