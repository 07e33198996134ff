"""The planner on Mixture-of-Experts models under Megatron: experts per expert-parallel rank (whole over TP),
fp32 masters and Adam state sharded over the expert-data-parallel group under the distributed optimizer, the
MoE activation terms and the alltoall dispatch buffers, by hand; the two Qwen3-MoE recipes planned; bad
layouts refused in one line naming the key. (Counts against HF's meta models: tests/unit/test_moe_config.py.)"""

import os

from transformers import Qwen3MoeConfig

from nemo_grpo.plan import main as plan_main
from nemo_grpo.plan import plan_recipe
from nemo_grpo.backends import activations as act
from nemo_grpo.backends.mcore.memory import megatron_stage_split
from nemo_grpo.models.counts import total_params
from nemo_grpo.planning.params import decoder_spec, hf_config
from nemo_grpo.validation import validate_model_layout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE_30B = os.path.join(ROOT, "configs", "grpo_math_qwen3_30b_a3b_megatron.yaml")
RECIPE_235B = os.path.join(ROOT, "configs", "grpo_math_qwen3_235b_a22b_megatron.yaml")
# h 64, 4 heads of 16 (2 KV heads), 2 layers, vocabulary 100, 8 experts of width 32, 2 per token
SMALL_MOE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100, num_experts=8,
                 num_experts_per_tok=2, tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])


def _small_moe(tp: int = 1):
    return decoder_spec(Qwen3MoeConfig(**SMALL_MOE), scalar_head=False, tp=tp)


def test_experts_per_rank_by_hand():
    """TP 2: attention / 2, q/k norms, the router and the layer norms whole; the experts / EP, whole over TP."""
    layer = 64 * 64 // 2 + 2 * 32 * 64 // 2 + 64 * 64 // 2 + 2 * 16 + 8 * 64 + 2 * 64  # q, k+v, o, qk-norm, router
    dense = 2 * layer + 2 * 100 * 64 // 2 + 64  # + embedding and lm_head / 2, final norm
    experts_per_layer = 8 * 3 * 64 * 32  # gate, up, down of each expert
    assert (layer, dense, experts_per_layer) == (6816, 20096, 49152)
    spec = _small_moe(tp=2)
    assert megatron_stage_split(spec, tp=2, pp=1, stage=0, ep=1) == (dense, 2 * experts_per_layer)
    assert megatron_stage_split(spec, tp=2, pp=1, stage=0, ep=8) == (dense, 2 * 3 * 64 * 32)  # 1 expert a layer
    assert megatron_stage_split(spec, tp=1, pp=2, stage=1, ep=4)[1] == 2 * 3 * 64 * 32  # layer 1's 2 experts


def test_moe_layer_activations_by_hand():
    """megatron_sdpa, bf16, TP 2 with sequence parallelism, one row of 64 tokens: the dense layer's terms with
    the MLP's replaced by k = 2 routed copies (permuted input h, 5 tensors of width 32) and the fp32 router
    [3, E], which follow the tokens (/ tp with SP) since the experts are whole over TP."""
    hidden = 16 * 64 + 8 + 2 * 2 * 64 + 2 * 2 * (64 + 5 * 32) + 12 * 8
    split = 2 * (3 * 64 + 3 * 32) + 4 * 4  # qkv out, rotated q and k, out, proj in; lse
    per_token = hidden / 2 + split / 2 + 4 * 16 * 2 * 64 / 64  # + rotary tables per token
    assert per_token == 1564
    assert act.layer_bytes_per_token(_small_moe(2), "megatron_sdpa", 2, 64, tp=2, sequence_parallel=True) == 1564
    assert act.moe_dispatch_bytes(_small_moe(), 2, tokens=32) == 3 * 32 * 2 * 64 * 2
    assert act.moe_dispatch_bytes(decoder_spec(Qwen3MoeConfig(**dict(SMALL_MOE, num_experts=0)), False), 2, 32) == 0


def _policy_rows(overrides: list[str]) -> tuple[dict, list[str]]:
    _, _, memory = plan_recipe(RECIPE_30B, overrides)
    return memory.roles[0].devices[0].phases["training"], memory.roles[0].notes


def test_moe_optimizer_state_is_sharded_over_expert_data_parallel_ranks():
    """Qwen3-30B-A3B on 32 GPUs, bf16, EP 8: a rank holds the non-expert parameters and 16 of each layer's 128
    experts. The distributed optimizer shards the non-expert masters and Adam moments over DP 32 and the
    experts' over their expert data parallel group, 32 / 8 = 4 ranks (TP 2 x DP 16: 2 x 16 / 8 = 4); without it
    every rank keeps its parameters' whole."""
    spec = decoder_spec(hf_config("Qwen3-30B-A3B", "k"), False)
    experts = 48 * 128 * 3 * 2048 * 768
    dense = total_params(spec) - experts
    local = experts // 8
    rows, notes = _policy_rows(["policy.megatron_cfg.expert_model_parallel_size=8",
                                "policy.megatron_cfg.use_distributed_optimizer=true"])
    assert rows["parameters (bfloat16)"] == 2 * (dense + local)
    assert rows["fp32 master weights / dp 32, experts / expert dp 4"] == 4 * dense / 32 + 4 * local / 4
    assert rows["optimizer state (adamw: 2 x fp32 / dp 32, experts / expert dp 4)"] == 8 * dense / 32 + 8 * local / 4
    assert rows["gradients (fp32)"] == 4 * (dense + local)
    assert rows["MoE token dispatch (3 x tok x top-8 x h)"] == 3 * 4096 * 8 * 2048 * 2
    assert not any("refuses" in n for n in notes)  # MoE with the distributed optimizer trains
    whole, _ = _policy_rows(["policy.megatron_cfg.expert_model_parallel_size=8"])
    assert whole["fp32 master weights"] == 4 * (dense + local)
    assert whole["optimizer state (adamw: 2 x fp32)"] == 8 * (dense + local)
    tp2, _ = _policy_rows(["policy.megatron_cfg.sequence_parallel=true",
                           "policy.megatron_cfg.expert_model_parallel_size=8",
                           "policy.megatron_cfg.tensor_model_parallel_size=2",
                           "policy.megatron_cfg.use_distributed_optimizer=true"])
    dense2, local2 = megatron_stage_split(decoder_spec(hf_config("Qwen3-30B-A3B", "k"), False, tp=2), 2, 1, 0, 8)
    assert local2 == local
    assert tp2["fp32 master weights / dp 16, experts / expert dp 4"] == 4 * dense2 / 16 + 4 * local / 4


def test_qwen3_moe_recipes_fit_and_say_what_training_builds(tmp_path):
    """Both recipes fit their clusters and pass the Megatron back end's own MoE checks with their published
    config.json (the 235B-A22B one at TP 4 with sequence parallelism x PP 2)."""
    for recipe, name in [(RECIPE_30B, "Qwen3-30B-A3B"), (RECIPE_235B, "Qwen3-235B-A22B")]:
        cfg, _, memory = plan_recipe(recipe, [])
        assert memory.problems() == [] and not any("refuses" in n for n in memory.roles[0].notes)
        hf_config(name, "k").save_pretrained(tmp_path / name)
        validate_model_layout(cfg.policy, str(tmp_path / name))


def test_bad_expert_layouts_are_one_line_errors_naming_the_key(capsys, tmp_path):
    Qwen3MoeConfig(**SMALL_MOE).save_pretrained(tmp_path)
    ep = "policy.megatron_cfg.expert_model_parallel_size"
    dense = os.path.join(ROOT, "configs", "grpo_math_8B_megatron.yaml")
    for recipe, overrides, message in [
            (RECIPE_30B, [f"policy.model_name={tmp_path}", f"{ep}=16"], "16 does not divide the model's 8 experts"),
            (RECIPE_30B, [f"{ep}=64"], "64 does not divide the 32 ranks of tp x cp x dp"),
            (dense, [f"{ep}=2"], "2, but /models/Llama-3.1-8B-Instruct is a dense model")]:
        capsys.readouterr()
        assert plan_main(["--config", recipe, *overrides]) == 2
        err = capsys.readouterr().err.strip()
        assert f"config key '{ep}': {message}" in err and "\n" not in err
