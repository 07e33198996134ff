"""Async GRPO end to end on the CPU (non-colocated generation, importance-sampling correction): with
max_trajectory_age_steps 0 it is synchronous GRPO step for step; with 1 every trajectory is at most one step old,
a checkpoint taken with rollouts in flight resumes; in-flight weight updates run; a killed generation actor stops
the run with a message (a process of its own, as a user meets it); the default recipe learns async. The
runs but the killed one are built in this process on the session's Ray cluster (train_in_process)."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
from train_runs import (ROOT, builtin_model_cache, policy_expected_reward, read_metrics, summary,  # noqa: F401
                        train_in_process)

COMMON = ["policy.generation.colocated.enabled=false", "loss_fn.use_importance_sampling_correction=true",
          "grpo.val_at_start=false", "grpo.val_period=0", "grpo.val_at_end=false", "grpo.num_prompts_per_step=8",
          "policy.train_global_batch_size=64", "policy.generation.backend=torch"]
ASYNC = ["grpo.async_grpo.enabled=true"]


@pytest.mark.slow
def test_zero_age_is_synchronous_grpo(ray_cluster, run_actors_pool, tmp_path):
    sync, zero = tmp_path / "sync", tmp_path / "zero"
    train_in_process(sync, "grpo.max_num_steps=3", "checkpointing.enabled=false", *COMMON, pool=run_actors_pool)
    train_in_process(zero, "grpo.max_num_steps=3", "checkpointing.enabled=false", *COMMON, *ASYNC,
                     "grpo.async_grpo.max_trajectory_age_steps=0", pool=run_actors_pool)
    a, b = read_metrics(f"{sync}/logs", "train"), read_metrics(f"{zero}/logs", "train")
    assert [r["step"] for r in b] == [1, 2, 3]
    for key in ("reward", "loss", "grad_norm", "token_mult_prob_error", "mean_response_length"):
        for ra, rb in zip(a, b):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-6), (key, ra["step"])
    ages = read_metrics(f"{zero}/logs", "async")
    assert [r["trajectory_age_max"] for r in ages] == [0, 0, 0] and all(r["dropped_stale"] == 0 for r in ages)


@pytest.mark.slow
def test_ages_stay_within_the_bound_and_a_checkpoint_with_rollouts_in_flight_resumes(ray_cluster, run_actors_pool,
                                                                                      tmp_path, caplog):
    args = ["grpo.max_num_steps=4", "checkpointing.save_period=2", *COMMON, *ASYNC,
            "grpo.async_grpo.max_trajectory_age_steps=1"]
    caplog.set_level(logging.INFO, logger="nemo_grpo")
    train_in_process(tmp_path, *args, pool=run_actors_pool)
    ages = read_metrics(f"{tmp_path}/logs", "async")
    assert [r["step"] for r in ages] == [1, 2, 3, 4]
    assert all(r["trajectory_age_max"] <= 1 and r["dropped_stale"] == 0 for r in ages)
    assert max(r["trajectory_age_max"] for r in ages) == 1  # generation did run ahead of training
    assert all("generation_wait" in r for r in read_metrics(f"{tmp_path}/logs", "timing"))
    assert "checkpoint at step 2: rollouts in flight" in caplog.text
    # as if the run had died after step 3: resume from the step-2 checkpoint, whose rollouts in flight were lost
    shutil.rmtree(f"{tmp_path}/ckpt/step_4")
    done = summary(train_in_process(tmp_path, *args, pool=run_actors_pool)[0])
    assert (done["steps"], done["resumed_at"]) == ("4", "2")
    resumed = read_metrics(f"{tmp_path}/logs", "async")[4:]
    assert [r["step"] for r in resumed] == [3, 4] and resumed[0]["trajectory_age_max"] == 0  # regenerated


# Generation longer than training, so that refits arrive mid-batch: an untrained tiny model with 256 token ids
# (the tokenizer decodes 55 of them) samples its EOS about once in 256 tokens, so each batch decodes ~248 steps,
# several times a step's log-probs and training on its 4 samples. DAPO's length penalty makes the rewards of a
# group differ, so each refit carries new weights.
LONG_GENERATION = ["cluster.gpus_per_node=1", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
                   "policy.train_global_batch_size=4", "policy.train_micro_batch_size=4",
                   "policy.logprob_batch_size=4", "policy.generation.max_new_tokens=248",
                   "policy.max_total_sequence_length=256", "grpo.reward_shaping.enabled=true",
                   "grpo.reward_shaping.overlong_buffer_length=248", "grpo.reward_shaping.overlong_buffer_penalty=1.0"]


@pytest.mark.slow
def test_in_flight_weight_updates_run_within_the_age_bound(ray_cluster, run_actors_pool, tmp_path, tiny_model_dir):
    """The trainer refits without waiting for the generation batch under way and the engine takes the weights
    between two forward steps (async/refits_mid_generation, cumulative, counts them); ages stay within the
    bound, counted from each batch's first weights."""
    model = tiny_model_dir("qwen2", vocab_size=256, max_position_embeddings=256)
    train_in_process(tmp_path, "grpo.max_num_steps=4", "checkpointing.enabled=false", *COMMON, *ASYNC,
                     "grpo.async_grpo.in_flight_weight_updates=true", f"policy.model_name={model}", *LONG_GENERATION,
                     pool=run_actors_pool)
    ages = read_metrics(f"{tmp_path}/logs", "async")
    assert [r["step"] for r in ages] == [1, 2, 3, 4]
    assert all(r["trajectory_age_max"] <= 1 and r["dropped_stale"] == 0 for r in ages)
    counts = [r["refits_mid_generation"] for r in ages]
    # the refits after steps 1-3 may land in the batches of steps 2-4 (the first seldom does: the first step's
    # training is slow); after step 4 no batch is under way
    assert counts == sorted(counts) and 1 <= counts[-1] <= 3, counts
    assert any(r["grad_norm"] > 0 for r in read_metrics(f"{tmp_path}/logs", "train"))  # the weights did change


def engine_processes(root_pid: int) -> list[psutil.Process]:
    """The generation actor's process among root_pid's descendants (its own Ray cluster's workers)."""
    procs = psutil.Process(root_pid).children(recursive=True)
    return [p for p in procs if "GenerationWorker" in " ".join(p.cmdline() or [])]


@pytest.mark.slow
def test_a_killed_generation_actor_stops_the_run_with_a_message(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "nemo_grpo.train", "logger.progress_bar=false", "grpo.max_num_steps=400",
           "checkpointing.enabled=false", f"logger.log_dir={tmp_path}/logs", *COMMON, *ASYNC]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = f"{tmp_path}/logs/metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (os.path.exists(metrics) and any(json.loads(x)["prefix"] == "train" for x in open(metrics))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(1)
        victims = engine_processes(proc.pid)
        assert victims, "no generation actor process found"
        for p in victims:
            p.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=300)  # never a hang
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "GenerationFailed" in err and "the run stops" in err, err[-3000:]


ASYNC_STEPS = 60


@pytest.mark.slow
def test_default_recipe_learns_async(ray_cluster, run_actors_pool, tmp_path):
    """The default recipe one step off-policy (non-colocated engine, importance-sampling correction): the policy's
    exact expected reward (policy_expected_reward, from 0.265) rises within ASYNC_STEPS steps. Measured gains after
    30 / 60 steps, seeds 1, 2, 3: +0.008 / +0.064, +0.063 / +0.105, +0.059 / +0.103; the synchronous objectives'
    wander as much (test_grpo_e2e.py: the least of 15 runs +0.025 at 60). The criterion: +0.02 by step 60 (the
    sampled-reward criterion, +0.3, took 400)."""
    trainer, (before, after) = train_in_process(
        tmp_path, "policy.generation.colocated.enabled=false", "loss_fn.use_importance_sampling_correction=true",
        *ASYNC, "grpo.async_grpo.max_trajectory_age_steps=1", f"grpo.max_num_steps={ASYNC_STEPS}", "grpo.val_period=0",
        "grpo.val_at_start=false", "grpo.val_at_end=false",
        "checkpointing.enabled=false", "logger.plot=false", measure=policy_expected_reward, pool=run_actors_pool)
    print(f"async: expected reward {before:.4f} -> {after:.4f}")
    assert len(trainer.history) == ASYNC_STEPS and after - before >= 0.02, (before, after)
    ages = read_metrics(f"{tmp_path}/logs", "async")
    assert max(r["trajectory_age_max"] for r in ages) == 1
