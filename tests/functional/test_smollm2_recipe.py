"""configs/grpo_smollm2_arith_cpu.yaml, the recipe that shows the real checkpoint learning, for its first 2 steps
(in this process, on the session's Ray cluster, with its data written by nemo_grpo.data.word_problems), then
configs/eval_smollm2_arith_cpu.yaml on the checkpoint it wrote (on the torch engine: it starts in seconds). The
recipe's own settings (async GRPO, a non-colocated vLLM engine, packing, SmolLM2's chat template, the math
environment on JSONL rows, precision auto) are kept; only the batch, the answer length and the validation set are cut down."""

import json
import os

import pytest
from train_runs import ROOT, builtin_model_cache, read_metrics, train_in_process  # noqa: F401 (autouse fixture)

from nemo_grpo.data.word_problems import write_splits
from nemo_grpo.generation import vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")

RECIPE = os.path.join(ROOT, "configs", "grpo_smollm2_arith_cpu.yaml")
EVAL = os.path.join(ROOT, "configs", "eval_smollm2_arith_cpu.yaml")


@pytest.mark.slow
def test_recipe_first_two_steps_then_eval_of_its_checkpoint(user_console, ray_cluster, tmp_path, capsys):
    from nemo_grpo.eval import main as eval_main

    train, heldout = write_splits(str(tmp_path / "data"), 40, 8, seed=0)
    trainer, _ = train_in_process(
        tmp_path, "grpo.max_num_steps=2", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
        "policy.train_global_batch_size=4", "policy.generation.max_new_tokens=16", "grpo.max_val_samples=4",
        "grpo.val_batch_size=4", "checkpointing.save_period=2", f"data.train.data_path={train}",
        f"data.validation.data_path={heldout}", "policy.precision=auto", config=RECIPE)
    steps = read_metrics(f"{tmp_path}/logs", "train")
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["trajectory_age_max"] <= 1 for r in read_metrics(f"{tmp_path}/logs", "async"))
    assert read_metrics(f"{tmp_path}/logs", "val")[-1]["num_samples"] == 4  # val_at_end on held-out rows
    checkpoint = f"{tmp_path}/ckpt/step_2"
    assert os.path.isdir(checkpoint)
    capsys.readouterr()
    assert eval_main(["--config", EVAL, f"policy.model_name={checkpoint}", f"data.data_path={heldout}",
                      f"eval.save_path={tmp_path}/eval", "eval.num_tests_per_prompt=2", "eval.k_value=2",
                      "policy.generation.max_new_tokens=16", "policy.generation.backend=torch",
                      "eval.progress_bar=false"]) == 0
    summary = json.load(open(f"{tmp_path}/eval/summary.json"))
    assert summary["metrics"]["num_samples"] == 16 and summary["metric"] == "pass@2"


JUDGE_RECIPE = os.path.join(ROOT, "configs", "grpo_smollm2_judge_cpu.yaml")


@pytest.mark.slow
def test_judge_recipe_first_two_steps(user_console, ray_cluster, tmp_path):
    """configs/grpo_smollm2_judge_cpu.yaml's first 2 steps: SmolLM2 rewarded by a frozen SmolLM2 judge in the
    cluster (its own device, its template file, score_labels), validated on held-out subjects before and after.
    Cut down as above; the judge's engine is the torch one (it starts in seconds; vLLM's is the policy's here)."""
    from nemo_grpo.data import reviews

    train, heldout = reviews.write_splits(str(tmp_path / "data"), 16, 4, seed=0)
    train_in_process(
        tmp_path, "grpo.max_num_steps=2", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
        "policy.train_global_batch_size=4", "policy.train_micro_batch_size=2", "policy.generation.max_new_tokens=16",
        "grpo.max_val_samples=4", "grpo.val_batch_size=4", "grpo.val_period=0", "checkpointing.enabled=false",
        "env.llm_judge.generation.backend=torch", f"data.train.data_path={train}",
        f"data.validation.data_path={heldout}", "policy.precision=auto", config=JUDGE_RECIPE)
    steps = read_metrics(f"{tmp_path}/logs", "train")
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # each rollout judged: a score per review, every request answered, rewards the judged scores
        assert r["llm_judge_env/judge_requests"] >= r["llm_judge_env/num_samples"] == 4
        assert r["reward"] == pytest.approx(r["llm_judge_env/mean_score"], abs=1e-6)
    assert [(r["step"], r["num_samples"]) for r in read_metrics(f"{tmp_path}/logs", "val")] == [(0, 4), (2, 4)]
