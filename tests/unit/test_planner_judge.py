"""The planner on the in-cluster LLM judge (env.llm_judge.model_name): its vLLM replicas on devices of their own, by
hand for Llama-3.1-8B at TP 1 and 2 (weights, KV cache, replicas and what they hold), a recipe with a judge planned
through `python -m nemo_grpo.plan`, a gpu_memory_utilization that leaves no room for one sequence of the judge's
context rejected (exit 1), and the notes where nothing is planned (the torch engine; no devices). The planner's
other roles: tests/unit/test_planner.py."""

import os
from dataclasses import replace

import pytest

from nemo_grpo.plan import main as plan_main
from nemo_grpo.plan import plan_recipe
from nemo_grpo.planning.memory import GIB, RUNTIME_RESERVE_GIB, plan_memory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JUDGE = "/models/Llama-3.1-8B-Instruct"
VLLM = "env.llm_judge.generation.vllm_cfg."
UTIL_0_2 = VLLM + "gpu_memory_utilization=0.2"


def _judged(tmp_path, *overrides) -> list[str]:
    """grpo_math_8B_dtensor's rollouts judged in the cluster by Llama-3.1-8B-Instruct on 4 of the node's 8 GPUs (the
    policy keeps 4): the recipe, then its overrides."""
    (tmp_path / "judge.txt").write_text("Rate this answer from 0 to 10: {response}")
    return [os.path.join(ROOT, "configs", "grpo_math_8B_dtensor.yaml"), "data.train.env_name=llm_judge",
            f"env.llm_judge.model_name={JUDGE}", "env.llm_judge.resources.gpus_per_node=4",
            f"env.llm_judge.judge_prompt_template_fpath={tmp_path / 'judge.txt'}", *overrides]


@pytest.mark.parametrize("tp", [1, 2])
def test_llm_judge_rows_by_hand(tmp_path, tp):
    """Llama-3.1-8B's 8,030,261,248 parameters in bf16 / TP, the KV cache 0.6 x 79.6 GiB leaves; 4 GPUs / TP
    replicas; a token's K and V on a device: 32 layers x 8 KV heads / TP x 128 x 2 bytes x 2; sequences of its
    context (131,072 positions capped at 32,768); 32 x 16 rollouts, a request each."""
    recipe, *args = _judged(tmp_path, f"{VLLM}tensor_parallel_size={tp}")
    _, resources, memory = plan_recipe(recipe, args)
    policy, judge = memory.roles
    weights, n = 8_030_261_248 * 2 / tp, 4 // tp
    kv = 0.6 * 79.6 * GIB - weights
    tokens = kv / (32 * 8 // tp * 128 * 2 * 2)
    assert judge.role == "LLM judge" and judge.gpus_per_node == 4
    assert judge.devices[0].phases == {"judging": {"vLLM weights (bf16, / its TP)": pytest.approx(weights),
                                                   "vLLM KV cache": pytest.approx(kv),
                                                   "runtime reserve": RUNTIME_RESERVE_GIB * GIB}}
    assert judge.layout == f"vLLM {n} replicas x TP {tp} = 4 GPUs on nodes 0, {JUDGE}, frozen"
    assert judge.notes == [
        f"vLLM replica: weights 15.0 GiB (bf16, / TP {tp} = {15.0 / tp:.1f} per device), KV cache {tokens:,.0f} "
        f"tokens = {tokens / 32768:,.1f} sequences of 32768 tokens",
        f"vLLM, {n} replicas: KV cache {n * tokens:,.0f} tokens = {n * tokens / 32768:,.1f} sequences at once, for "
        f"512 judge requests per step ({512 // n} per replica)"]
    assert resources.placements["policy"].world_size == 4 and memory.problems() == []
    assert not any("judge" in note for note in policy.notes)


def test_recipe_with_an_llm_judge_plans_its_role(tmp_path, capsys):
    """A judge on a node of its own (cluster.num_nodes 2, all 8 GPUs) at TP 4: 2 replicas on node 1; pairwise,
    circular, both orders: 16 x 2 comparisons in each of the 32 prompts' groups."""
    assert plan_main(["--config", *_judged(tmp_path, "cluster.num_nodes=2", VLLM + "tensor_parallel_size=4",
                                           "env.llm_judge.resources.gpus_per_node=null",
                                           "env.llm_judge.mode=pairwise")]) == 0
    out = capsys.readouterr().out
    assert "llm_judge: nodes 1 x 8 GPUs = 8" in out and "every GPU fits" in out
    assert f"\nLLM judge: vLLM 2 replicas x TP 4 = 8 GPUs on nodes 1, {JUDGE}, frozen\n" in out
    assert "vLLM weights (bf16, / its TP)             3.74" in out  # 8,030,261,248 x 2 / 4
    assert "for 1024 judge requests per step (512 per replica)" in out


def test_llm_judge_without_room_for_a_sequence_is_rejected(tmp_path, capsys):
    """gpu_memory_utilization 0.2 x 79.6 GiB leaves 0.96 GiB after 14.96 GiB of weights, less than the 4 GiB of one
    sequence of 32,768 tokens: vLLM would refuse to start. With max_model_len 4096 (0.5 GiB) it fits."""
    assert plan_main(["--config", *_judged(tmp_path, UTIL_0_2)]) == 1
    assert ("does not fit: LLM judge: env.llm_judge.generation.vllm_cfg.gpu_memory_utilization 0.2 x 79.6 GiB leaves "
            "1.0 GiB for the KV cache after 15.0 GiB of weights, less than one sequence of 32768 tokens (4.00 GiB): "
            "raise it or vllm_cfg.tensor_parallel_size, or set a shorter vllm_cfg.max_model_len (unset: the model's "
            "max_position_embeddings 131072, capped at 32768)") in capsys.readouterr().err
    assert plan_main(["--config", *_judged(tmp_path, UTIL_0_2, VLLM + "max_model_len=40000")]) == 1
    assert "less than one sequence of 40000 tokens (4.88 GiB): raise it or vllm_cfg.tensor_parallel_size, or lower " \
           "vllm_cfg.max_model_len" in capsys.readouterr().err
    assert plan_main(["--config", *_judged(tmp_path, UTIL_0_2, VLLM + "max_model_len=4096")]) == 0


def test_llm_judge_notes_where_nothing_is_planned(tmp_path):
    """The tiny recipe's validation judged by the builtin SmolLM2 (planned by name: 8192 positions) on its second
    device, a request per validation prompt; its torch engine is a note, and so is a judge without devices (a
    CPU-only cluster), as for generation."""
    args = _judged(tmp_path, "env.llm_judge.model_name=builtin:smollm2-135m-instruct",
                   "env.llm_judge.resources.gpus_per_node=1")[2:]
    cfg, resources, memory = plan_recipe(None, args)
    judge = memory.roles[1]
    assert "sequences of 8192 tokens" in judge.notes[0]
    assert judge.notes[1].endswith("for 100 judge requests per validation batch (100 per replica)")
    roles = plan_recipe(None, args + ["env.llm_judge.generation.backend=torch"])[2].roles
    assert len(roles) == 1 and "LLM judge: the torch engine (a fallback) is not planned" in roles[0].notes
    memory = plan_memory(cfg, replace(resources, placements={"policy": resources.placements["policy"]}))
    assert len(memory.roles) == 1 and memory.roles[0].notes[-1] == (
        "LLM judge: vLLM on an actor without devices (no llm_judge placement): on a CPU-only cluster, nothing to plan")
