"""The MoE router's losses and statistics (nemo_grpo/backends/router.py) against their references: HF's
`load_balancing_loss_func` (the definition both back ends use), Megatron's z-loss and, for one layer, its
switch load-balancing loss (k times smaller); the load imbalance by hand; the router-loss keys' errors."""

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func, z_loss_func
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from nemo_grpo.backends.router import (RouterLosses, expert_counts, load_balancing_loss, load_imbalance,
                                       routing_matches, validate_router_losses, z_loss)
from nemo_grpo.backends.registry import backend_spec
from nemo_grpo.config import PolicyConfig
from nemo_grpo.errors import ConfigError

torch.set_num_threads(1)
E, K = 8, 2


def _routing(layers: int, b: int = 3, t: int = 7, seed: int = 0):
    """Router logits [b * t, E] per layer and a right-padded attention mask [b, t] (rows of 7, 2 and 5 tokens)."""
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(b * t, E, generator=g) for _ in range(layers)]
    mask = (torch.arange(t)[None] < torch.tensor([7, 2, 5])[:, None]).long()
    return logits, mask


def test_load_balancing_loss_is_hfs_over_the_real_tokens():
    logits, mask = _routing(layers=2)
    ours = load_balancing_loss(logits, mask.reshape(-1).bool(), K)
    assert ours == pytest.approx(float(load_balancing_loss_func(tuple(logits), E, K, mask)), rel=1e-6)
    garbage = [x.clone() for x in logits]
    for x in garbage:
        x.view(3, 7, E)[1, 2:] = 50.0  # padding positions: any logits, same loss
    assert load_balancing_loss(garbage, mask.reshape(-1).bool(), K) == pytest.approx(float(ours), rel=1e-6)


def test_one_layer_is_k_times_megatrons_switch_loss():
    """The module docstring's claim: for one layer HF's loss is k x Megatron's (padding masked out of both)."""
    (logits,), mask = _routing(layers=1)
    real = mask.reshape(-1).bool()
    probs = torch.softmax(logits, -1) * real[:, None]
    counts = expert_counts([logits], real, K)[0]
    megatron = switch_load_balancing_loss_func(probs, counts, int(real.sum()), K, E, 1.0)
    assert load_balancing_loss([logits], real, K) == pytest.approx(K * float(megatron), rel=1e-6)


def test_z_loss_is_megatrons_summed_over_layers():
    logits, mask = _routing(layers=2)
    padding = ~mask.reshape(-1).bool()  # Megatron's padding_mask: True at padding
    expected = sum(float(z_loss_func(x, 1.0, padding_mask=padding)) for x in logits)
    assert z_loss(logits, ~padding) == pytest.approx(expected, rel=1e-6)


def test_counts_and_imbalance_by_hand():
    """3 real tokens and a padding one, 4 experts, top-1; layer 0: experts 0, 0, 1 (max 2 / mean 0.75), layer 1:
    experts 3, 2, 1 (1 / 0.75): the worst layer's 8/3."""
    big = torch.eye(4) * 10
    layer0 = torch.stack([big[0], big[0], big[1], big[2]])
    layer1 = torch.stack([big[3], big[2], big[1], big[2]])
    counts = expert_counts([layer0, layer1], torch.tensor([True, True, True, False]), 1)
    assert counts.tolist() == [[2, 1, 0, 0], [0, 1, 1, 1]]
    assert load_imbalance(counts) == pytest.approx(8 / 3)
    assert load_imbalance(torch.ones(2, 4)) == 1.0


def test_micro_batches_weigh_by_their_real_tokens():
    """Two micro-batches of one step: the terms are coeff x (n_mb / N) x loss_mb and sum to the step's value;
    the counts add up over them."""
    cfg = PolicyConfig(backend="megatron").megatron_cfg
    cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff = "aux_loss", 0.1, 0.01
    router = RouterLosses(cfg, K)
    parts, masks = zip(*(_routing(layers=2, seed=s) for s in (1, 2)))
    total = sum(int(m.sum()) for m in masks)
    router.start_step(total)
    module, expected, summed = torch.nn.Linear(1, 1), 0.0, 0.0
    for logits, mask in zip(parts, masks):
        router.recorder.record(module, torch.zeros(21, E))  # before start: not this forward's (a recompute)
        router.recorder.start()
        for x in logits:
            router.recorder.record(module, x)
        metrics = {}
        term = router.add(mask, metrics)
        summed += float(metrics["moe/aux_loss"])  # (as the worker sums a step's metrics)
        real = mask.reshape(-1).bool()
        share = float(real.sum()) / total
        aux, z = float(load_balancing_loss(logits, real, K)), float(z_loss(logits, real))
        assert float(term) == pytest.approx(share * (0.1 * aux + 0.01 * z), rel=1e-6)
        expected += share * aux
    assert summed == pytest.approx(expected, rel=1e-6)
    counts = sum(expert_counts(lg, m.reshape(-1).bool(), K) for lg, m in zip(parts, masks))
    assert router.step_metrics(None) == {"moe/load_imbalance": pytest.approx(load_imbalance(counts))}


@pytest.mark.parametrize("backend,overrides,key,message", [
    ("megatron", {"moe_router_load_balancing_type": "seq_aux_loss"}, "megatron_cfg.moe_router_load_balancing_type",
     "got 'seq_aux_loss'; allowed: none, aux_loss"),
    ("dtensor", {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": -0.1},
     "dtensor_cfg.moe_aux_loss_coeff", "must be a number >= 0, got -0.1"),
    ("megatron", {"moe_z_loss_coeff": -1.0}, "megatron_cfg.moe_z_loss_coeff", "must be a number >= 0 or null"),
    ("megatron", {"moe_aux_loss_coeff": 0.01}, "megatron_cfg.moe_aux_loss_coeff",
     "0.01 with moe_router_load_balancing_type 'none': the load-balancing loss is off"),
    ("megatron", {"moe_z_loss_coeff": 0.001, "activation_checkpointing": True},
     "megatron_cfg.activation_checkpointing", "not with a router loss"),
    ("dtensor", {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01,
                 "context_parallel_size": 2}, "dtensor_cfg.context_parallel_size", "2: not with a router loss")])
def test_router_loss_keys_are_checked(backend, overrides, key, message):
    p = PolicyConfig(backend=backend)
    for name, value in overrides.items():
        setattr(backend_spec(p.backend).cfg(p), name, value)
    with pytest.raises(ConfigError, match=f"config key 'policy.{key}': {message}"):
        validate_router_losses(p)
    validate_router_losses(PolicyConfig(backend=backend))  # the defaults pass


def test_routing_agreement_by_hand():
    """Three positions (the second padding, the third without recorded routes: neither counts), two layers, k = 2:
    the recorded sets {0, 1} / {4, 5} at the first position; layer 0 chose {1, 0} (2 of 2, order aside), layer 1
    {4, 3} (1 of 2), while the router's own top 2 were {0, 1} and {3, 5}."""
    recorded = torch.tensor([[[0, 1], [4, 5]], [[2, 3], [6, 7]], [[-1, -1], [-1, -1]]])  # [N, L, k]
    chosen = [torch.tensor([[1, 0], [2, 3], [0, 1]]), torch.tensor([[4, 3], [6, 7], [0, 1]])]  # per layer [N, k]
    real = torch.tensor([True, False, True])
    assert float(routing_matches(chosen, recorded, real)) == 3.0
    losses = RouterLosses(PolicyConfig().dtensor_cfg, top_k=2)
    losses.start_step(step_tokens=2)
    logits = [torch.tensor([[5.0, 4, 0, 0, 0, 0, 0, 0]] * 3), torch.tensor([[0.0, 0, 0, 9, 0, 8, 0, 0]] * 3)]
    losses.recorder.start()
    for x, c in zip(logits, chosen):
        module = torch.nn.Linear(1, 1)  # in training mode, as a router in a training forward
        losses.recorder.record(module, x)
        losses.recorder.record_routes(module, c)
    losses.add(real[None], {}, recorded=recorded[None])  # [r = 1, t = 3, L, k]
    metrics = losses.step_metrics(group=None)
    assert metrics["moe/routing_agreement"] == pytest.approx(3 / 4)  # of 1 position x 2 layers x k 2
    assert metrics["moe/router_topk_agreement"] == pytest.approx(3 / 4)
