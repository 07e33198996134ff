"""backends/context_parallel.py without a process group: the load-balanced chunks, their reassembly, the masks, and
each rank's attention over the whole row's keys against plain causal attention."""

import pytest
import torch
import torch.nn.functional as F

from nemo_grpo.backends.batching import token_logprobs_from_logits
from nemo_grpo.backends.context_parallel import ContextGroup, ContextShard
from nemo_grpo.backends.model_inputs import model_inputs, split_context


def shards(width: int, cp: int, starts=None) -> list[ContextShard]:
    return [ContextShard(ContextGroup(cp, r), width, starts) for r in range(cp)]


def test_rank_r_holds_chunks_r_and_its_mirror():
    a, b = shards(16, 2)
    assert a.take(torch.arange(16), 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert b.take(torch.arange(16), 0).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert [s.spans() for s in shards(24, 3)] == [[(0, 4), (20, 24)], [(4, 8), (16, 20)], [(8, 12), (12, 16)]]


def test_take_then_assemble_is_the_row():
    x = torch.randn(3, 24, 5)
    parts = [s.take(x, 1) for s in shards(24, 3)]
    assert all(p.shape == (3, 8, 5) for p in parts)
    assert torch.equal(shards(24, 3)[0]._assemble(parts, 1), x)


def test_width_must_split_into_2cp_chunks():
    with pytest.raises(ValueError, match="multiple of 4 positions, got 10"):
        ContextShard(ContextGroup(2, 0), 10)


def test_pieces_cut_chunks_at_sequence_starts():
    starts = (0, 3, 7)
    assert shards(8, 2, starts)[0]._pieces() == [(0, 2, 0), (6, 7, 3), (7, 8, 7)]  # chunks 0 and 3
    assert shards(8, 2, starts)[1]._pieces() == [(2, 3, 0), (3, 4, 3), (4, 6, 3)]  # chunks 1 and 2
    assert shards(8, 2)[1]._pieces() == [(2, 4, 0), (4, 6, 0)]


class LocalShard(ContextShard):
    """A shard whose K/V gather reads the whole row from `full` (what the all-gather would assemble)."""
    full = None

    def gather_kv(self, x, dim):
        return self.full


@pytest.mark.parametrize("packed", [False, True])
def test_each_rank_attends_like_the_whole_row(packed):
    torch.manual_seed(0)
    width, cp, heads, groups, d = 24, 3, 4, 2, 8
    q, k, v = torch.randn(1, heads, width, d), torch.randn(1, groups, width, d), torch.randn(1, groups, width, d)
    segments = torch.tensor([0] * 7 + [1] * 11 + [2] * 6)
    allowed = torch.ones(width, width).tril().bool()
    if packed:
        allowed &= segments[:, None] == segments[None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)  # [1, heads, width, d]
    for r in range(cp):
        shard = LocalShard(ContextGroup(cp, r), width, (0, 7, 18) if packed else None)
        shard.full = torch.stack([k, v])
        got = shard.attend(shard.take(q, 2), shard.take(k, 2), shard.take(v, 2), d ** -0.5)
        assert torch.allclose(got, shard.take(want, 2), atol=1e-6)


def test_split_context_takes_ids_positions_and_next_tokens():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 0, 0]])
    mb = {"input_ids": ids, "input_lengths": torch.tensor([6, 4])}
    inputs = model_inputs(mb, packed=False, multiple=4)  # width 8
    local = split_context(inputs, ContextGroup(2, 1))  # chunks 1 and 2: positions 2..5
    assert local.input_ids.tolist() == [[3, 4, 5, 6], [9, 10, 0, 0]]
    assert local.position_ids.tolist() == [[2, 3, 4, 5]] * 2
    assert local.next_tokens.tolist() == [[4, 5, 6, 0], [10, 0, 0, 0]]  # position 5's next is column 6 (padding)
    assert local.width == 8 and local.attention_mask is None


def test_logprobs_from_next_match_the_shifted_form():
    torch.manual_seed(1)
    mb = {"input_ids": torch.randint(1, 9, (2, 6)), "input_lengths": torch.tensor([6, 3])}
    inputs = model_inputs(mb, packed=False)
    logits = torch.randn(2, 6, 9)
    next_lp = torch.log_softmax(logits, -1).gather(-1, inputs.next_tokens[..., None])[..., 0]
    assert torch.allclose(inputs.logprobs_from_next(next_lp),
                          token_logprobs_from_logits(logits, inputs.input_ids, inputs.token_mask))


def test_split_context_of_a_packed_row_keeps_its_sequence_starts():
    mb = {"input_ids": torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]]), "input_lengths": torch.tensor([3, 2])}
    local = split_context(model_inputs(mb, packed=True, multiple=8), ContextGroup(2, 0))  # row 1,2,3,4,5,pad x3
    assert local.context.starts == (0, 3, 5)  # the padding tail is a sequence of its own
    assert local.input_ids.tolist() == [[1, 2, 0, 0]] and local.position_ids.tolist() == [[0, 1, 1, 2]]
