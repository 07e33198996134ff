"""How a generate call's prompts are spread over the engine's replicas (generation/interface.py split_by_work),
and the per-request seeds that keep samples independent of the split."""

import torch

from nemo_grpo.generation.interface import request_seed, split_by_work
from nemo_grpo.generation.torch_engine import draw


def grpo_call(prompt_lengths: list[int], samples: int) -> list[list[int]]:
    """A GRPO call's prompts: `samples` copies of each prompt, one prompt per length."""
    return [list(range(100 * i, 100 * i + n)) for i, n in enumerate(prompt_lengths) for _ in range(samples)]


def test_each_group_goes_whole_to_one_replica_and_every_prompt_once():
    prompts = grpo_call([3, 9, 5, 7, 4, 6], samples=4)
    shares = split_by_work(prompts, 2, max_new_tokens=16)
    assert sorted(i for share in shares for i in share) == list(range(len(prompts)))
    for share in shares:
        assert share == sorted(share)
        groups = {tuple(prompts[i]) for i in share}
        assert sum(prompts.count(list(g)) for g in groups) == len(share)  # whole groups only
    assert [len(s) for s in shares] == [12, 12]


def test_groups_are_spread_by_expected_work_not_by_count():
    """One group of a long prompt weighs as much as four short ones: 1 group vs 4 groups."""
    prompts = grpo_call([400, 10, 10, 10, 10], samples=2)  # work: 400 + 2*50 = 500; 10 + 2*50 = 110 each
    shares = split_by_work(prompts, 2, max_new_tokens=50)
    assert shares == [[0, 1], list(range(2, 10))]
    by_count = split_by_work(grpo_call([400, 10, 10, 10, 10], samples=2), 2, max_new_tokens=1000)
    assert [len(s) for s in by_count] == [4, 6]  # decode-bound: two groups against three


def test_one_replica_runs_everything_and_more_replicas_than_groups_leave_some_idle():
    prompts = grpo_call([3, 5], samples=3)
    assert split_by_work(prompts, 1, 8) == [list(range(6))]
    shares = split_by_work(prompts, 4, 8)
    assert sorted(map(len, shares)) == [0, 0, 3, 3]
    assert split_by_work([], 2, 8) == [[], []]


def test_the_split_is_a_pure_function_of_the_call():
    prompts = grpo_call([5, 5, 8, 2, 5, 9, 1], samples=3)
    assert split_by_work(prompts, 3, 12) == split_by_work([list(p) for p in prompts], 3, 12)


def test_a_rows_draws_depend_only_on_its_own_request_seed():
    """The torch engine's sampling: row i draws from a generator seeded with request_seed(seed, index i), so a
    row draws the same tokens in any batch, beside any other rows."""
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(6, 40), -1)  # [B, V]

    def gens(indices):
        return [torch.Generator().manual_seed(request_seed(7, i)) for i in indices]

    together = draw(probs, gens(range(6)))
    apart = torch.cat([draw(probs[:2], gens([0, 1])), draw(probs[2:], gens(range(2, 6)))])
    reordered = draw(probs[[5, 0]], gens([5, 0]))
    assert together.tolist() == apart.tolist() and reordered.tolist() == together[[5, 0]].tolist()
    other_seed = [torch.Generator().manual_seed(request_seed(8, i)) for i in range(6)]
    assert draw(probs, other_seed).tolist() != together.tolist()
