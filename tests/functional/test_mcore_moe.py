"""Qwen3-MoE (8 experts, top-2, renormalised top-k weights; every layer sparse) on the Megatron back end: its
MoELayer (TopKRouter, grouped-GEMM experts, alltoall token dispatch over gloo) against the single-process
Hugging Face model, in one process, at DP=2 (experts replicated), at expert parallelism 2 (dp 2 x ep 2: each
rank holds 4 of the 8 experts, tokens exchanged all-to-all) and at dp 4 x ep 2 (each expert on two ranks, its
gradient summed over the expert-data-parallel group); Megatron-Core's distributed optimizer at DP=2, dp 2 x ep 2
and dp 4 x ep 2 (a dense and an expert DistributedOptimizer). One optimizer step per policy: routing is
discontinuous, so after a step the layouts' float differences may flip a near-tied top-k choice (see
test_dtensor_policy.py::test_qwen3_moe_matches_hf).
"""

import math
import sys

import pytest
import ray
import torch
from policy_checks import (PACKING, TokenPGLoss, assert_logprobs_match_hf, check_checkpoint_resumes,
                           check_on_policy_step, check_routes_match_hf, check_train_parity, export_state, load_hf,
                           make_batch, max_diff, policy_config)
from test_dynamic_batching import BUDGET
from test_sequence_packing import SEED
from test_mcore_policy import FOUR, megatron_policy
from train_runs import read_metrics, train_in_process
from transformers import AutoConfig

from nemo_grpo.backends.mcore import weights
from nemo_grpo.models.spec import model_spec

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # local_experts runs in the workers
# every policy of the module trains with both router losses (backends/router.py; HF's load-balancing loss)
ROUTER = {"megatron_cfg.moe_router_load_balancing_type": "aux_loss", "megatron_cfg.moe_aux_loss_coeff": 0.1,
          "megatron_cfg.moe_z_loss_coeff": 0.01}
EP2 = {"megatron_cfg.expert_model_parallel_size": 2, **ROUTER}
DISTOPT = {"megatron_cfg.use_distributed_optimizer": True}


@pytest.mark.parametrize("layout,extra", [("tp1", ROUTER), ("dp2", ROUTER), ("dp2", EP2), ("tp2_sp", ROUTER),
                                          ("pp2", ROUTER)], ids=["tp1", "dp2", "ep2", "tp2_sp", "pp2"])
def test_moe_matches_hf(policy_pool, tiny_model_dir, layout, extra):
    """The export is the checkpoint bit for bit (the experts gathered from their EP ranks into HF's fused
    tensors), log-probs within 1e-5 of HF's, and one step's weights within 1e-4 of a single-process HF step with
    the same pre-clip norm (each expert's gradient counted once), whose loss has the router losses (HF's
    load-balancing loss, the z-loss); the step's moe/aux_loss, moe/z_loss and moe/load_imbalance are HF's."""
    path = tiny_model_dir("qwen3_moe")
    with megatron_policy(policy_pool, path, layout, **extra) as policy:
        ep = extra.get("megatron_cfg.expert_model_parallel_size", 1)
        assert policy.group.run_all("__ray_call__", local_experts) == [8 // ep] * policy.group.world_size
        grouped = ["GroupedSequentialMLP"]  # SequentialMLP's experts computed by grouped GEMMs (grouped_experts.py)
        assert policy.group.run_all("__ray_call__", expert_modules) == [grouped] * policy.group.world_size
        assert max_diff(export_state(policy), load_hf(path).state_dict()) == 0.0
        assert_logprobs_match_hf(policy, path, make_batch(5, seed=7))
        check_train_parity(policy, path, make_batch(4, seed=1))


def test_on_policy_step_equals_the_separate_logprob_pass(policy_pool, tiny_model_dir):
    """dp 2 x ep 2 with the router losses (test_moe_matches_hf's policy): the on-policy step's routing is its own
    training forward's, as with the separate pass (no routing replay)."""
    path = tiny_model_dir("qwen3_moe")
    with megatron_policy(policy_pool, path, "dp2", **EP2) as policy:
        check_on_policy_step(policy, policy_pool.reset, make_batch(4, seed=6))


def local_experts(actor) -> int:
    """The experts a policy rank holds of its first layer."""
    return sum(1 for n in actor.engine.params
               if n.startswith("decoder.layers.0.mlp.experts.") and n.endswith("fc1.weight"))


def expert_modules(actor) -> list[str]:
    """The class names of a rank's MoE expert modules (grouped_experts.GroupedSequentialMLP: grouped GEMMs)."""
    return sorted({type(m).__name__ for n, m in actor.engine.model.named_modules() if n.endswith(".mlp.experts")})


def test_ep2_checkpoint_resumes_in_one_process(policy_pool, tiny_model_dir, tmp_path):
    """A checkpoint saved at dp 2 x ep 2 (experts and their Adam moments gathered over the EP group) loads in one
    process with every expert and takes the same next step."""
    path = tiny_model_dir("qwen3_moe")
    with megatron_policy(policy_pool, path, "dp2", **EP2) as policy:
        check_checkpoint_resumes(policy, lambda: megatron_policy(policy_pool, path, "tp1", **ROUTER),
                                 make_batch(4, seed=3), str(tmp_path / "ckpt"))


@pytest.mark.parametrize("extra", [ROUTER, EP2], ids=["dp2", "ep2"])
def test_distributed_optimizer_matches_hf_and_resumes_in_one_process(policy_pool, tiny_model_dir, tmp_path, extra):
    """The distributed optimizer: at DP=2 one DistributedOptimizer shards every parameter (the experts too) over
    the DP group; at dp 2 x ep 2 a second one holds each rank's 4 experts (expert-data-parallel group of 1).
    One step is the single-process HF step with the same pre-clip norm (each expert counted once); its checkpoint
    (main weights and Adam moments gathered over DP, expert-DP and EP) loads in one process without it and takes
    the same next step."""
    path = tiny_model_dir("qwen3_moe")
    with megatron_policy(policy_pool, path, "dp2", **extra, **DISTOPT) as policy:
        check_train_parity(policy, path, make_batch(4, seed=1))
        ep = extra.get("megatron_cfg.expert_model_parallel_size", 1)
        assert_sharded_once(policy, path, [2, 1][:ep])
        check_checkpoint_resumes(policy, lambda: megatron_policy(policy_pool, path, "tp1", **ROUTER),
                                 make_batch(4, seed=3), str(tmp_path / "ckpt"))


def assert_sharded_once(policy, path: str, sizes: list[int], tp: int = 1, pp: int = 1) -> None:
    """Every worker's DistributedOptimizers (the dense one, then the experts') shard over groups of `sizes`, and
    every parameter element of the model has its fp32 main and optimizer state on exactly one rank of each TP
    group (the TP-replicated norms and routers on each of its tp ranks; the vocabulary's padding rows too; a
    tied embedding's copy on the last of pp stages too)."""
    shards = policy.group.run_all("__ray_call__", optimizer_shards)
    assert [[size for size, _ in rank] for rank in shards] == [sizes] * policy.group.world_size
    spec = model_spec(AutoConfig.from_pretrained(path), tp=tp)
    replicated = sum(math.prod(e.shape) for e in weights.entries(spec) if e.kind == "copy")
    padding = (spec.padded_vocab - spec.vocab) * spec.hidden * (1 if spec.tied else 2)
    stage_copy = spec.padded_vocab * spec.hidden if spec.tied and pp > 1 else 0
    total = sum(p.numel() for p in load_hf(path).parameters())
    assert sum(n for rank in shards for _, n in rank) == total + (tp - 1) * replicated + padding + stage_copy


def optimizer_shards(actor) -> list[tuple[int, int]]:
    """Per DistributedOptimizer of a policy rank: the size of the group it shards over and the elements of this rank's
    fp32 main shards."""
    return [(opt.data_parallel_group.size(), sum(main.numel() for group in opt.shard_fp32_groups
                                                 + opt.shard_fp32_from_float16_groups for main in group))
            for opt in actor.engine.dist_opt.optimizers]


TP2_SP = {"megatron_cfg.tensor_model_parallel_size": 2, "megatron_cfg.sequence_parallel": True}
# on 4 ranks with ep 2: overrides, and with the distributed optimizer the sizes of its (dense, expert) groups
ON_FOUR = {"dp4": ({}, None), "dp4_distopt": (DISTOPT, [4, 2]), "tp2_sp_ep2_distopt": ({**TP2_SP, **DISTOPT}, [2, 2]),
           "pp2_ep2_distopt": ({"megatron_cfg.pipeline_model_parallel_size": 2, **DISTOPT}, [2, 1]),
           "tp2_sp_pp2_ep2": ({**TP2_SP, "megatron_cfg.pipeline_model_parallel_size": 2}, None)}


@pytest.mark.parametrize("layout", list(ON_FOUR))
def test_ep2_on_four_ranks_sums_expert_gradients_over_expert_data_parallel(policy_pool, tiny_model_dir, layout):
    """ep 2 on 4 ranks, each expert on two of them (expert-data-parallel group of 2), whose gradients are summed
    over that group: at dp 4 the shared weights' over all 4; at tp 2 (sequence parallel) x dp 2 the TP peers
    hold different experts (expert TP 1), the shared weights' summed over TP then dp 2. At pp 2 x dp 2 each
    stage's layers' experts are split over its two ranks (the router losses pooled over the stages); at tp 2
    (sequence parallel) x pp 2, the 235B recipe's layout in small, over its two TP peers. Exported,
    the checkpoint; one step, the single-process step and norm. With the distributed optimizer the experts' main
    weights and Adam state are sharded over their expert-data-parallel group, the rest over the data-parallel
    group."""
    path = tiny_model_dir("qwen3_moe")
    overrides, sizes = ON_FOUR[layout]
    cfg = policy_config(path, backend="megatron", **EP2, **overrides)
    with policy_pool.policy(cfg, FOUR, path) as policy:
        assert policy.group.run_all("__ray_call__", local_experts) == [4] * 4
        assert max_diff(export_state(policy), load_hf(path).state_dict()) == 0.0
        check_train_parity(policy, path, make_batch(4, seed=2))  # one row per DP rank, one step
        if sizes:
            assert_sharded_once(policy, path, sizes, overrides.get("megatron_cfg.tensor_model_parallel_size", 1),
                                overrides.get("megatron_cfg.pipeline_model_parallel_size", 1))


RECOMPUTE = {"megatron_cfg.activation_checkpointing": True}
EP2_ONLY = {"megatron_cfg.expert_model_parallel_size": 2}


# micro-batches of the step (lengths 12 3 5 5): packed bins of 20 tokens [12 5 3] [5]; dynamic, 16 tokens at dp 2:
# rank 0 [12] [3], rank 1 [5 5] split in two, so that both ranks run as many forwards (the all-to-all pairs them)
@pytest.mark.parametrize("layout,extra,micro_batches", [("pp2", {**PACKING, **RECOMPUTE}, 2.0),
                                                        ("dp2", {**BUDGET, **EP2_ONLY}, 2.0)],
                         ids=["pp2_packing_recompute", "ep2_dynamic_batching"])
def test_packing_dynamic_batching_and_recompute(policy_pool, tiny_model_dir, layout, extra, micro_batches):
    """The options the MoE recipes train with: sequence packing (bins of several sequences, attention per
    sequence; the routers see each bin's tokens) and activation recomputation (the routers run again in the
    backward) at pp 2; dynamic batching at dp 2 x ep 2 (micro-batches of unequal rows, dispatched all-to-all).
    Log-probs are HF's on the padded rows, one step is the single-process HF step (router losses off: HF's
    reference takes a row per micro-batch, and recomputation refuses them)."""
    path = tiny_model_dir("qwen3_moe")
    with megatron_policy(policy_pool, path, layout, **extra) as p:
        batch = make_batch(4, seed=SEED, t=12)
        assert_logprobs_match_hf(p, path, batch)
        assert check_train_parity(p, path, batch)["micro_batches"] == micro_batches


@pytest.mark.parametrize("layout,extra", [("dp2", EP2), ("tp2_sp", ROUTER), ("pp2", ROUTER)],
                         ids=["ep2", "tp2_sp", "pp2"])
def test_routing_replay_routes_as_recorded(policy_pool, tiny_model_dir, layout, extra):
    """Routing replay (policy.megatron_cfg.moe_router_replay old_policy) at dp 2 x ep 2, and at TP=2 with sequence
    parallelism (each TP rank's router recording, and replaying, its share of the positions). get_logprobs records
    HF's top-k routes. One train call of two optimizer steps given those routes: without replay the second step's
    forward (moved weights) routes elsewhere (moe/routing_agreement < 1, equal to the router's own top-k
    agreement); with replay every position goes to its recorded experts (1.0) while the router's own top k
    still drifts. Replaying the routes the weights would choose anyway changes nothing (the same step as without
    replay); replaying other routes changes the step (the replay really dispatches)."""
    path = tiny_model_dir("qwen3_moe")
    batch, first = make_batch(8, seed=4), make_batch(4, seed=5)  # 8 rows: 2 optimizer steps of 4
    results = {}
    for replay in ("none", "old_policy"):
        with megatron_policy(policy_pool, path, layout, **extra, **{"megatron_cfg.moe_router_replay": replay}) as p:
            routes = check_routes_match_hf(p, path, batch)
            results[replay] = p.train(batch, TokenPGLoss(), columns={"routed_experts": routes})
            policy_pool.reset(p)
            one = {**first, "routed_experts": p.get_logprobs(first, return_routes=True)[1]}
            start = export_state(p)
            p.train(one, TokenPGLoss())
            results[replay + "/one step"] = export_state(p)
            if replay == "old_policy":
                policy_pool.reset(p)
                shifted = torch.where(one["routed_experts"] >= 0, (one["routed_experts"] + 3) % 8, -1)
                p.train({**one, "routed_experts": shifted.to(torch.int16)}, TokenPGLoss())
                assert max_diff(export_state(p), results["old_policy/one step"]) > 1e-3
    plain, replayed = results["none"], results["old_policy"]
    assert plain["moe/routing_agreement"] == plain["moe/router_topk_agreement"] < 0.95
    assert replayed["moe/routing_agreement"] == pytest.approx(1.0)
    assert replayed["moe/router_topk_agreement"] < 0.95
    # the parity tests' 1e-4 (measured 4.9e-6: the replayed experts come in another order, so the softmax over
    # their logits sums in another order, and Adam's lr 1e-2 step amplifies that rounding)
    assert max_diff(results["none/one step"], results["old_policy/one step"]) <= 1e-4
    assert max_diff(results["none/one step"], start) > 1e-3


@pytest.mark.parametrize("replay", ["old_policy", "engine"])
def test_grpo_replays_the_recorded_routes(ray_cluster, tiny_model_dir, tmp_path, replay):
    """Two GRPO steps of the default recipe on the tiny Qwen3-MoE, Megatron dp 2 with moe_router_replay old_policy
    (R2: the routes of the step's log-prob pass) or engine (R3: the torch engine's, recorded while it generated),
    two optimizer steps per GRPO step: each training forward routes as recorded (moe/routing_agreement 1.0, also
    after the first optimizer step), the router's own agreement is logged beside it, and refit keeps the engine
    on the policy's weights (token_mult_prob_error 1.0)."""
    path = tiny_model_dir("qwen3_moe")
    train_in_process(tmp_path, f"policy.model_name={path}", "policy.backend=megatron",
                     f"policy.megatron_cfg.moe_router_replay={replay}", "policy.generation.backend=torch",
                     "policy.train_global_batch_size=64", "grpo.max_num_steps=2", "grpo.val_at_start=false",
                     "grpo.val_period=0", "grpo.val_at_end=false", "checkpointing.enabled=false")
    train = read_metrics(f"{tmp_path}/logs", "train")
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["moe/routing_agreement"] == pytest.approx(1.0), r
        assert 0.0 < r["moe/router_topk_agreement"] <= 1.0, r
        assert r["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-3), r
