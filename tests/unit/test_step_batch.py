"""StepBatch: its shapes checked (naming the field), the loss mask built once, what it ships, the normalizers
of a global batch; and the clipped loss taking advantages [b] exactly as the same advantage on every token."""

from dataclasses import replace

import pytest
import torch
from test_losses import PLAIN, _random_batch, _split_loss

from nemo_grpo.algorithms.losses import make_loss
from nemo_grpo.batch import StepBatch


def _batch(**extra) -> StepBatch:
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8], [5, 9, 0, 0]])
    token_mask = torch.tensor([[0.0, 1, 1, 0], [0, 0, 1, 1], [0, 1, 0, 0]])
    return StepBatch(ids, torch.tensor([3, 4, 2]), token_mask, torch.tensor([1.0, 0.0, 1.0]), **extra)


def test_loss_mask_is_built_once_and_shipped_with_the_rows():
    batch = _batch(generation_logprobs=torch.zeros(3, 4))
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0], [0, 0, 0, 0], [0, 1, 0, 0]]
    rows = batch.rows()
    assert set(rows) == {"input_ids", "input_lengths", "token_mask", "sample_mask", "loss_mask",
                         "generation_logprobs"}
    assert rows["loss_mask"] is batch.loss_mask and len(batch) == 3


def test_normalizers_count_a_global_batch():
    norms = _batch().normalizers(0, 2)
    assert norms["global_valid_seqs"].item() == 1.0  # row 1 filtered out
    assert norms["global_valid_toks"].item() == 2.0
    assert norms["global_input_toks"].item() == 7


@pytest.mark.parametrize("field, value, message", [
    ("sample_mask", torch.ones(2), "StepBatch.sample_mask: expected shape [3], got [2]"),
    ("generation_logprobs", torch.zeros(3, 5), "StepBatch.generation_logprobs: expected shape [3, 4]..., got [3, 5]"),
])
def test_a_wrong_shape_names_the_field(field, value, message):
    good = _batch()
    fields = {k: getattr(good, k) for k in ("input_ids", "input_lengths", "token_mask", "sample_mask")}
    with pytest.raises(ValueError) as err:
        StepBatch(**{**fields, field: value})
    assert str(err.value) == message


def test_of_a_dict_names_the_missing_keys_and_keeps_other_columns():
    with pytest.raises(KeyError, match=r"train: the batch lacks \['sample_mask'\]"):
        StepBatch.of({"input_ids": torch.zeros(2, 3), "input_lengths": torch.ones(2), "token_mask": torch.ones(2, 3)})
    b = _batch()
    step = StepBatch.of({**b.rows(), "advantages": torch.ones(3, 4), "text": ["a", "b", "c"], "tag": "not a row"})
    assert set(step.columns) == {"advantages", "text"} and torch.equal(step.loss_mask, b.loss_mask)


def test_sequence_advantages_are_the_same_advantage_on_every_token():
    logprobs, mb = _random_batch(seed=3)
    first = mb["token_mask"].argmax(-1)  # each row's first response token
    per_sequence = mb["advantages"][torch.arange(len(first)), first]  # [b]: _random_batch's A, one per row
    assert torch.equal(per_sequence[:, None] * mb["token_mask"], mb["advantages"])
    for token_level in (True, False):
        loss_fn = make_loss("clipped_pg", replace(PLAIN, token_level_loss=token_level))
        tokens = _split_loss(loss_fn, logprobs, mb, [(0, 3), (3, 8)])
        sequences = _split_loss(loss_fn, logprobs, {**mb, "advantages": per_sequence}, [(0, 3), (3, 8)])
        assert sequences[0] == tokens[0]
        torch.testing.assert_close(sequences[1], tokens[1], rtol=0, atol=0)
