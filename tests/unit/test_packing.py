"""Sequence packing primitives: the bin algorithms, the packed row (ids, positions, segments or block-diagonal
mask) and the way back to per-sequence rows, checked by hand and against a Hugging Face model run on the padded
rows; attention per segment (backends/varlen.py) against the dense mask."""

import pytest
import torch
import torch.nn.functional as F

from nemo_grpo.backends.batching import concatenative, first_fit_decreasing, token_logprobs_from_logits
from nemo_grpo.backends.model_inputs import model_inputs, natural_width
from nemo_grpo.backends import varlen
from nemo_grpo.backends.varlen import CALLS, packed_attention


def test_first_fit_decreasing_fills_the_first_bin_with_room():
    # longest first: 9 opens bin 0 (room 1), 7 bin 1 (room 3), 5 bin 2, 3 into bin 1, 2 into bin 2, 1 into bin 0
    assert first_fit_decreasing([3, 9, 1, 7, 5, 2], 10) == [[1, 2], [3, 0], [4, 5]]
    assert first_fit_decreasing([12, 4], 10) == [[0], [1]]  # longer than the budget: a bin of its own


def test_concatenative_keeps_row_order():
    assert concatenative([3, 9, 1, 7, 5, 2], 10) == [[0], [1, 2], [3], [4, 5]]


def test_packed_row_by_hand():
    batch = {"input_ids": torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]]), "input_lengths": torch.tensor([3, 2])}
    assert natural_width(batch, packed=True, multiple=4) == 8
    inp = model_inputs(batch, packed=True, multiple=4)
    assert inp.input_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert inp.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]  # the padding tail is a segment of its own
    assert inp.token_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    assert inp.cu_seqlens.tolist() == [0, 3, 5, 8] and inp.varlen and inp.attention_mask is None
    inp = model_inputs(batch, packed=True, multiple=4, dense_mask=True)
    assert inp.packed and not inp.varlen
    mask = inp.attention_mask[0, 0].int()
    assert mask[4].tolist() == [0, 0, 0, 1, 1, 0, 0, 0]  # the 2nd sequence's 2nd token sees only its sequence
    assert mask[7].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]  # no query row is all masked
    values = torch.arange(10.0, 18.0)[None]  # per-position values of the packed row
    assert inp.to_rows(values, 4).tolist() == [[0, 11, 12, 0], [0, 14, 0, 0]]  # column 0 and padding are 0
    assert inp.last_tokens(values).tolist() == [12, 14]


@pytest.mark.parametrize("packed", [True, False])
def test_per_token_data_goes_where_the_tokens_lie_and_back(packed):
    """from_rows puts each sequence's per-token data (e.g. recorded routes [b, T, L, k]) at its positions in the
    row(s) the model sees, `fill` elsewhere; to_rows with column_0 brings it back whole."""
    batch = {"input_ids": torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]]), "input_lengths": torch.tensor([3, 2])}
    inp = model_inputs(batch, packed=packed, multiple=4)
    routes = torch.arange(16).reshape(2, 4, 1, 2) * (torch.arange(4)[None, :, None, None] < 3 - torch.arange(2)[
        :, None, None, None])  # zeros past each sequence
    at = inp.from_rows(routes, fill=-1)
    first = at[..., 0, 0].tolist()
    assert first == ([[0, 2, 4, 8, 10, -1, -1, -1]] if packed else [[0, 2, 4, -1], [8, 10, -1, -1]])
    back = inp.to_rows(at, 4, column_0=True, fill=-1)
    real = torch.arange(4)[None, :] < batch["input_lengths"][:, None]
    assert torch.equal(back[real], routes[real]) and bool((back[~real] == -1).all())


def test_padded_inputs_by_hand():
    batch = {"input_ids": torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]]), "input_lengths": torch.tensor([3, 2])}
    inp = model_inputs(batch, packed=False, multiple=2)
    assert inp.input_ids.tolist() == [[5, 6, 7, 0], [8, 9, 0, 0]] and inp.position_ids is None
    assert inp.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert inp.last_tokens(inp.input_ids.float()).tolist() == [7, 9]


def test_packed_log_probs_equal_hf_on_padded_rows(tmp_path):
    """Every position of a packed row sees only its own sequence: HF on the packed row (4D mask, per-sequence
    positions) gives the padded rows' log-probs, and a gradient that flows back through to_rows."""
    from transformers import AutoModelForCausalLM

    from nemo_grpo.models.tiny import save_tiny_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(str(tmp_path / "m"), arch="llama"),
                                                 dtype=torch.float32)
    lengths = torch.tensor([9, 3, 6, 1])
    ids = torch.randint(3, 40, (4, 9)) * (torch.arange(9)[None] < lengths[:, None])
    batch = {"input_ids": ids, "input_lengths": lengths}
    outs = {}
    for packed in (False, True):
        inp = model_inputs(batch, packed=packed, multiple=8, dense_mask=True)
        logits = model(input_ids=inp.input_ids, attention_mask=inp.attention_mask,
                       position_ids=inp.position_ids).logits
        outs[packed] = inp.to_rows(token_logprobs_from_logits(logits, inp.input_ids, inp.token_mask), 9)
    torch.testing.assert_close(outs[True], outs[False], atol=1e-5, rtol=0)
    assert outs[True][1, 3:].abs().sum() == 0 and outs[True][1, 1:3].abs().min() > 0
    outs[True].sum().backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("heads,groups", [(4, 4), (6, 2)])
def test_attention_per_segment_equals_the_dense_mask(heads, groups):
    """packed_attention (GQA too) = SDPA over the row with its block-diagonal causal mask, forward and gradients."""
    torch.manual_seed(0)
    batch = {"input_ids": torch.zeros(4, 9, dtype=torch.long), "input_lengths": torch.tensor([9, 3, 6, 1])}
    dense, segs = model_inputs(batch, True, 8, dense_mask=True), model_inputs(batch, True, 8)  # 19 -> 24 columns
    q, k, v = (torch.randn(1, h, 24, 8, requires_grad=True) for h in (heads, groups, groups))
    calls = CALLS["sdpa_segments"]
    got = packed_attention(q, k, v, segs.cu_seqlens, scale=0.3)
    assert CALLS["sdpa_segments"] == calls + 1
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense.attention_mask, scale=0.3,
                                         enable_gqa=heads != groups)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad((got * g).sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad((ref * g).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="segments cover 19 of the row's 24 positions"):
        packed_attention(q, k, v, segs.cu_seqlens[:-1], scale=0.3)


def torch_210_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
    """torch 2.10's varlen_attn signature (no scale, no window, no GQA flag); never called here."""


def torch_211_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                          window_size=(-1, -1)):
    """torch 2.11's (the GPU machines'): no GQA flag, its kernel takes fewer K/V heads as they are."""


# options for q [10, 6, 64] and k [10, 2, 64] at scale 1/8, by the torch at hand
EXPECTED_OPTIONS = {"installed": {"window_size": (-1, 0), "enable_gqa": True, "scale": 0.125},  # torch 2.13
                    "torch_2_11": {"window_size": (-1, 0), "scale": 0.125},
                    "torch_2_10": {"is_causal": True}}


@pytest.mark.parametrize("signature", EXPECTED_OPTIONS)
def test_torch_varlen_kernel_is_asked_for_causal_attention_in_its_own_words(monkeypatch, signature):
    """The options backends/varlen.py gives torch's varlen kernel (it runs on CUDA only: tests/functional/test_gpu.py
    runs it): causal, GQA and the scale in the words of the torch at hand; a torch without `scale` takes only the
    default 1/sqrt(head_dim), any other is refused rather than silently ignored."""
    fake = {"torch_2_10": torch_210_varlen_attn, "torch_2_11": torch_211_varlen_attn}.get(signature)
    if fake is not None:
        monkeypatch.setattr(varlen, "varlen_attn", fake)
    elif varlen.varlen_attn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    varlen._torch_varlen_parameters.cache_clear()
    try:
        q, k = torch.zeros(10, 6, 64), torch.zeros(10, 2, 64)
        assert varlen._torch_varlen_options(q, k, 0.125) == EXPECTED_OPTIONS[signature]
        assert "enable_gqa" not in varlen._torch_varlen_options(q, q, 0.125)
        if signature == "torch_2_10":
            with pytest.raises(ValueError, match="no `scale`"):
                varlen._torch_varlen_options(q, k, 0.3)
    finally:
        varlen._torch_varlen_parameters.cache_clear()


def test_hf_varlen_attention_equals_the_dense_mask(tmp_path):
    """A Hugging Face model built with attn_implementation=VARLEN on a packed row (its boundaries as
    cu_seq_lens_q) gives the dense-mask SDPA model's log-probs and gradients, through the per-segment path."""
    from transformers import AutoModelForCausalLM

    from nemo_grpo.backends.dtensor.attention import VARLEN, varlen_kwargs
    from nemo_grpo.models.tiny import save_tiny_model

    torch.manual_seed(0)
    path = save_tiny_model(str(tmp_path / "m"), arch="llama")
    lengths = torch.tensor([9, 3, 6, 1])
    batch = {"input_ids": torch.randint(3, 40, (4, 9)) * (torch.arange(9)[None] < lengths[:, None]),
             "input_lengths": lengths}
    outs = {}
    for impl in ("sdpa", VARLEN):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl)
        inp = model_inputs(batch, packed=True, multiple=8, dense_mask=impl == "sdpa")
        calls = CALLS["sdpa_segments"]
        logits = model(input_ids=inp.input_ids, attention_mask=inp.attention_mask, position_ids=inp.position_ids,
                       **(varlen_kwargs(inp.cu_seqlens) if inp.varlen else {})).logits
        assert CALLS["sdpa_segments"] - calls == (model.config.num_hidden_layers if inp.varlen else 0)
        lp = inp.to_rows(token_logprobs_from_logits(logits, inp.input_ids, inp.token_mask), 9)  # [4, 9]
        lp.sum().backward()
        outs[impl] = lp.detach(), model.model.embed_tokens.weight.grad
    torch.testing.assert_close(outs[VARLEN][0], outs["sdpa"][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(outs[VARLEN][1], outs["sdpa"][1], atol=1e-5, rtol=0)
