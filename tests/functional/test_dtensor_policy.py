"""The DTensor back end through the Policy front: real Ray actors, gloo, two worker processes, nothing mocked.

Every layout is compared with a single-process Hugging Face model computed here with plain transformers:
FSDP2 (dp=2) and TP=2 (dp=1 x tp=2, FSDP2 on the dp axis: the 2-D mesh), for Qwen2, Qwen3 and Llama.
One Policy per layout lives for the tests of its class (class-scoped fixtures), so at most two worker
processes exist at a time. Tests inside a class run in file order: the parity checks against the weights
on disk come before the first training step.
"""

import os

import pytest
import torch
from policy_checks import (CLUSTER, TokenPGLoss, assert_logprobs_match_hf, assert_scores_match_hf, check_bf16_step,
                           check_on_policy_step, check_routes_match_hf, check_train_parity, export_state,
                           hf_logprobs, load_hf, make_batch, max_diff, policy_config)

from nemo_grpo.policy import Policy
from weight_io import export_weights


# ---------------------------------------------------------------------------------------------- FSDP2, dp=2
@pytest.fixture(scope="class")
def fsdp_qwen3(ray_cluster, tiny_model_dir):
    path = tiny_model_dir("qwen3")
    policy = Policy(policy_config(path), CLUSTER, path, init_reference=True)
    yield policy, path
    policy.shutdown()


class TestFSDP:
    """dp=2, qwen3, 2 micro-batches per rank per step, reference weights kept."""

    def test_logprobs_match_hf(self, fsdp_qwen3):
        policy, path = fsdp_qwen3
        batch = make_batch(5, seed=0)  # 5 rows over 2 ranks in chunks of 2: uneven split, several chunks
        lp = assert_logprobs_match_hf(policy, path, batch)
        assert (lp[:, 0] == 0).all() and (lp[1, 3:] == 0).all()

    def test_each_rank_reads_only_its_shards(self, fsdp_qwen3):
        """The model is built sharded (backends/dtensor/loading.py): each of the 2 FSDP ranks reads from the
        checkpoint only its half of every tensor. Over the ranks the elements read add up to the model's once
        (a full load on every rank, as from_pretrained did, reads it twice), and no rank's largest read is a
        whole tensor: it is half the largest tensor (here an MLP weight [F, H]; rows split over dp)."""
        policy, path = fsdp_qwen3
        reads = policy.group.run_all("__ray_call__", lambda actor: dict(actor.engine.checkpoint_reads))
        params = list(load_hf(path).parameters())  # (a tied lm_head counted once)
        assert sum(r["numel"] for r in reads) == sum(p.numel() for p in params)
        assert [r["largest"] for r in reads] == [max(p.numel() for p in params) // 2] * 2

    def test_process_groups_bind_the_interface_of_the_nodes_ray_address(self, fsdp_qwen3):
        """One-node cluster: the group's MASTER_ADDR is 127.0.0.1, so every rank binds lo (Ray's node address
        is this machine's own IP all the same); its TCP peers are loopback (the gloo mesh, the store) and that
        address (Ray's own connections), nothing else."""
        import ray

        policy, _ = fsdp_qwen3
        reports = policy.process_group_report()
        node_ip = ray.util.get_node_ip_address()
        assert len(reports) == 2
        for report in reports:
            assert (report["address"], report["interface"]) == (node_ip, "lo"), report
            assert "127.0.0.1" in report["peers"] and set(report["peers"]) <= {"127.0.0.1", node_ip}, report

    def test_export_weights_buckets(self, fsdp_qwen3):
        policy, path = fsdp_qwen3
        limit_mb = 0.05
        buckets = list(export_weights(policy, limit_mb))
        hf = load_hf(path).state_dict()  # tied embeddings: both names, as HF's state_dict has them
        assert len(buckets) > 3
        names = [n for b in buckets for n in b]
        assert len(names) == len(set(names)) and set(names) == set(hf)
        for b in buckets:
            assert len(b) == 1 or sum(t.numel() * t.element_size() for t in b.values()) <= limit_mb * 2**20
        merged = {k: v for b in buckets for k, v in b.items()}
        assert all(torch.equal(merged[k], hf[k]) for k in hf)

    def test_score_needs_scalar_head(self, fsdp_qwen3):
        with pytest.raises(RuntimeError, match="scalar head"):
            fsdp_qwen3[0].score(make_batch(2, seed=0))

    def test_train_matches_single_process(self, fsdp_qwen3):
        policy, path = fsdp_qwen3
        check_train_parity(policy, path, make_batch(8, seed=1))  # 2 optimizer steps, warm-up, clipping

    def test_on_policy_step_equals_the_separate_logprob_pass(self, fsdp_qwen3, tmp_path):
        policy, _ = fsdp_qwen3
        policy.save_checkpoint(str(tmp_path / "start"))
        check_on_policy_step(policy, lambda p: p.load_checkpoint(str(tmp_path / "start")), make_batch(4, seed=6))

    def test_train_needs_whole_global_batches(self, fsdp_qwen3):
        with pytest.raises(ValueError, match="train_global_batch_size"):
            fsdp_qwen3[0].train(make_batch(6, seed=1), TokenPGLoss())
        with pytest.raises(ValueError, match="an on-policy step is one"):  # the second step's weights are new
            fsdp_qwen3[0].train(make_batch(8, seed=1), TokenPGLoss(), on_policy=True)

    def test_reference_logprobs_are_initial_weights(self, fsdp_qwen3):
        policy, path = fsdp_qwen3
        policy.train(make_batch(8, seed=3), TokenPGLoss())  # trained whatever ran before (e.g. under -k)
        batch = make_batch(3, seed=2)
        with torch.no_grad():
            ref = hf_logprobs(load_hf(path).eval(), batch)
        assert (policy.get_logprobs(batch) - ref).abs().max().item() > 1e-3
        assert (policy.get_reference_logprobs(batch) - ref).abs().max().item() <= 1e-5
        assert (policy.get_logprobs(batch) - ref).abs().max().item() > 1e-3  # swapped back

    def test_checkpoint_round_trip(self, fsdp_qwen3, tmp_path):
        policy, _ = fsdp_qwen3
        batch = make_batch(4, seed=3)
        policy.save_checkpoint(str(tmp_path / "ckpt"))
        lp_saved, w_saved = policy.get_logprobs(batch), export_state(policy)
        m_after_save = policy.train(batch, TokenPGLoss())
        w_after_save = export_state(policy)
        assert max_diff(w_after_save, w_saved) > 1e-3
        policy.load_checkpoint(str(tmp_path / "ckpt"))
        assert torch.equal(policy.get_logprobs(batch), lp_saved)
        assert max_diff(export_state(policy), w_saved) == 0.0
        m_after_load = policy.train(batch, TokenPGLoss())  # AdamW moments and the schedule were restored
        assert max_diff(export_state(policy), w_after_save) == 0.0
        assert m_after_load == m_after_save

    def test_save_pretrained_loads_in_hf(self, fsdp_qwen3, tmp_path):
        policy, _ = fsdp_qwen3
        policy.save_pretrained(str(tmp_path / "hf"))
        model = load_hf(str(tmp_path / "hf")).eval()
        assert max_diff(model.state_dict(), export_state(policy)) == 0.0
        batch = make_batch(3, seed=4)
        with torch.no_grad():
            assert (hf_logprobs(model, batch) - policy.get_logprobs(batch)).abs().max().item() <= 1e-5
        assert os.path.isfile(tmp_path / "hf" / "tokenizer.json")


# ---------------------------------------------------------------------------------------------- TP=2 (2-D mesh)
@pytest.fixture(scope="class")
def tp_qwen3(ray_cluster, tiny_model_dir):
    path = tiny_model_dir("qwen3")
    cfg = policy_config(path, train_micro_batch_size=4, logprob_batch_size=3,
                        **{"dtensor_cfg.tensor_parallel_size": 2, "dtensor_cfg.activation_checkpointing": True})
    policy = Policy(cfg, CLUSTER, path)
    yield policy, path
    policy.shutdown()


class TestTensorParallel:
    """dp=1 x tp=2 with FSDP2 on the dp axis, qwen3 (q_norm/k_norm under TP), activation checkpointing on,
    one micro-batch per step."""

    def test_logprobs_match_hf(self, tp_qwen3):
        assert_logprobs_match_hf(*tp_qwen3, make_batch(7, seed=5))

    def test_train_matches_single_process(self, tp_qwen3, tmp_path):
        policy, path = tp_qwen3
        batch = make_batch(8, seed=6)
        initial = export_state(policy)
        policy.save_checkpoint(str(tmp_path / "step0"))  # before any step: must not touch the fresh optimizer
        first = check_train_parity(policy, path, batch)
        policy.load_checkpoint(str(tmp_path / "step0"))  # back to fresh weights, optimizer and warm-up
        assert max_diff(export_state(policy), initial) == 0.0
        assert check_train_parity(policy, path, batch) == first

    def test_reference_needs_init_reference(self, tp_qwen3):
        with pytest.raises(RuntimeError, match="init_reference"):
            tp_qwen3[0].get_reference_logprobs(make_batch(2, seed=0))


# ---------------------------------------------------------------------------------------------- other layouts
@pytest.mark.parametrize("arch,tp", [("qwen2", 1), ("qwen2", 2), ("llama", 2)])
def test_logprobs_match_hf_other_archs(ray_cluster, tiny_model_dir, arch, tp):
    path = tiny_model_dir(arch)
    with Policy(policy_config(path, **{"dtensor_cfg.tensor_parallel_size": tp}), CLUSTER, path) as policy:
        assert_logprobs_match_hf(policy, path, make_batch(5, seed=7))


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_moe_matches_hf(ray_cluster, tiny_model_dir, tp):
    """Qwen3-MoE (8 experts, top-2, renormalised top-k weights) under FSDP2 (dp=2), and with TP on attention
    (tp=2, the experts replicated): log-probs and one optimizer step as the single-process HF model's. One step:
    routing is discontinuous, so after a step the layouts' float differences (~1e-7) may flip a near-tied top-k
    choice and the second step's gradients part (at tp=2 the weights then differ by ~3e-4, at dp=2 they did
    not; routing replay, on Megatron, pins that down). The step's loss has the router losses (HF's
    load-balancing loss, the z-loss), its moe/ metrics are HF's (check_train_parity). The routes get_logprobs
    records are HF's top-k; the step, given them, routes every position as recorded (same weights)."""
    path = tiny_model_dir("qwen3_moe")
    router = {"dtensor_cfg.moe_router_load_balancing_type": "aux_loss", "dtensor_cfg.moe_aux_loss_coeff": 0.1,
              "dtensor_cfg.moe_z_loss_coeff": 0.01}
    with Policy(policy_config(path, **{"dtensor_cfg.tensor_parallel_size": tp}, **router), CLUSTER, path) as policy:
        assert_logprobs_match_hf(policy, path, make_batch(5, seed=7))
        batch = make_batch(4, seed=1)
        batch["routed_experts"] = check_routes_match_hf(policy, path, batch)
        metrics = check_train_parity(policy, path, batch)
        assert metrics["moe/routing_agreement"] == metrics["moe/router_topk_agreement"] == pytest.approx(1.0)


@pytest.mark.parametrize("tp", [1, 2])
def test_score_matches_sequence_classifier(ray_cluster, tiny_model_dir, tp):
    path = tiny_model_dir("qwen2", scalar_head=True)
    batch = make_batch(5, seed=8)  # no real token is the pad id, so HF's own pooling is the last real token
    cfg = policy_config(path, **{"dtensor_cfg.tensor_parallel_size": tp})
    with Policy(cfg, CLUSTER, path, scalar_head=True) as policy:
        assert_scores_match_hf(policy, path, batch)
        with pytest.raises(RuntimeError, match="scalar head"):
            policy.get_logprobs(batch)


def test_bf16_step_stays_close_to_fp32(ray_cluster, tiny_model_dir):
    path = tiny_model_dir("qwen2")
    with Policy(policy_config(path, precision="bfloat16"), CLUSTER, path) as policy:
        check_bf16_step(policy, path, make_batch(4, seed=9))
