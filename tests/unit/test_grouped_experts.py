"""The Megatron back end's grouped-GEMM experts (backends/mcore/grouped_experts.py) against Megatron's own
SequentialMLP loop on the same module and weights, in one process without a process group (the expert
linears' TP group, which expert TP 1 makes a group of one, is a stand-in): forward and every gradient within
1e-6 in fp32, an expert with no tokens included, as the model's local experts (all, or experts / ep of them);
the loop only where grouped_mm's alignment rules fail. (Parity of the whole MoE model with HF is in
tests/functional/test_mcore_moe.py.)"""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.experts import SequentialMLP

from nemo_grpo.backends.mcore.grouped_experts import GroupedSequentialMLP

pytestmark = pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without grouped_mm")


class OneRank:
    """A process group's stand-in for Megatron's expert linears: size 1, so no collective runs."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


@pytest.fixture(autouse=True)
def tp_of_one(monkeypatch):
    """Without torch.distributed Megatron's linears drop their TP group (None), which its TP mappings refuse:
    they get the stand-in, a group of one (no collective)."""
    monkeypatch.setattr(mappings, "get_tensor_model_parallel_group_if_none", lambda group, *a, **k: OneRank())


def experts(local: int, hidden: int, ffn: int, dtype=torch.float32, **config) -> GroupedSequentialMLP:
    """`local` experts of a 4-expert MoE (local < 4: this rank's share under expert parallelism), random weights."""
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=2,
                            num_moe_experts=4, moe_ffn_hidden_size=ffn, moe_router_topk=config.pop("topk", 2),
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            bias_activation_fusion=False, gradient_accumulation_fusion=False, params_dtype=dtype,
                            use_cpu_initialization=True, perform_initialization=False, **config)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False).submodules.mlp.submodules.experts
    pg = type("Groups", (), dict(ep=OneRank(), expt_tp=OneRank(), expt_dp=OneRank()))()
    module = GroupedSequentialMLP(local, cfg, spec.submodules, pg_collection=pg)
    torch.manual_seed(0)
    for p in module.parameters():
        p.data.copy_(0.3 * torch.randn_like(p))
    return module


def run(module, forward, hidden, tokens_per_expert, probs):
    """forward's output [n, h] and the gradients (input, probs, every parameter) of a random output gradient."""
    hidden, probs = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out, bias = forward(module, hidden, tokens_per_expert, probs)
    assert bias is None
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype))
    return out.detach(), [hidden.grad, probs.grad] + [p.grad for p in module.parameters()]


def counting_grouped_mm(monkeypatch) -> list:
    calls = []
    real = F.grouped_mm

    def grouped_mm(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(F, "grouped_mm", grouped_mm)
    return calls


@pytest.mark.parametrize("local,tokens,config", [(4, [3, 0, 5, 2], {}), (2, [0, 7], {}), (1, [6], {}),
                                                 (4, [2, 4, 0, 3], dict(topk=1, moe_router_pre_softmax=True,
                                                                       moe_apply_probs_on_input=True))],
                         ids=["all-experts", "ep2-share", "one-expert", "probs-on-input"])
def test_grouped_matches_loop(monkeypatch, local, tokens, config):
    """Two grouped matmuls ran (no loop), and equal SequentialMLP's loop within 1e-6: output, the gradients of
    input, probs and each expert's fc1 [2*ffn, h] / fc2 [h, ffn] (an expert with no tokens: zero gradient)."""
    module = experts(local, hidden=16, ffn=8, **config)
    n = sum(tokens)
    hidden, probs, counts = torch.randn(n, 16), torch.rand(n), torch.tensor(tokens)
    calls = counting_grouped_mm(monkeypatch)
    out, grads = run(module, GroupedSequentialMLP.__call__, hidden, counts, probs)
    assert len(calls) == 2
    ref_out, ref_grads = run(module, SequentialMLP.forward, hidden, counts, probs)
    assert len(calls) == 2  # the loop calls no grouped_mm
    assert (out - ref_out).abs().max() <= 1e-6
    for g, ref in zip(grads, ref_grads, strict=True):
        assert g.shape == ref.shape and (g - ref).abs().max() <= 1e-6
    for i, count in enumerate(tokens):
        if count == 0:
            assert module.local_experts[i].linear_fc1.weight.grad.abs().max() == 0


@pytest.mark.parametrize("ffn,grouped", [(8, True), (6, False)], ids=["aligned", "unaligned-loop"])
def test_bf16_alignment(monkeypatch, ffn, grouped):
    """bf16: ffn 8 (16-byte rows) runs grouped, close to the loop; ffn 6 (12-byte rows, which grouped_mm
    refuses) runs SequentialMLP's loop."""
    module = experts(4, hidden=16, ffn=ffn, dtype=torch.bfloat16)
    tokens = torch.tensor([3, 0, 5, 2])
    hidden, probs = torch.randn(10, 16, dtype=torch.bfloat16), torch.rand(10)
    calls = counting_grouped_mm(monkeypatch)
    out, _ = run(module, GroupedSequentialMLP.__call__, hidden, tokens, probs)
    assert len(calls) == (2 if grouped else 0)
    ref, _ = run(module, SequentialMLP.forward, hidden, tokens, probs)
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
