"""The trainer's way from rewards to advantages, without a cluster: scaling then shaping, reward components,
the KL taken off the rewards, and dynamic sampling over several generation batches."""

import pytest
import torch
from test_grpo_reporting import bare_trainer, sample

from nemo_grpo.algorithms.advantages import estimate_advantages
from nemo_grpo.algorithms.kl import sequence_kl
from nemo_grpo.batch import StepBatch
from nemo_grpo.config import RewardScalingConfig, RewardShapingConfig


def test_rewards_are_scaled_then_shaped_and_components_scaled():
    trainer = bare_trainer(grpo={"reward_scaling": RewardScalingConfig(enabled=True, source_max=2.0),
                                 "reward_shaping": RewardShapingConfig(enabled=True, stop_properly_penalty_coef=0.0)})
    samples = [sample("math", "1+1=", "2", 1.5), sample("math", "1+1=", "22", 2.0)]
    samples[0].reward_components = {"correct": 1.0, "format": 0.5}
    samples[1].reward_components = {"correct": 1.0, "format": 1.0}
    samples[1].truncated = True
    rewards, components = trainer._rewards(samples, trainer._scaled_rewards(samples))
    assert rewards.tolist() == [0.75, 0.0]  # 1.5 / 2; truncated: x 0
    assert components["correct"].tolist() == [0.5, 0.5] and components["format"].tolist() == [0.25, 0.5]


def test_kl_in_reward_is_taken_off_before_the_estimator():
    trainer = bare_trainer(grpo={"num_generations_per_prompt": 2},
                           loss_fn={"reference_policy_kl_penalty": 0.5, "use_kl_in_reward": True,
                                    "reference_policy_kl_type": "k1"})
    data = {"token_mask": torch.tensor([[0.0, 1, 1], [0, 1, 0]]), "sample_mask": torch.ones(2),
            "prev_logprobs": torch.tensor([[0.0, -1, -1], [0, -1, 0]]),
            "reference_policy_logprobs": torch.tensor([[5.0, -2, -3], [5, -1, 9]])}
    step = StepBatch(torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 2]), data["token_mask"],
                     data["sample_mask"])
    rewards = torch.tensor([1.0, 1.0])
    adv, metrics = trainer._advantages(step, data, rewards, {})
    # k1 summed over the response tokens: sample 0: 1 + 2 = 3; sample 1: 0 -> rewards 1 - 1.5 = -0.5 and 1
    kl = sequence_kl(data["prev_logprobs"], data["reference_policy_logprobs"], data["token_mask"], "k1")
    assert kl.tolist() == [3.0, 0.0] and metrics["kl_in_reward"] == pytest.approx(1.5)
    assert metrics["reward_after_scaling"] == pytest.approx(0.25)
    expected = estimate_advantages(torch.tensor([-0.5, 1.0]), 2, trainer.cfg.grpo)
    torch.testing.assert_close(adv, expected)  # [N]: a sample's advantage, for each of its tokens
    assert adv[0] < 0 < adv[1]  # equal rewards, but sample 0 strayed from the reference


class Loader:
    def __init__(self):
        self.drawn = 0

    def next_batch(self, n):
        self.drawn += n
        return [f"p{self.drawn - n + i}" for i in range(n)]

    def state_dict(self):
        return {"epoch": 0, "position": self.drawn}


def test_dynamic_sampling_keeps_groups_with_differing_rewards_across_batches():
    """2 prompts per step, G = 2, int(2 x 1.5) = 3 prompts per generation batch. Batch 1: p0 differs, p1 and
    p2 are constant; batch 2: p3 and p4 differ, but one more group is all the step needs."""
    trainer = bare_trainer(grpo={"num_prompts_per_step": 2, "num_generations_per_prompt": 2,
                                 "use_dynamic_sampling": True, "batch_multiplier": 1.5})
    trainer.loader = Loader()
    rewards = {"p0": [1.0, 0.0], "p1": [1.0, 1.0], "p2": [0.0, 0.0], "p3": [0.0, 1.0], "p4": [1.0, 0.0],
               "p5": [0.0, 0.0]}

    def rollout(datums, seed, timer=None):
        return [sample("math", d, "x", rewards[d][i % 2]) for i, d in enumerate(datums)]

    trainer._rollout = rollout
    got = trainer.collect(step=1)
    assert [s.datum.message_log[0]["content"] for s in got.samples] == ["p0", "p0", "p3", "p3"]
    assert got.rewards.tolist() == [1.0, 0.0, 0.0, 1.0] and got.components == {}
    assert trainer.loader.drawn == got.prompts_drawn == 6 and got.loader_state == {"epoch": 0, "position": 6}
    assert got.stats == {"reward": pytest.approx(5 / 12), "gen_batches": 2.0,
                         "fraction_groups_kept": pytest.approx(2 / 6)}


def test_dynamic_sampling_gives_up_with_the_keys_to_raise():
    trainer = bare_trainer(grpo={"num_prompts_per_step": 2, "num_generations_per_prompt": 2,
                                 "use_dynamic_sampling": True, "dynamic_sampling_max_gen_batches": 2})
    trainer.loader = Loader()
    trainer._rollout = lambda datums, seed, timer=None: [sample("math", d, "x", 1.0) for d in datums]
    with pytest.raises(RuntimeError, match="0 of 2 prompts.*after 2 generation batches.*batch_multiplier"):
        trainer.collect(step=1)


def test_dynamic_sampling_filters_on_the_reward_before_shaping():
    """DAPO's overlong penalty on (buffer 2 of max_new_tokens 4): p0's two wrong answers differ only in length,
    so only the shaped rewards differ; the group is dropped, and p1 (one right) is kept with shaped rewards."""
    trainer = bare_trainer(grpo={"num_prompts_per_step": 1, "num_generations_per_prompt": 2,
                                 "use_dynamic_sampling": True, "batch_multiplier": 2.0,
                                 "reward_shaping": RewardShapingConfig(enabled=True, overlong_buffer_length=2,
                                                                       overlong_buffer_penalty=1.0)})
    trainer.cfg.policy.generation.max_new_tokens = 4
    trainer.loader = Loader()
    replies = {"p0": [("x", 0.0), ("xxxx", 0.0)], "p1": [("xxxx", 1.0), ("x", 0.0)]}
    trainer._rollout = lambda datums, seed, timer=None: [sample("math", d, *replies[d][i % 2])
                                                         for i, d in enumerate(datums)]
    got = trainer.collect(step=1)
    assert [s.datum.message_log[0]["content"] for s in got.samples] == ["p1", "p1"]
    assert got.rewards.tolist() == [0.0, 0.0]  # 1 - 1 (4 tokens: 2 past the buffer's start, penalty 1); 0
    assert got.stats["fraction_groups_kept"] == pytest.approx(0.5)
