"""End-to-end on the CPU, in this process on the session's Ray cluster (train_in_process): a run resumed from its
checkpoint continues exactly; GRPO against a reward model trained here raises that model's reward; the code recipe
learns in the sandbox; the objectives users switch on and LoRA learn. (The default recipe's long runs, as a user
runs them: test_user_runs.py.)"""

import os

import pytest
from train_runs import (builtin_model_cache, first_and_last_10, policy_expected_reward, read_metrics,  # noqa: F401
                        summary, train_in_process)


# One engine replica in the learning runs below (the recipes run one per policy device): their figures were measured
# with one, and the samples are the same with any count (seeded per request), so a run saves a replica's start-up
# and half its refits and learns exactly as with two. Replicas stay covered: the resume test here (two torch
# replicas), the default recipe's user runs (test_user_runs.py), test_refit.py, test_placement.py, tests/multinode.
ONE_REPLICA = "policy.generation.num_replicas=1"


@pytest.mark.slow
def test_resume_continues_exactly(ray_cluster, run_actors_pool, tmp_path):
    """4 steps straight vs 2 steps, a new trainer resuming from the step-2 checkpoint, 2 more. (A SIGKILLed
    driver's resume, as a user meets it: test_driver_kill.py.)"""
    common = ["grpo.val_at_start=false", "grpo.val_period=0", "grpo.val_at_end=false", "logger.plot=false",
              "checkpointing.save_period=2", "grpo.num_prompts_per_step=8", "policy.train_global_batch_size=64",
              "policy.generation.backend=torch",  # the fallback engine, end to end (the learning test uses vLLM)
              # the trainer's other reward path, end to end: a reference model (restored on resume), its KL taken
              # off the rewards, REINFORCE++ advantages, shaped rewards
              "loss_fn.reference_policy_kl_penalty=0.05", "loss_fn.use_kl_in_reward=true",
              "grpo.adv_estimator.name=reinforce_plus_plus", "grpo.reward_shaping.enabled=true",
              "grpo.reward_shaping.overlong_buffer_length=2", "grpo.reward_shaping.overlong_buffer_penalty=0.5"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_in_process(straight, "grpo.max_num_steps=4", *common, pool=run_actors_pool)
    first, _ = train_in_process(split, "grpo.max_num_steps=2", *common, pool=run_actors_pool)
    resumed, _ = train_in_process(split, "grpo.max_num_steps=4", *common, pool=run_actors_pool)
    a = read_metrics(f"{straight}/logs", "train")
    b = read_metrics(f"{split}/logs", "train")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert abs(b[0]["kl_in_reward"]) < 1e-6 < b[3]["kl_in_reward"]  # step 1 is the reference; then it moves away
    for key in ("reward", "loss", "grad_norm", "approx_entropy", "kl_in_reward", "reward_after_scaling"):
        for ra, rb in zip(a[2:], b[2:]):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-6), (key, ra["step"])
    assert sorted(os.listdir(f"{split}/ckpt")) == ["step_2", "step_4"]
    # each run's summary line: its own steps and rewards, the checkpoint it ended on
    assert summary(first)["steps"] == "2" and summary(first)["checkpoint"].endswith("ckpt/step_2")
    done = summary(resumed)
    assert (done["steps"], done["resumed_at"]) == ("4", "2") and done["checkpoint"].endswith("ckpt/step_4")
    assert (float(done["first"]), float(done["last"])) == (round(b[2]["reward"], 2), round(b[3]["reward"], 2))


@pytest.mark.slow
def test_on_policy_step_skips_the_old_logprob_pass(ray_cluster, run_actors_pool, tmp_path):
    """8 prompts x 8 samples in one global batch of 64 (the resume test's actors, lent again): the trainer runs
    no separate old-log-prob pass (train/logprob_passes 0; the reference's pass stays for the KL penalty), and its
    steps are those of a run that recomputes the old log-probs (grpo.recompute_old_logprobs=true), the metrics
    read off the kept training-forward log-probs (token_mult_prob_error, ...) included."""
    common = ["grpo.val_at_start=false", "grpo.val_period=0", "grpo.val_at_end=false", "logger.plot=false",
              "checkpointing.enabled=false", "grpo.num_prompts_per_step=8", "policy.train_global_batch_size=64",
              "policy.generation.backend=torch", "loss_fn.reference_policy_kl_penalty=0.05",
              "loss_fn.use_importance_sampling_correction=true", "grpo.max_num_steps=2"]
    train_in_process(tmp_path / "recompute", *common, "grpo.recompute_old_logprobs=true", pool=run_actors_pool)
    train_in_process(tmp_path / "one_pass", *common, pool=run_actors_pool)
    a, b = read_metrics(f"{tmp_path}/recompute/logs", "train"), read_metrics(f"{tmp_path}/one_pass/logs", "train")
    assert [r["logprob_passes"] for r in a] == [1, 1] and [r["logprob_passes"] for r in b] == [0, 0]
    for key in ("reward", "loss", "grad_norm", "kl_penalty", "is_weight", "token_mult_prob_error", "gen_kl_error"):
        for ra, rb in zip(a, b):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-6), (key, ra["step"])


# GRPO against the reward model over RM_STEPS steps. Measured with seeds 42 (the recipe's), 1, 2 (grpo.seed), the
# sampled reward (the reward model's score) in means of 10 steps: 0.74, 1.06, 1.16, 1.46 / 0.56, 0.35, 0.64, 0.81 /
# 0.63, 0.91, 1.12, 1.20, so steps 31-40 minus steps 1-10: +0.73, +0.24, +0.57 (the old criterion, +0.3, set for
# 100 steps, would fail seed 1 at 40). The reward model is beaten, not the task learned: the policy's exact expected
# accuracy on the additions fell in all three (0.265 -> 0.233, 0.213, 0.234); the validation, on math-verify,
# is not asserted.
RM_STEPS, RM_GAIN = 40, 0.15


@pytest.mark.slow
def test_grpo_against_a_reward_model_trained_here(ray_cluster, run_actors_pool, tmp_path):
    """train_rm on Megatron (TP=2) -> its HF export scores GRPO rollouts on the DTensor back end's reward
    model environment; the reward model's reward rises by RM_GAIN within RM_STEPS steps."""
    from nemo_grpo.algorithms.reward_model import RewardModelTrainer
    from nemo_grpo.validation import load_rm_train_config

    rm_dir = tmp_path / "rm"
    rm_cfg = load_rm_train_config("configs/rm_tiny_cpu.yaml", [
        "policy.backend=megatron", "policy.megatron_cfg.tensor_model_parallel_size=2", f"rm.output_dir={rm_dir}",
        f"checkpointing.checkpoint_dir={rm_dir}/ckpt", f"logger.log_dir={rm_dir}/logs"])
    rm_trainer = RewardModelTrainer(rm_cfg)
    try:
        rm_trainer.run()
    finally:
        rm_trainer.close()
    val = read_metrics(f"{rm_dir}/logs", "val")
    assert val[-1]["accuracy"] >= 0.8, val
    trainer, _ = train_in_process(tmp_path / "grpo", f"env.reward_model.model_name={rm_dir}/hf",
                                  f"grpo.max_num_steps={RM_STEPS}", "grpo.val_period=0", "grpo.val_at_start=false",
                                  "grpo.val_at_end=false", "logger.plot=false", ONE_REPLICA,
                                  config="configs/grpo_rm_tiny_cpu.yaml",
                                  pool=run_actors_pool)
    first, last = first_and_last_10([r["reward"] for r in trainer.history])
    assert last - first >= RM_GAIN, (first, last)
    assert all(r["reward_model_env/num_samples"] == 128 for r in trainer.history)


# The code recipe over CODE_STEPS steps, in fp32. builtin:tiny-code starts with P(reference program) 0.445 on its
# 300 problems (greedy validation 1.0; sampled reward 0.42), so nearly every group of 4 carries a signal from step
# 1: no step had a zero gradient. Measured (policy_expected_reward gain after 30 steps; sampled reward, mean of
# steps 21-30 minus steps 1-10), grpo.seed 42 (the recipe's), 1, 2, 3, on an AMD EPYC at torch capability AVX2
# (vLLM engine), and the same machine held to capability DEFAULT (ATEN_CPU_CAPABILITY=default, its own warm start;
# the torch engine: vLLM's compiled CPU kernels do not build at DEFAULT):
#   AVX2     exact +0.115 +0.130 +0.124 +0.132   reward +0.152 +0.119 +0.133 +0.081
#   DEFAULT  exact +0.134 +0.127 +0.112          reward +0.102 +0.119 +0.094
# (Before the tokenizer fix, models/tokenizer.py, the policy saw the prompts without their spaces: sampled reward
# 0.03, and from step 5 to 40 every group scored 0 on this machine.) The criteria leave a margin of 0.05 or more
# on every row (the exact gain is the noise-free one; the sampled reward's only says it moves the same way).
CODE_STEPS = 30
CODE_EXACT_GAIN, CODE_REWARD_GAIN = 0.06, 0.03


@pytest.mark.slow
def test_code_recipe_learns(ray_cluster, run_actors_pool, tmp_path):
    """GRPO with the code environment: programs run in the sandbox; from the first step every optimizer step has
    a signal, and the policy's exact probability of the reference programs and its sampled reward rise."""
    trainer, (before, after) = train_in_process(
        tmp_path, "logger.plot=false", f"grpo.max_num_steps={CODE_STEPS}", "grpo.val_period=0",
        "grpo.val_at_start=false", "grpo.val_at_end=false", ONE_REPLICA, config="configs/grpo_code_tiny_cpu.yaml",
        measure=policy_expected_reward, pool=run_actors_pool)
    first, last = first_and_last_10([r["reward"] for r in trainer.history])
    assert after - before >= CODE_EXACT_GAIN, (before, after)
    assert last - first >= CODE_REWARD_GAIN, (first, last)
    assert all(r["grad_norm"] > 0 for r in trainer.history), [r["grad_norm"] for r in trainer.history]
    assert all(r["code/num_samples"] == 64 for r in trainer.history)


# the objectives users switch on, on the default recipe; two optimizer steps per rollout batch, so the second
# is off-policy and each objective's ratio (per token or per sequence) and its clip take part
OBJECTIVES = {
    "gspo": ["loss_fn.sequence_level_importance_ratios=true", "loss_fn.token_level_loss=false"],
    "cispo": ["loss_fn.use_cispo=true"],
    "dr_grpo": ["loss_fn.loss_aggregation=seq_mean_token_sum_norm", "grpo.normalize_rewards=false"],
    "lora": [],  # configs/grpo_tiny_lora_cpu.yaml: rank 8 on every linear layer, the default objective
}
SHORT_RUN = ["policy.train_global_batch_size=64", "grpo.val_period=0", "grpo.val_at_start=false",
             "grpo.val_at_end=false", "checkpointing.enabled=false", "logger.plot=false", ONE_REPLICA]
LEARNING_STEPS = 60
# The learning signal: the policy's exact expected reward on the 100 problems (policy_expected_reward, from 0.265)
# after LEARNING_STEPS steps minus before. Measured gains after 20 / 40 / 60 steps, seeds 1, 2, 3 (grpo.seed):
#   default  +0.038 / +0.070 / +0.118   +0.025 / -0.005 / +0.025   +0.055 / +0.086 / +0.134
#   gspo     +0.030 / +0.066 / +0.122   +0.054 / -0.005 / +0.069   +0.017 / +0.062 / +0.072
#   cispo    +0.011 / +0.022 / +0.077   +0.035 / +0.097 / +0.057   +0.019 / +0.022 / +0.052
#   dr_grpo  +0.042 / +0.088 / +0.061   +0.042 / +0.001 / +0.034   +0.050 / +0.081 / +0.101
#   lora     -0.007 / +0.034 / +0.064   +0.026 / +0.064 / +0.092   +0.035 / +0.027 / +0.059
# Sampling makes the trajectories wander (a seed can stand still for 20 steps), but no run has failed to gain by
# step 60 (15 runs, the least +0.025); without learning the figure does not move at all (it is exact), and a
# wrong-signed objective lowers it. The criterion: +0.02 by step 60 (the sampled-reward criterion needed 200).
MIN_GAIN = 0.02


@pytest.mark.slow
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_objective_learns(ray_cluster, run_actors_pool, tmp_path, objective):
    """The policy's expected reward rises by MIN_GAIN within LEARNING_STEPS steps, with each objective; with
    LoRA, the engine samples from the policy after every refit (each refit installs the adapters on the engine's
    base model, policy.lora.refit=adapters)."""
    config = "configs/grpo_tiny_lora_cpu.yaml" if objective == "lora" else None
    trainer, (before, after) = train_in_process(tmp_path, *SHORT_RUN, f"grpo.max_num_steps={LEARNING_STEPS}",
                                                *OBJECTIVES[objective], config=config, measure=policy_expected_reward,
                                                pool=run_actors_pool)
    print(f"{objective}: expected reward {before:.4f} -> {after:.4f}")
    assert len(trainer.history) == LEARNING_STEPS and after - before >= MIN_GAIN, (before, after)
    if objective in ("gspo", "cispo"):  # the off-policy step clipped something: the objective's own clip ran
        assert max(r["clip_fraction"] for r in trainer.history) > 0
    if objective == "lora":
        assert all(abs(r["token_mult_prob_error"] - 1.0) < 1e-3 for r in trainer.history)
