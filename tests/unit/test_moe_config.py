"""Mixture-of-Experts models at config time: the DTensor back end takes Qwen3-MoE (HF's own model under FSDP2);
the Megatron back end takes it at pp = 1 (tp > 1 with sequence parallelism) with expert parallelism, and refuses
what it does not build yet,
naming the key, before any worker starts. And the expert tensors' two layouts, and their Megatron mapping.
(Parity with HF is in tests/functional/test_dtensor_policy.py and test_mcore_moe.py.)"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from nemo_grpo.backends.mcore import weights
from nemo_grpo.config import PolicyConfig
from nemo_grpo.errors import ConfigError
from nemo_grpo.models.experts import fused_expert_names, unfuse_experts
from nemo_grpo.backends.registry import policy_layout
from nemo_grpo.models.spec import hf_tensors, model_spec, moe_experts
from nemo_grpo.models.tiny import tiny_config
from nemo_grpo.backends.mcore.memory import megatron_stage_split
from nemo_grpo.models.counts import active_params, total_params
from nemo_grpo.planning.params import decoder_spec, hf_config
from nemo_grpo.validation import validate_model_layout


def _megatron(path, **overrides) -> PolicyConfig:
    cfg = PolicyConfig(model_name=str(path), backend="megatron")
    for key, value in overrides.items():
        obj, _, field = key.rpartition(".")
        setattr(cfg if not obj else getattr(cfg, obj), field, value)
    return cfg


def test_both_back_ends_take_moe(tmp_path):
    cfg = tiny_config("qwen3_moe")
    assert moe_experts(cfg) == 8 and moe_experts(tiny_config("qwen3")) == 0
    cfg.save_pretrained(tmp_path)
    validate_model_layout(PolicyConfig(model_name=str(tmp_path), backend="dtensor"), str(tmp_path))
    validate_model_layout(_megatron(tmp_path), str(tmp_path))
    validate_model_layout(_megatron(tmp_path, **{"megatron_cfg.expert_model_parallel_size": 8}), str(tmp_path))
    validate_model_layout(_megatron(tmp_path, **{"megatron_cfg.expert_model_parallel_size": 2,
                                                 "megatron_cfg.use_distributed_optimizer": True}), str(tmp_path))
    validate_model_layout(_megatron(tmp_path, **{"megatron_cfg.tensor_model_parallel_size": 2,
                                                 "megatron_cfg.sequence_parallel": True,
                                                 "megatron_cfg.expert_model_parallel_size": 2}), str(tmp_path))


@pytest.mark.parametrize("overrides,key,message", [
    ({"megatron_cfg.expert_model_parallel_size": 3}, "policy.megatron_cfg.expert_model_parallel_size",
     "3 does not divide the model's 8 experts"),
    ({"megatron_cfg.tensor_model_parallel_size": 2}, "policy.megatron_cfg.sequence_parallel",
     "false; .* under tensor_model_parallel_size 2 take each TP rank's share of the tokens: set it to true"),
    ({"lora.enabled": True}, "policy.lora.enabled", "not with a Mixture-of-Experts model on megatron yet"),
    ({"megatron_cfg.context_parallel_size": 2}, "policy.megatron_cfg.context_parallel_size",
     "2: not with a Mixture-of-Experts model yet")])
def test_megatron_refuses_what_it_does_not_build_for_moe(tmp_path, overrides, key, message):
    tiny_config("qwen3_moe").save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=f"config key '{key}': .*{message}"):
        validate_model_layout(_megatron(tmp_path, **overrides), str(tmp_path))


def test_expert_parallelism_needs_experts_and_data_parallel_ranks(tmp_path):
    tiny_config("qwen3").save_pretrained(tmp_path)
    ep = {"megatron_cfg.expert_model_parallel_size": 2}
    with pytest.raises(ConfigError, match="'policy.megatron_cfg.expert_model_parallel_size': 2, but .* is a dense "
                                          "model"):
        validate_model_layout(_megatron(tmp_path, **ep), str(tmp_path))
    assert policy_layout(_megatron(tmp_path, **ep), world=2).dp == 2
    four = {"megatron_cfg.expert_model_parallel_size": 4, "megatron_cfg.tensor_model_parallel_size": 2}
    with pytest.raises(ConfigError, match=r"'policy.megatron_cfg.expert_model_parallel_size': 4 does not divide the "
                                          r"2 ranks of tp x cp x dp \(dp 1 x tp 2 x pp 1 x cp 1 = 2\)"):
        policy_layout(_megatron(tmp_path, **four), world=2)


def test_expert_mapping_round_trips_over_expert_parallel_ranks():
    """HF's fused experts -> each EP rank's Megatron experts (global expert r * E/ep + i as local i; fc1 = the
    expert's gate rows then up rows) -> back, exactly; by hand on numbered tensors."""
    spec = model_spec(tiny_config("qwen3_moe", num_hidden_layers=1))
    hf = {t.name: torch.arange(math.prod(t.shape), dtype=torch.float32).view(t.shape) for t in hf_tensors(spec)}
    ranks = [weights.to_megatron(hf.__getitem__, spec, 1, 0, 1, 0, ep=2, ep_rank=r) for r in range(2)]
    fc1 = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    gate_up = hf["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(ranks[1][fc1.format(2)], gate_up[6]) and fc1.format(4) not in ranks[1]
    assert torch.equal(ranks[0]["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
    for e in weights.entries(spec):
        if e.kind in weights.EXPERT_LINEAR:
            experts = [local[n] for local in ranks for n in weights.expert_params(e, spec, 2)]
            assert torch.equal(torch.stack(experts), hf[e.hf])


def test_fused_experts_split_into_the_checkpoints_tensors():
    """transformers 5's fused layout -> each expert's checkpoint tensors (what vLLM's loader reads), by hand."""
    E, F, H = 3, 2, 4
    gate_up, down = torch.arange(E * 2 * F * H).view(E, 2 * F, H), torch.arange(E * H * F).view(E, H, F)
    p = "model.layers.0.mlp.experts"
    out = dict(unfuse_experts([(f"{p}.gate_up_proj", gate_up), (f"{p}.down_proj", down), ("x", down)]))
    assert torch.equal(out[f"{p}.2.gate_proj.weight"], gate_up[2, :F]) and torch.equal(out[f"{p}.2.up_proj.weight"],
                                                                                         gate_up[2, F:])
    assert torch.equal(out[f"{p}.1.down_proj.weight"], down[1]) and out["x"] is down and len(out) == 3 * E + 1
    assert fused_expert_names(out) == {f"{p}.gate_up_proj", f"{p}.down_proj"}


@pytest.mark.parametrize("name,total,active", [("Qwen3-30B-A3B", 30.53e9, 3.35e9), ("Qwen3-235B-A22B", 235.09e9,
                                                                                       22.19e9)])
def test_moe_parameter_counts_match_the_published_models(name, total, active):
    """The planner's counts from the published config (KNOWN_MODELS) against the HF model built on the meta
    device: 30.5B total / 3.3B active and 235B / 22B, as Qwen publishes them; the Megatron split into non-expert
    and expert parameters against HF's expert tensors."""
    cfg = hf_config(name, "policy.model_name")
    spec = decoder_spec(cfg, scalar_head=False, any_rope=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert total_params(spec) == sum(p.numel() for p in model.parameters())
    assert total_params(spec) == pytest.approx(total, rel=1e-3)
    assert active_params(spec) == pytest.approx(active, rel=1e-3)
    dense, expert = megatron_stage_split(spec, tp=1, pp=1, stage=0)
    assert expert == sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert dense + expert == total_params(spec)
    assert megatron_stage_split(spec, tp=1, pp=1, stage=0, ep=8) == (dense, expert // 8)


@pytest.mark.parametrize("overrides,message", [
    ({"megatron_cfg.moe_router_replay": "R2"}, "got 'R2'; allowed: none, old_policy, engine"),
    ({"megatron_cfg.moe_router_replay": "engine", "generation.backend": "vllm"},
     "engine .* needs the torch engine \\(policy.generation.backend=torch\\)"),
    ({"megatron_cfg.moe_router_replay": "old_policy", "backend": "dtensor"},
     "built on the megatron back end only; set policy.backend=megatron"),
    ({"megatron_cfg.moe_router_replay": "old_policy", "megatron_cfg.activation_checkpointing": True},
     "not with policy.megatron_cfg.activation_checkpointing")])
def test_routing_replay_keys_are_checked(tmp_path, overrides, message):
    from nemo_grpo.validation import validate_policy

    with pytest.raises(ConfigError, match=f"config key 'policy.megatron_cfg.moe_router_replay': .*{message}"):
        validate_policy(_megatron(tmp_path, **overrides), files=False)


def test_routing_replay_needs_routers(tmp_path):
    tiny_config("qwen3").save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="'policy.megatron_cfg.moe_router_replay': old_policy, but .* is a dense "
                                          "model"):
        validate_model_layout(_megatron(tmp_path, **{"megatron_cfg.moe_router_replay": "old_policy"}), str(tmp_path))


@pytest.mark.parametrize("key,message", [
    ("policy.dtensor_cfg.expert_model_parallel_size=2", "expert parallelism is built on the megatron back end"),
    ("policy.dtensor_cfg.moe_router_replay=old_policy", "routing replay is built on the megatron back end")])
def test_dtensor_points_megatron_keys_to_megatron(key, message):
    from nemo_grpo.config import read_config

    with pytest.raises(ConfigError, match=f"config key '{key.split('=')[0]}': {message}: set policy.backend=megatron"):
        read_config(overrides=[key])
