"""The memory and layout planner (nemo_grpo/planning, python -m nemo_grpo.plan): parameter counts by hand and
against models built on the meta device (HF and Megatron-Core, Llama-3-8B / 70B at the recipes' layouts),
activation bytes against what autograd saves, hand-computed per-GPU figures, every recipe planned, rejections
with their numbers. The Megatron-Core meta models (a fake process group in a subprocess each):
tests/functional/test_planner_megatron.py."""

import glob
import json
import os

import pytest
import torch

from nemo_grpo.config import ConfigError
from nemo_grpo.plan import main as plan_main
from nemo_grpo.plan import plan_recipe
from nemo_grpo.backends import activations as act
from nemo_grpo.backends.dtensor.memory import dtensor_rank_params
from nemo_grpo.backends.mcore.memory import megatron_stage_params
from nemo_grpo.models.counts import total_params
from nemo_grpo.planning.memory import GIB, RUNTIME_RESERVE_GIB
from nemo_grpo.planning.params import KNOWN_MODELS, decoder_spec, hf_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)


def _llama(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**dict(SMALL, **kw), architectures=["LlamaForCausalLM"])


def test_parameter_counts_by_hand():
    """h 256, ffn 512, 4 heads of 64 (2 KV heads), 2 layers, vocabulary 1000, untied."""
    layer = 256 * 256 + 2 * 128 * 256 + 256 * 256 + 3 * 512 * 256 + 2 * 256  # q, k+v, o, gate/up/down, norms
    assert layer == 590336
    spec = decoder_spec(_llama(), scalar_head=False, tp=2, pp=2)
    assert total_params(spec) == 2 * layer + 2 * 1000 * 256 + 256
    split_layer = (256 + 128 + 128) * 256 // 2 + 256 * 256 // 2 + 3 * 512 * 256 // 2 + 2 * 256
    assert megatron_stage_params(spec, 2, 2, 0) == split_layer + 1000 * 256 // 2  # + half the embedding
    assert megatron_stage_params(spec, 2, 2, 1) == split_layer + 256 + 1000 * 256 // 2  # final norm, lm_head
    # DTensor: layer linears split over tp 2, embedding / lm_head / norms replicated, all sharded over dp 2
    assert dtensor_rank_params(spec, tp=2, dp=2) == (2 * split_layer + 2 * 1000 * 256 + 256) // 2


def test_tied_embedding_gets_a_copy_on_the_last_stage():
    spec = decoder_spec(_llama(tie_word_embeddings=True, vocab_size=1001), scalar_head=False, tp=2, pp=2)
    assert spec.padded_vocab == 1002
    assert megatron_stage_params(spec, 2, 2, 1) - megatron_stage_params(spec, 2, 2, 0) == 256  # the final norm
    assert total_params(spec) == total_params(decoder_spec(_llama(vocab_size=1001), False)) - 1001 * 256


@pytest.mark.parametrize("name,published", [("Meta-Llama-3-8B-Instruct", 8_030_261_248),
                                            ("Meta-Llama-3-70B-Instruct", 70_553_706_496),
                                            ("Llama-3.3-70B-Instruct", 70_553_706_496)])
def test_hf_meta_model_has_the_planned_parameters(name, published):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cfg = hf_config(f"/nonexistent/{name}", "policy.model_name")
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(cfg)
        cfg.num_labels = 1
        rm = AutoModelForSequenceClassification.from_config(cfg)
    assert sum(p.numel() for p in lm.parameters()) == total_params(decoder_spec(cfg, False)) == published
    assert sum(p.numel() for p in rm.parameters()) == total_params(decoder_spec(cfg, True))


# ---------------------------------------------------------------------------------------------- activations
def _saved_bytes(model, forward) -> int:
    """Bytes of the distinct storages autograd saves for backward during forward() (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


@pytest.mark.parametrize("impl", ["hf", "hf_eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_layer_activations_match_autograd(impl, dtype):
    """One decoder layer's saved bytes (2 layers minus 1) equal the planner's formula."""
    from transformers import LlamaForCausalLM

    from nemo_grpo.backends.batching import token_logprobs_from_logits

    b, s = 2, 64
    ids, mask = torch.randint(0, 1000, (b, s)), torch.ones(b, s, dtype=torch.long)
    saved = []
    for layers in (1, 2):
        torch.manual_seed(0)
        cfg = _llama(num_hidden_layers=layers, attn_implementation="sdpa" if impl == "hf" else "eager")
        model = LlamaForCausalLM(cfg).to(dtype)
        saved.append(_saved_bytes(model, lambda: token_logprobs_from_logits(
            model(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids, mask).sum()))
    spec = decoder_spec(_llama(), False)
    planned = act.layer_bytes_per_token(spec, impl, 4 if dtype == torch.float32 else 2, s) * b * s
    assert saved[1] - saved[0] == pytest.approx(planned, rel=0.01)


# ---------------------------------------------------------------------------------------------- per-GPU figures
@pytest.fixture
def small_model_dir(tmp_path):
    """A model directory with only its config.json (the planner needs no weights)."""
    _llama().save_pretrained(tmp_path)
    return str(tmp_path)


def _rows(memory, role: int, device: int, phase: str) -> dict:
    return memory.roles[role].devices[device].phases[phase]


MEGATRON_BY_HAND = [  # TP 2 x PP 2 x DP 2, bf16, Megatron's distributed optimizer, 4 micro-batches of 2 x 64 tokens
    "policy.backend=megatron", "policy.precision=bfloat16", "policy.megatron_cfg.tensor_model_parallel_size=2",
    "policy.megatron_cfg.pipeline_model_parallel_size=2", "policy.megatron_cfg.sequence_parallel=true",
    "policy.megatron_cfg.use_distributed_optimizer=true", "cluster.gpus_per_node=8",
    "policy.train_global_batch_size=16", "policy.train_micro_batch_size=2", "policy.max_total_sequence_length=64",
    "policy.generation.backend=torch"]
N0 = (256 + 128 + 128) * 256 // 2 + 256 * 256 // 2 + 3 * 512 * 256 // 2 + 2 * 256 + 1000 * 256 // 2  # stage 0, TP 2


def test_megatron_figures_by_hand(small_model_dir):
    """TP 2 x PP 2 x DP 2, bf16, masters and Adam sharded over DP (Megatron's DistributedOptimizer), 4 micro-batches
    of 2 x 64 tokens per step."""
    _, _, memory = plan_recipe(None, [f"policy.model_name={small_model_dir}", *MEGATRON_BY_HAND])
    stage0, stage1 = _rows(memory, 0, 0, "training"), _rows(memory, 0, 1, "training")
    spec = decoder_spec(_llama(), False, 2, 2)
    per_token = act.layer_bytes_per_token(spec, "megatron_sdpa", 2, 64, tp=2, sequence_parallel=True,
                                          seqs_per_micro_batch=2)
    assert stage0 == {"parameters (bfloat16)": 2 * N0, "fp32 master weights / dp 2": 4 * N0 / 2,
                      "gradients (fp32)": 4 * N0,
                      "optimizer state (adamw: 2 x fp32 / dp 2)": 2 * 4 * N0 / 2,
                      "activations (2 x 64 tok)": 2 * 1 * 128 * per_token,  # 2 micro-batches in flight, 1 layer
                      "runtime reserve": RUNTIME_RESERVE_GIB * GIB}
    assert stage1["activations (2 x 64 tok)"] == 1 * 1 * 128 * per_token  # the last stage: 1 in flight
    assert stage1["logits"] == 128 * 500 * (2 + 4 + 4)  # vocabulary 1000 / tp 2: bf16 logits, fp32 copy + grad
    assert "logits" not in stage0
    assert memory.problems() == []


def test_bf16_gradient_reduction_keeps_a_bf16_buffer_and_an_fp32_shard(small_model_dir):
    """grad_reduce_in_fp32=false: DDP's gradient buffer in bf16, plus the fp32 copy of this DP rank's shard that
    the distributed optimizer steps."""
    _, _, memory = plan_recipe(None, [f"policy.model_name={small_model_dir}", *MEGATRON_BY_HAND,
                                      "policy.megatron_cfg.distributed_data_parallel_config.grad_reduce_in_fp32=false"])
    stage0 = _rows(memory, 0, 0, "training")
    assert stage0["gradients (bfloat16; fp32 shard / dp 2)"] == 2 * N0 + 4 * N0 / 2
    assert "gradients (fp32)" not in stage0


def test_packing_counts_a_micro_batch_by_its_token_budget(small_model_dir):
    """Megatron TP 2 x PP 2, 8 sequences of up to 64 tokens per DP rank packed into rows of 160 tokens: 4 packed
    rows per step (8 x 64 / 160, rounded up), each with its 160 x 160 mask; the forward row holds 256 tokens."""
    _, _, memory = plan_recipe(None, [
        f"policy.model_name={small_model_dir}", "policy.backend=megatron", "policy.precision=bfloat16",
        "policy.megatron_cfg.tensor_model_parallel_size=2", "policy.megatron_cfg.pipeline_model_parallel_size=2",
        "policy.megatron_cfg.sequence_parallel=true", "cluster.gpus_per_node=8", "policy.train_global_batch_size=16",
        "policy.max_total_sequence_length=64", "policy.generation.backend=torch",
        "policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=160",
        "policy.sequence_packing.logprob_mb_tokens=256", "policy.sequence_packing.attention=mask"])
    spec = decoder_spec(_llama(), False, 2, 2)
    per_token = act.layer_bytes_per_token(spec, "megatron_sdpa", 2, 160, tp=2, sequence_parallel=True)
    mask = 160 * 160 * (1 + 2)
    stage0, stage1 = _rows(memory, 0, 0, "training"), _rows(memory, 0, 1, "training")
    assert stage0["activations (1 packed row of 160 tok)"] == 2 * (160 * per_token + mask)  # 2 in flight
    assert stage1["activations (1 packed row of 160 tok)"] == 160 * per_token + mask
    assert stage1["logits"] == 160 * 500 * (2 + 4 + 4)
    forward = _rows(memory, 0, 1, "log-prob forward")
    assert forward["forward working set (1 packed row of 256 tok)"] == \
        act.layer_bytes_per_token(spec, "megatron_sdpa", 2, 256, tp=2, sequence_parallel=True) * 256
    assert forward["packing mask"] == 256 * 256 * 3
    assert "min(2 - k, 4 micro-batches)" in " ".join(memory.roles[0].notes)


def test_packing_per_segment_keeps_no_mask(small_model_dir):
    """The default packed attention (per segment, policy.sequence_packing.attention=varlen) builds no dense mask:
    the same row as above without its S x S term."""
    _, _, memory = plan_recipe(None, [
        f"policy.model_name={small_model_dir}", "policy.backend=megatron", "cluster.gpus_per_node=8",
        "policy.megatron_cfg.tensor_model_parallel_size=2", "policy.megatron_cfg.pipeline_model_parallel_size=2",
        "policy.megatron_cfg.sequence_parallel=true", "policy.precision=bfloat16", "policy.generation.backend=torch",
        "policy.train_global_batch_size=16", "policy.max_total_sequence_length=64",
        "policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=160",
        "policy.sequence_packing.logprob_mb_tokens=256"])
    per_token = act.layer_bytes_per_token(decoder_spec(_llama(), False, 2, 2), "megatron_sdpa", 2, 160, tp=2,
                                          sequence_parallel=True)
    assert _rows(memory, 0, 1, "training")["activations (1 packed row of 160 tok)"] == 160 * per_token
    assert "packing mask" not in _rows(memory, 0, 1, "log-prob forward")


def test_dtensor_figures_by_hand(small_model_dir):
    """FSDP 4 x TP 2, fp32: sharded parameters, gradients and two Adam moments; while loading the shards and one
    checkpoint tensor (the largest: the 1000 x 256 embedding) being read, not the full model."""
    _, _, memory = plan_recipe(None, [f"policy.model_name={small_model_dir}", "cluster.gpus_per_node=8",
                                      "policy.dtensor_cfg.tensor_parallel_size=2", "policy.generation.backend=torch",
                                      "policy.precision=float32"])
    split_layer = (256 + 128 + 128) * 256 // 2 + 256 * 256 // 2 + 3 * 512 * 256 // 2 + 2 * 256
    n = (2 * split_layer + 2 * 1000 * 256 + 256) // 4
    train = _rows(memory, 0, 0, "training")
    assert train["parameters (fp32, FSDP shards)"] == 4 * n
    assert train["gradients (fp32, FSDP shards)"] == 4 * n
    assert train["optimizer state (adamw: 2 x fp32)"] == 8 * n
    assert train["gathered units (float32, x2)"] == (2 * 1000 * 256 + 256) * 4 * 2  # the root: embedding, head
    assert _rows(memory, 0, 0, "loading (sharded)") == {
        "parameters (fp32, FSDP shards)": 4 * n, "one checkpoint tensor read (fp32, at most whole)": 4 * 1000 * 256,
        "runtime reserve": RUNTIME_RESERVE_GIB * GIB}


def _recipes():
    return sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "grpo_*.yaml")))


@pytest.mark.parametrize("recipe", _recipes(), ids=os.path.basename)
def test_every_recipe_fits_its_cluster(recipe, tiny_model_dir):
    """Every GRPO recipe validates (model directories need not exist) and fits its stated cluster, a role per
    reward model and in-cluster LLM judge; a reward model that train_rm makes first is stood in for by a tiny one."""
    overrides = []
    if os.path.basename(recipe) == "grpo_rm_tiny_cpu.yaml":
        overrides.append(f"env.reward_model.model_name={tiny_model_dir('qwen2', scalar_head=True)}")
    cfg, _, memory = plan_recipe(recipe, overrides)
    print(f"\n{os.path.basename(recipe)}\n{memory.table()}")
    assert memory.problems() == []
    rm, judge = cfg.env.reward_model, cfg.env.llm_judge
    assert len(memory.roles) == 1 + (rm is not None and rm.enabled) + (judge is not None and judge.in_cluster)


def test_70B_recipes_plan_every_role():
    _, resources, memory = plan_recipe(os.path.join(ROOT, "configs", "grpo_rm_70B_megatron.yaml"), [])
    policy, rm = memory.roles
    assert [d.label for d in policy.devices] == ["stage 0", "stage 1"]
    assert resources.placements["policy"].nodes == tuple(range(6)) and rm.gpus_per_node == 8
    assert {"training", "log-prob forward", "generation (colocated vLLM)"} <= set(policy.devices[0].phases)
    assert list(rm.devices[0].phases) == ["scoring"]


def test_a_layout_that_does_not_fit_is_rejected_with_its_numbers(capsys):
    recipe = os.path.join(ROOT, "configs", "grpo_math_70B_megatron.yaml")
    assert plan_main(["--config", recipe, "policy.megatron_cfg.tensor_model_parallel_size=2",
                      "policy.megatron_cfg.pipeline_model_parallel_size=1"]) == 1
    err = capsys.readouterr().err
    assert "does not fit: policy (megatron TP 2 x PP 1 x DP 32" in err
    assert "training needs" in err and "GiB per GPU > cluster.gpu_memory_gib 79.6" in err
    assert "fp32 master weights / dp 32 4.1" in err  # 70.55e9 / 2 (TP) x 4 bytes / 32 (distributed optimizer)


def test_vllm_without_room_for_a_sequence_is_rejected(capsys):
    recipe = os.path.join(ROOT, "configs", "grpo_math_70B_megatron.yaml")
    assert plan_main(["--config", recipe, "policy.generation.vllm_cfg.tensor_parallel_size=1"]) == 1
    err = capsys.readouterr().err
    assert "policy.generation.vllm_cfg.gpu_memory_utilization 0.6 x 79.6 GiB leaves" in err
    assert "131.4 GiB of weights" in err


def test_model_errors_name_the_key(capsys, tmp_path):
    megatron = os.path.join(ROOT, "configs", "grpo_math_8B_megatron.yaml")
    assert plan_main(["--config", megatron, "policy.model_name=/models/Llama-3.1-8B-Instruct"]) == 0  # llama3 RoPE
    for kind, rope in (("yarn", dict(factor=4.0, original_max_position_embeddings=32768)),  # Qwen's long context
                       ("dynamic", dict(factor=4.0))):  # dynamic NTK, which the Megatron back end does not build
        path = tmp_path / f"Qwen2.5-1.5B-{kind}"
        path.mkdir()
        (path / "config.json").write_text(json.dumps(dict(KNOWN_MODELS["qwen2.5-1.5b"],
                                                          rope_scaling=dict(rope_type=kind, **rope))))
    assert plan_main(["--config", megatron, f"policy.model_name={tmp_path / 'Qwen2.5-1.5B-yarn'}"]) == 0
    dynamic = tmp_path / "Qwen2.5-1.5B-dynamic"
    capsys.readouterr()
    assert plan_main(["--config", megatron, f"policy.model_name={dynamic}"]) == 2
    assert "'policy.model_name': the model's rope_type 'dynamic' is not built by the megatron back end" \
        in capsys.readouterr().err
    dtensor = os.path.join(ROOT, "configs", "grpo_math_8B_dtensor.yaml")  # any RoPE on DTensor
    assert plan_main(["--config", dtensor, f"policy.model_name={dynamic}"]) == 0
    assert plan_main(["--config", megatron, "policy.model_name=/models/my-model"]) == 2
    assert "policy.model_name: '/models/my-model' has no config.json" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="tensor_model_parallel_size': 16 does not divide the model's "
                                          "num_key_value_heads=8"):
        plan_recipe(megatron, ["cluster.num_nodes=2", "policy.megatron_cfg.tensor_model_parallel_size=16"])


def test_known_models_are_sized_like_their_published_configs():
    sizes = {name: total_params(decoder_spec(hf_config(f"/x/{name}", "k"), False, any_rope=True))
             for name in KNOWN_MODELS}
    assert sizes["qwen2.5-1.5b"] == 1_543_714_304 and sizes["llama-3.3-70b"] == 70_553_706_496
    assert sizes["qwen3-32b"] == sizes["qwen3-32b-yarn"] == 32_762_123_264  # Qwen3-32B's model card: 32.8B
    # the built-in real checkpoint is planned as SmolLM2-135M (the GGUF's model has 134,515,008), not as the tiny
    # model the other built-ins are
    assert sizes["smollm2-135m"] == 134_515_008
    assert total_params(decoder_spec(hf_config("builtin:smollm2-135m-instruct", "k"), False)) == 134_515_008


def test_cpu_engine_of_its_own_is_a_note_not_a_crash():
    """Async GRPO on a CPU cluster: the engine is non-colocated without devices (no placement); this was a
    KeyError: 'generation' from the planner."""
    _, resources, memory = plan_recipe(os.path.join(ROOT, "configs", "grpo_smollm2_arith_cpu.yaml"), [])
    assert "generation" not in resources.placements and len(memory.roles) == 1
    assert any("without devices" in note for note in memory.roles[0].notes)


def test_vllm_notes_count_the_replicas():
    """The engine runs one replica per TP group: a full copy of the weights over its TP devices each, a KV cache
    each. Llama-3.3-70B at TP 8 colocated on 8 x 8 GPUs: 8 replicas, one per node; K and V of a token: 80 layers x
    8 KV heads / TP 8 x 128 x 2 bytes x 2 on each device."""
    _, _, memory = plan_recipe(os.path.join(ROOT, "configs", "grpo_math_70B_megatron.yaml"), [])
    tokens = _rows(memory, 0, 0, "generation (colocated vLLM)")["vLLM KV cache"] / (80 * 1 * 128 * 2 * 2)
    notes = memory.roles[0].notes
    assert (f"vLLM replica: weights 131.4 GiB (bf16, / TP 8 = 16.4 per device), KV cache {tokens:,.0f} tokens = "
            f"{tokens / 4096:,.1f} sequences of 4096 tokens") in notes
    assert (f"vLLM, 8 replicas: KV cache {8 * tokens:,.0f} tokens = {8 * tokens / 4096:,.1f} sequences at once, for "
            f"512 rollouts per step (64 per replica)") in notes


def test_non_colocated_vllm_notes_count_the_replicas():
    """grpo_rm_1B's non-colocated variant (its header): generation's own 2 GPUs at TP 1 are 2 replicas."""
    _, _, memory = plan_recipe(os.path.join(ROOT, "configs", "grpo_rm_1B.yaml"), [
        "policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=2",
        "policy.dtensor_cfg.tensor_parallel_size=1"])
    generation = memory.roles[1]
    assert generation.layout == "vLLM 2 replicas x TP 1 = 2 GPUs on nodes 0"
    assert generation.notes[0].startswith("vLLM replica: weights 2.9 GiB (bf16, / TP 1 = 2.9 per device)")
    assert generation.notes[1].startswith("vLLM, 2 replicas: KV cache ")
    assert generation.notes[1].endswith("for 512 rollouts per step (256 per replica)")
    assert not any("replica" in note for note in memory.roles[0].notes)  # the policy's notes: no engine


def test_70B_lora_recipe_refits_its_adapters_not_the_merged_layers():
    """Llama-3.3-70B (80 layers, hidden 8192, 8 KV heads of 128, FFN 28672), rank 16 on every linear: per layer
    A [16, in] (in: 8192 for q, k, v, o, gate, up; 28672 for down) and B [out, 16] (out: 8192, 1024, 1024, 8192,
    28672, 28672, 8192), in bf16 at every refit; merged, every linear weight of the layers after the first refit."""
    adapters = 80 * 16 * (6 * 8192 + 28672 + 2 * 8192 + 2 * 1024 + 2 * 28672 + 8192) * 2
    linears = 80 * (2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192) * 2
    for refit, chosen in (("adapters", "(policy.lora.refit=adapters, this recipe)"),
                          ("merged", "(=merged, this recipe:")):
        _, _, memory = plan_recipe(os.path.join(ROOT, "configs", "grpo_math_70B_lora_megatron.yaml"),
                                   [f"policy.lora.refit={refit}"])
        note = next(n for n in memory.roles[0].notes if n.startswith("refit"))
        assert f"LoRA adapters {adapters / GIB:.2f} GiB" in note and f"merged {linears / GIB:.1f} GiB" in note, note
        assert chosen in note and note.count("this recipe") == 1
        assert f"{linears / adapters:.0f}x the bytes" in note
    _, _, memory = plan_recipe(os.path.join(ROOT, "configs", "grpo_math_70B_megatron.yaml"), [])
    assert "refit: 131.4 GiB a step (bfloat16, every weight)" in memory.roles[0].notes


# ---------------------------------------------------------------------------------------------- LoRA
LORA = ["policy.lora.enabled=true", "policy.lora.rank=4", "policy.lora.alpha=8"]
# one layer's adapters on one of TP 2 ranks, rank 4: column-parallel (q, k, v, gate, up) A [4, in] whole,
# B [out, 4] / 2; row-parallel (o, down) A / 2, B whole
LORA_Q, LORA_KV = 4 * 256 + 256 * 4 // 2, 4 * 256 + 128 * 4 // 2
LORA_O, LORA_GATE_UP, LORA_DOWN = 4 * 256 // 2 + 256 * 4, 4 * 256 + 512 * 4 // 2, 4 * 512 // 2 + 256 * 4
LORA_LAYER = LORA_Q + 2 * LORA_KV + LORA_O + 2 * LORA_GATE_UP + LORA_DOWN
assert LORA_LAYER == 11776
DTYPE = {"bfloat16": 2, "float32": 4}


def test_lora_adapters_are_peft_s():
    """At TP 1 the planner's adapter count is what peft puts on the HF model."""
    import peft
    from transformers import LlamaForCausalLM

    from nemo_grpo.config import LoraConfig
    from nemo_grpo.models.lora import LINEAR_LAYERS, peft_config
    from nemo_grpo.models.counts import lora_layer_params

    with torch.device("meta"):
        model = peft.get_peft_model(LlamaForCausalLM(_llama()), peft_config(LoraConfig(enabled=True, rank=4)))
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    spec = decoder_spec(_llama(), False)
    a_in, b_out = 6 * 256 + 512, 256 + 128 + 128 + 256 + 512 + 512 + 256  # A [4, in] and B [out, 4] of each
    assert adapters == 2 * lora_layer_params(spec, list(LINEAR_LAYERS), 4, tp=1) == 2 * 4 * (a_in + b_out)


@pytest.mark.parametrize("distributed", [True, False])
def test_megatron_lora_figures_by_hand(small_model_dir, distributed):
    """TP 2 x PP 2 x DP 2, bf16, LoRA rank 4 on every linear: the frozen base of a stage in bf16 alone, whole on
    each DP rank; the stage's adapters (1 layer) with fp32 masters and Adam moments (/ dp 2 with the distributed
    optimizer) and fp32 gradients; activations as without LoRA."""
    _, _, memory = plan_recipe(None, [f"policy.model_name={small_model_dir}", *MEGATRON_BY_HAND, *LORA,
                                      f"policy.megatron_cfg.use_distributed_optimizer={str(distributed).lower()}"])
    _, _, full = plan_recipe(None, [f"policy.model_name={small_model_dir}", *MEGATRON_BY_HAND])
    a, dp = LORA_LAYER, " / dp 2" if distributed else ""
    shards = 2 if distributed else 1
    stage0 = _rows(memory, 0, 0, "training")
    assert stage0 == {"frozen base weights (bfloat16)": 2 * N0, "LoRA adapters (bfloat16)": 2 * a,
                      f"LoRA fp32 master weights{dp}": 4 * a / shards, "LoRA gradients (fp32)": 4 * a,
                      f"LoRA optimizer state (adamw: 2 x fp32{dp})": 2 * 4 * a / shards,
                      "activations (2 x 64 tok)": _rows(full, 0, 0, "training")["activations (2 x 64 tok)"],
                      "runtime reserve": RUNTIME_RESERVE_GIB * GIB}
    n1 = N0 + 256  # stage 1: the final norm and the lm_head instead of the embedding
    stage1 = _rows(memory, 0, 1, "training")
    assert stage1["frozen base weights (bfloat16)"] == 2 * n1 and stage1["LoRA adapters (bfloat16)"] == 2 * a
    assert stage1["logits"] == _rows(full, 0, 1, "training")["logits"]
    assert _rows(memory, 0, 0, "log-prob forward")["frozen base weights (bfloat16)"] == 2 * N0
    assert "LoRA rank 4" in memory.roles[0].layout and memory.problems() == []


@pytest.mark.parametrize("precision,targets,per_layer", [
    ("bfloat16", "[]", LORA_LAYER), ("float32", "[q_proj,down_proj]", LORA_Q + LORA_DOWN)])
def test_dtensor_lora_figures_by_hand(small_model_dir, precision, targets, per_layer):
    """FSDP 4 x TP 2, LoRA rank 4: the frozen base in fp32 (FSDP2 keeps fp32 parameters), sharded over dp 4 (no
    gradients, no moments); the adapters (split over TP as on Megatron) in fp32 with fp32 gradients and Adam, sharded too."""
    _, _, memory = plan_recipe(None, [f"policy.model_name={small_model_dir}", "cluster.gpus_per_node=8",
                                      "policy.dtensor_cfg.tensor_parallel_size=2", "policy.generation.backend=torch",
                                      f"policy.precision={precision}", *LORA, f"policy.lora.target_modules={targets}"])
    split_layer = (256 + 128 + 128) * 256 // 2 + 256 * 256 // 2 + 3 * 512 * 256 // 2 + 2 * 256
    n, a, b = (2 * split_layer + 2 * 1000 * 256 + 256) // 4, 2 * per_layer // 4, DTYPE[precision]
    train = _rows(memory, 0, 0, "training")
    assert {k: v for k, v in train.items() if not k.startswith(("activations", "logits", "runtime"))} == {
        "frozen base weights (fp32, FSDP shards)": 4 * n, "LoRA adapters (fp32, FSDP shards)": 4 * a,
        f"gathered units ({precision}, x2)": (2 * 1000 * 256 + 256) * b * 2,  # the root: embedding, head
        "LoRA gradients (fp32, FSDP shards)": 4 * a, "LoRA optimizer state (adamw: 2 x fp32)": 8 * a}
    assert _rows(memory, 0, 0, "loading (sharded)") == {
        "frozen base weights (fp32, FSDP shards)": 4 * n, "LoRA adapters (fp32, FSDP shards)": 4 * a,
        "one checkpoint tensor read (fp32, at most whole)": 4 * 1000 * 256,
        "runtime reserve": RUNTIME_RESERVE_GIB * GIB}
    assert memory.problems() == []


@pytest.mark.parametrize("backend", ["megatron", "dtensor"])
def test_lora_reference_policy_keeps_no_copy(small_model_dir, backend):
    """With a KL penalty the full-parameter reference is a host copy of each rank's weights; with LoRA it is the
    base with the adapters disabled: no copy."""
    layout = MEGATRON_BY_HAND if backend == "megatron" else [
        "cluster.gpus_per_node=8", "policy.generation.backend=torch", "policy.train_micro_batch_size=2"]
    common = [f"policy.model_name={small_model_dir}", *layout, "loss_fn.reference_policy_kl_penalty=0.01"]
    _, _, full = plan_recipe(None, common)
    _, _, lora = plan_recipe(None, common + LORA)
    n1 = N0 + 256  # Megatron's larger stage, in bf16; DTensor: fp32 shards of FSDP 8
    assert full.roles[0].host_per_gpu["reference copy"] == (
        2 * n1 if backend == "megatron" else 4 * -(-total_params(decoder_spec(_llama(), False)) // 8))
    assert "reference copy" not in lora.roles[0].host_per_gpu
    assert "reference model: the frozen base with the LoRA adapters disabled (no copy)" in lora.roles[0].notes


def test_70B_lora_recipe_fits_one_node_where_full_training_does_not(capsys):
    """Llama-3.3-70B, TP 8 on one node: LoRA keeps the bf16 base (70.55e9 / 8 x 2 bytes) and rank-16 adapters;
    full-parameter training on the same layout needs masters, gradients and Adam for every weight."""
    recipe = os.path.join(ROOT, "configs", "grpo_math_70B_lora_megatron.yaml")
    cfg, resources, memory = plan_recipe(recipe, [])
    assert cfg.cluster.num_nodes == 1 and resources.placements["policy"].world_size == 8
    assert memory.problems() == [] and "reference copy" not in memory.roles[0].host_per_gpu
    train = _rows(memory, 0, 0, "training")
    spec = decoder_spec(hf_config(cfg.policy.model_name, "k"), False, 8, 1)
    assert train["frozen base weights (bfloat16)"] == 2 * megatron_stage_params(spec, 8, 1, 0) == \
        2 * ((70_553_706_496 - 161 * 8192) // 8 + 161 * 8192)  # the 161 norms whole, the rest / 8
    layer = 16 * 8192 * 5 + 16 * (8192 + 1024 + 1024 + 28672 * 2) // 8 + 16 * (8192 + 28672) // 8 + 16 * 8192 * 2
    assert train["LoRA adapters (bfloat16)"] == 2 * 80 * layer and 80 * layer == 90_112_000
    assert train["LoRA optimizer state (adamw: 2 x fp32)"] == 8 * 80 * layer
    assert not any(k.startswith(("fp32 master", "gradients", "optimizer")) for k in train)
    assert plan_main(["--config", recipe, "policy.lora.enabled=false"]) == 1
    err = capsys.readouterr().err
    assert "does not fit: policy (megatron TP 8 x PP 1 x DP 1 = 8 GPUs on nodes 0" in err
    assert "training needs 152.3 GiB per GPU > cluster.gpu_memory_gib 79.6" in err
    assert "fp32 master weights 32.9, gradients (fp32) 32.9, optimizer state (adamw: 2 x fp32) 65.7" in err


# ---------------------------------------------------------------------------------------------- context parallelism
KV_LAYER = 2 * 2 * 64 * (2 // 2) * 64 * 2  # K and V of 2 rows x 64 tokens, 2 KV heads / TP 2, head_dim 64, bf16


@pytest.mark.parametrize("recompute", [False, True])
def test_megatron_context_parallel_figures_by_hand(small_model_dir, recompute):
    """MEGATRON_BY_HAND with CP 2 in place of DP 2 (TP 2 x PP 2 x CP 2 x DP 1 on 8 GPUs): the same rows per
    micro-batch, each rank holding 32 of a row's 64 tokens. Weights: masters and Adam / (dp 1 x cp 2), the numbers
    of DP 2; activations and logits halved; the all-gathered K/V of every layer of the stage per micro-batch in
    flight added (of one layer with recomputation), and one layer's in a forward."""
    flags = [f"policy.megatron_cfg.activation_checkpointing={str(recompute).lower()}"]
    _, _, base = plan_recipe(None, [f"policy.model_name={small_model_dir}", *MEGATRON_BY_HAND, *flags])
    _, _, memory = plan_recipe(None, [f"policy.model_name={small_model_dir}", *MEGATRON_BY_HAND, *flags,
                                      "policy.megatron_cfg.context_parallel_size=2"])
    assert memory.roles[0].layout.startswith("megatron TP 2 x PP 2 x CP 2 x DP 1 = 8 GPUs")
    tag = ", recompute" if recompute else ""
    act_cp1, act_cp2 = f"activations (2 x 64 tok{tag})", f"activations (2 x 64 tok / cp 2{tag})"
    kv = f"gathered K/V (cp 2, {'1 layer' if recompute else 'every layer'})"
    for stage, in_flight in ((0, 2), (1, 1)):  # 1F1B: 2 micro-batches in flight on stage 0, 1 on the last
        train, before = _rows(memory, 0, stage, "training"), _rows(base, 0, stage, "training")
        assert train[act_cp2] == before[act_cp1] / 2
        if not recompute:  # 1 layer x the micro-batches in flight x 2 x 64 / 2 tokens
            assert train[act_cp2] == in_flight * 64 * act.layer_bytes_per_token(
                decoder_spec(_llama(), False, 2, 2), "megatron_sdpa", 2, 64, tp=2, sequence_parallel=True,
                seqs_per_micro_batch=2)
        assert train[kv] == KV_LAYER * (1 if recompute else 1 * in_flight)  # 1 layer per stage
        assert train["fp32 master weights / dp 1 x cp 2"] == before["fp32 master weights / dp 2"]
        assert train["optimizer state (adamw: 2 x fp32 / dp 1 x cp 2)"] == \
            before["optimizer state (adamw: 2 x fp32 / dp 2)"]
        assert train["gradients (fp32)"] == before["gradients (fp32)"]
    assert _rows(memory, 0, 1, "training")["logits"] == 128 * 500 * (2 + 4 + 4) / 2
    forward, before = _rows(memory, 0, 1, "log-prob forward"), _rows(base, 0, 1, "log-prob forward")
    assert forward["forward working set (64 x 64 tok / cp 2)"] == before["forward working set (64 x 64 tok)"] / 2
    assert forward["forward logits"] == before["forward logits"] / 2
    assert forward["forward gathered K/V (cp 2, 1 layer)"] == 2 * 64 * 64 * 1 * 64 * 2  # logprob_batch_size 64
    assert memory.problems() == []


def test_megatron_context_parallel_halves_a_packed_row_and_its_mask(small_model_dir):
    """Packed rows of 160 tokens (test_packing_counts_a_micro_batch_by_its_token_budget) over CP 2: a rank keeps
    80 tokens' activations, and no dense mask (CP masks each query chunk itself), even with attention=mask."""
    packing = ["policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=160",
               "policy.sequence_packing.logprob_mb_tokens=256", "policy.sequence_packing.sequence_length_round=8",
               "policy.sequence_packing.attention=mask"]
    _, _, memory = plan_recipe(None, [f"policy.model_name={small_model_dir}", *MEGATRON_BY_HAND, *packing,
                                      "policy.megatron_cfg.context_parallel_size=2"])
    spec = decoder_spec(_llama(), False, 2, 2)
    per_token = act.layer_bytes_per_token(spec, "megatron_sdpa", 2, 160, tp=2, sequence_parallel=True)
    stage1 = _rows(memory, 0, 1, "training")
    assert stage1["activations (1 packed row of 160 tok / cp 2)"] == 80 * per_token
    assert stage1["gathered K/V (cp 2, every layer)"] == 2 * 160 * 1 * 64 * 2
    assert "packing mask" not in _rows(memory, 0, 1, "log-prob forward")


def test_dtensor_context_parallel_figures_by_hand(small_model_dir):
    """FSDP over DP 2 x CP 2 x TP 2, fp32 (test_dtensor_figures_by_hand with CP 2 in place of half of FSDP 4): the
    same FSDP shards (over the 4 dp x cp ranks); activations and logits halved; K/V of both layers added."""
    common = [f"policy.model_name={small_model_dir}", "cluster.gpus_per_node=8", "policy.generation.backend=torch",
              "policy.dtensor_cfg.tensor_parallel_size=2", "policy.precision=float32"]
    _, _, base = plan_recipe(None, common)
    _, _, memory = plan_recipe(None, common + ["policy.dtensor_cfg.context_parallel_size=2"])
    assert memory.roles[0].layout.startswith("dtensor FSDP 4 (DP 2 x CP 2) x TP 2 = 8 GPUs")
    train, before = _rows(memory, 0, 0, "training"), _rows(base, 0, 0, "training")
    for key in ("parameters (fp32, FSDP shards)", "gradients (fp32, FSDP shards)", "optimizer state (adamw: 2 x fp32)",
                "gathered units (float32, x2)"):
        assert train[key] == before[key]
    assert train["activations (32 x 16 tok / cp 2)"] == before["activations (32 x 16 tok)"] / 2
    assert train["logits"] == before["logits"] / 2 == 32 * 16 / 2 * 1000 * (4 + 4 + 4)  # the full vocabulary
    assert train["gathered K/V (cp 2, every layer)"] == 2 * 32 * 16 * 1 * 64 * 4 * 2  # 32 rows x 16 tok, fp32, 2 layers


def test_long_context_recipes_need_their_context_parallelism():
    """Qwen3-32B at 131,072 tokens on 8 x 8 GPUs: TP 8 x CP 8 with recomputation plans at less than 55% of what a
    rank running whole rows (CP 1, DP 8) needs (71 GiB of 79.6: no margin for the planner's approximations), and
    does not fit without recomputation; Llama-3.3-70B at 32k: CP 2 x DP 2 in place of the 4k recipe's DP 4."""
    recipe = os.path.join(ROOT, "configs", "grpo_math_qwen3_32b_128k_megatron.yaml")
    cfg, _, memory = plan_recipe(recipe, [])
    spec = decoder_spec(hf_config(cfg.policy.model_name, "k"), False, 8, 1)
    assert (spec.rope_scaling.kind, spec.rope_scaling.factor, spec.rope_scaling.original_max_positions) == \
        ("yarn", 4.0, 32768)
    assert memory.roles[0].layout.startswith("megatron TP 8 x PP 1 x CP 8 x DP 1 = 64 GPUs")
    train = _rows(memory, 0, 0, "training")
    assert train["gathered K/V (cp 8, 1 layer)"] == 2 * 131072 * (8 // 8) * 128 * 2  # 64 MiB
    assert memory.problems() == []
    whole_rows = sum(_rows(plan_recipe(recipe, ["policy.megatron_cfg.context_parallel_size=1"])[2], 0, 0,
                           "training").values())
    assert sum(train.values()) < 0.55 * whole_rows and whole_rows > 0.85 * memory.gpu_bytes
    assert plan_recipe(recipe, ["policy.megatron_cfg.activation_checkpointing=false"])[2].problems() != []
    _, _, memory = plan_recipe(os.path.join(ROOT, "configs", "grpo_math_70B_32k_megatron.yaml"), [])
    assert memory.roles[0].layout.startswith("megatron TP 8 x PP 2 x CP 2 x DP 2 = 64 GPUs")
    assert memory.problems() == []
