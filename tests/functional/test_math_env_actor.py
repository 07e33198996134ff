"""The math environment's Ray actor end to end: a mixed batch of hostile and ordinary answers, its metrics,
shutdown, and workers that hang or die restarted with their chunk scored 0. (verify_answer and the chunking:
tests/unit/test_math_env.py.)"""

import os
import random
import time

import pytest
import torch

from nemo_grpo.config import MathEnvConfig
from nemo_grpo.envs.math_env import MathEnvironment, VerifierWorker

TIMEOUT_S = 1.0
MB = 1 << 20


def random_text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(map(chr, rng.choices(range(32, 0x3000), k=n)))


def binary_junk(n: int, seed: int = 0) -> str:
    return random.Random(seed).randbytes(n).decode("utf-8", errors="replace") + "\x00" * 64


def _logs(responses):
    return [[{"role": "user", "content": "q"}, {"role": "assistant", "content": r}] for r in responses]


def test_actor_end_to_end(ray_cluster):
    """One actor (starting one costs seconds): a mixed batch, a second batch, metrics, shutdown twice."""
    import ray

    from nemo_grpo.envs import create_env

    env = create_env("math", MathEnvConfig(num_workers=2, timeout_s=TIMEOUT_S))
    _check_mixed_batch(env)
    ret = ray.get(env.step.remote(_logs(["7", "\\boxed{7}", "6"]), [{"ground_truth": "7"}] * 3))
    assert ret.rewards.tolist() == [1.0, 1.0, 0.0]
    assert ray.get(env.step.remote([], [])).rewards.shape == (0,)
    _check_metrics(env)
    ray.get(env.shutdown.remote())
    ray.get(env.shutdown.remote())
    with pytest.raises(ray.exceptions.RayTaskError, match="after shutdown"):
        ray.get(env.step.remote(_logs(["8"]), [{"ground_truth": "8"}]))
    ray.kill(env)


def _check_mixed_batch(env):
    import ray

    cases = [  # (response, gold, reward)
        ("8", "8", 1.0), ("9", "8", 0.0), ("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\frac{" * 5000, "8", 0.0),
        (random_text(MB), "8", 0.0), (None, "8", 0.0), ("\\boxed{9^{9^{9^{9}}}}", "8", 0.0), ("$x=2$", "2", 1.0),
        (binary_junk(4096), "8", 0.0), (random_text(MB) + " \\boxed{8}", "8", 1.0),
    ]
    infos = [{"ground_truth": g, "id": i} for i, (_, g, _) in enumerate(cases)]
    ret = ray.get(env.step.remote(_logs([r for r, _, _ in cases]), infos))
    assert ret.rewards.dtype == torch.float32
    assert ret.rewards.tolist() == [w for _, _, w in cases]
    assert ret.terminateds.dtype == torch.bool and ret.terminateds.all() and len(ret.terminateds) == len(cases)
    assert [o["content"] for o in ret.observations] == [
        "Environment: correct" if w else "Environment: incorrect" for _, _, w in cases]
    assert {o["role"] for o in ret.observations} == {"environment"}
    assert ret.metadata == infos and ret.next_stop_strings == [None] * len(cases)
    assert ret.answers[:3] == ["8", "9", "\\frac{1}{2}"]


def _check_metrics(env):
    import ray

    batch = {  # 3 prompts x 2 samples: prompt 0 one right, prompt 1 none, prompt 2 both
        "rewards": torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0]),
        "text": ["a"] * 6,
        "num_generations_per_prompt": 2,
        "response_lengths": torch.tensor([1, 2, 3, 4, 5, 9]),
        "prompt_lengths": torch.tensor([5] * 6),
        "truncated": torch.tensor([False, False, True, False, False, False]),
    }
    out, metrics = ray.get(env.global_post_process_and_metrics.remote(batch))
    assert metrics == {
        "math/accuracy": 0.5,
        "math/pass@2": pytest.approx(2 / 3),
        "math/fraction_of_samples_properly_ended": pytest.approx(5 / 6),
        "math/mean_response_length": 4.0,
        "math/num_samples": 6.0,
    }
    assert torch.equal(out["rewards"], batch["rewards"])
    _, metrics = ray.get(env.global_post_process_and_metrics.remote({**batch, "num_generations_per_prompt": 3}))
    assert metrics["math/pass@3"] == 1.0  # groups [0,1,0], [0,1,1]
    with pytest.raises(ray.exceptions.RayTaskError, match="num_generations_per_prompt"):
        ray.get(env.global_post_process_and_metrics.remote({**batch, "num_generations_per_prompt": 4}))


def test_a_hung_or_dead_worker_is_restarted_and_its_chunk_scores_zero(ray_cluster):
    import ray

    class FaultyVerifier(VerifierWorker):
        def score(self, pairs):
            if any(gold == "hang" for _, gold in pairs):
                time.sleep(3600)  # outside the per-sample alarm, like a long call into C
            if any(gold == "die" for _, gold in pairs):
                os._exit(1)
            return super().score(pairs)

    class FaultyEnv(MathEnvironment):
        worker_cls = FaultyVerifier
        safety_slack_s = 1.0

    env = ray.remote(FaultyEnv).options(num_cpus=0).remote(MathEnvConfig(num_workers=3, timeout_s=0.5))
    # four distinct pairs (identical ones are verified once): chunks [hang, 8] [die] [\boxed{8}] on workers 0, 1, 2
    golds = ["hang", "8", "die", "8"]
    start = time.monotonic()
    ret = ray.get(env.step.remote(_logs(["8", "8", "8", "\\boxed{8}"]), [{"ground_truth": g} for g in golds]))
    assert ret.rewards.tolist() == [0.0, 0.0, 0.0, 1.0]
    assert ret.answers == [None, None, None, "8"]
    assert time.monotonic() - start < 60
    ret = ray.get(env.step.remote(_logs(["8", "9", "8"]), [{"ground_truth": "8"}] * 3))
    assert ret.rewards.tolist() == [1.0, 0.0, 1.0]  # the restarted workers serve
    ray.get(env.shutdown.remote())
    ray.kill(env)
