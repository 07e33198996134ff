"""The LLM judge's pure parts (nemo_grpo/envs/judging.py), against hand computations: templates, reply parsing,
score mapping, comparison schedules, win rates with ties, position consistency and the retry bookkeeping. (Bad
env.llm_judge configs: tests/unit/test_bad_input.py.)"""

import pytest

from nemo_grpo.envs import judging
from nemo_grpo.envs.judging import FIRST, SECOND, TIE


# ----------------------------------------------------------------------------------------------- templates
def test_template_fields_and_fill_leave_other_braces_alone():
    t = "q: {prompt}\na: {response}\nref {reference}; write \\boxed{} or \\frac{1}{2}, literal {{response}}"
    assert judging.template_fields(t) == ["prompt", "response", "reference"]
    filled = judging.fill_template(t, {"prompt": "1+1", "response": "{prompt} 2", "reference": "2"})
    assert filled == "q: 1+1\na: {prompt} 2\nref 2; write \\boxed{} or \\frac{1}{2}, literal {response}"


@pytest.mark.parametrize("mode,template,problem", [
    ("pointwise", "{prompt} {reference}", "has no {response}; mode pointwise needs {response}"),
    ("pairwise", "{response_1} {response}", "has no {response_2}"),
    ("equivalence", "{response}", "has no {reference}"),
    ("pointwise", "{response} {question}", "unknown placeholder {question}"),
])
def test_template_problems(mode, template, problem):
    assert problem in judging.template_problem(template, mode)


@pytest.mark.parametrize("mode,template", [("pointwise", "{response}"),
                                           ("pairwise", "{prompt}{response_1}{response_2}"),
                                           ("equivalence", "{prompt}{response}{reference}")])
def test_good_templates(mode, template):
    assert judging.template_problem(template, mode) is None


# ----------------------------------------------------------------------------------------------- replies
@pytest.mark.parametrize("reply,regex,value", [
    ("score \\boxed{3} then \\boxed{7.5}", None, 7.5),  # the last boxed
    ("\\boxed{ -2 }", None, -2.0),
    ("\\boxed{\\frac{1}{2}}", None, None),  # boxed, but not a number
    ("\\boxed{7", None, None),  # never closed
    ("no box 7", None, None),
    ("\\boxed{nan}", None, None),
    ("\\boxed{1e999}", None, None),  # not finite
    ("", None, None),
    (None, None, None),
    ("score: 3 ... score: 8", r"score: (\d+)", 8.0),  # the last match, its group
    ("it is 4 then 5", r"\d", 5.0),  # no group: the whole match
    ("score: x", r"score: (\w)", None),
])
def test_parse_number(reply, regex, value):
    assert judging.parse_number(reply, regex) == value


def test_map_score_is_linear_and_clamped():
    assert judging.map_score(5, 0, 10) == 0.5
    assert judging.map_score(3, 1, 5) == 0.5
    assert judging.map_score(12, 0, 10) == 1.0 and judging.map_score(-1, 0, 10) == 0.0


@pytest.mark.parametrize("reply,verdict", [("\\boxed{1}", FIRST), ("\\boxed{2}", SECOND), ("\\boxed{0}", TIE),
                                           ("\\boxed{2.0}", SECOND), ("\\boxed{3}", None), ("\\boxed{1.5}", None),
                                           ("nothing", None)])
def test_parse_verdict(reply, verdict):
    assert judging.parse_verdict(reply) == verdict


@pytest.mark.parametrize("reply,verdict", [
    ("they match [[A=B]]", True), ("[[A!=B]]", False), ("[[A=B]] no wait [[A!=B]]", False),
    ("[[A!=B]] no wait [[A=B]]", True), ("undecided", None), (None, None)])
def test_parse_equivalence(reply, verdict):
    assert judging.parse_equivalence(reply, "[[A=B]]", "[[A!=B]]") is verdict


SENTIMENT = {"negative": 10.0, "positive": 0.0}


@pytest.mark.parametrize("reply,score", [
    ("The sentence is negative.", 10.0), ("Positive", 0.0), ("the sentence is positive, not negative", 10.0),
    ("NEGATIVE? no, POSITIVE", 0.0), ("the sentence is neutral", None), ("", None), (None, None)])
def test_parse_label_scores(reply, score):
    """A pointwise label's score: the label that ends last, case ignored (a 135M judge writes "Positive")."""
    assert judging.parse_label(reply, SENTIMENT, ignore_case=True) == score


def test_parse_label_keeps_case_unless_told():
    assert judging.parse_label("Negative", SENTIMENT) is None
    assert judging.parse_label("Negative", SENTIMENT, ignore_case=True) == 10.0


def test_equivalence_label_that_ends_the_other():
    """"equal" ends "not equal": both end at the same place, the longer label is the verdict."""
    assert judging.parse_equivalence("these are not equal", "equal", "not equal") is False
    assert judging.parse_equivalence("not equal? no: equal", "equal", "not equal") is True


# ----------------------------------------------------------------------------------------------- comparisons
def test_pair_schedules():
    assert judging.pair_schedule(4, "circular") == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert judging.pair_schedule(3, "all_pairs") == [(0, 1), (0, 2), (1, 2)]
    assert len(judging.pair_schedule(6, "all_pairs")) == 15 and len(judging.pair_schedule(6, "circular")) == 6
    assert judging.pair_schedule(2, "circular") == [(0, 1)]  # (1, 0) would be the same pair
    assert judging.pair_schedule(1, "circular") == [] == judging.pair_schedule(1, "all_pairs")
    assert judging.ordered_comparisons(3, "circular", swap=True) == [(0, 1), (1, 2), (2, 0), (1, 0), (2, 1), (0, 2)]
    with pytest.raises(ValueError, match="circular, all_pairs"):
        judging.pair_schedule(3, "swiss")


def test_win_rates_count_ties_half_and_failures_as_default():
    # G = 3: 0 beats 1 (both orders), 1 ties 2, 2 vs 0 unparsed in one order, 0 wins the other
    judged = [(0, 1, FIRST), (1, 0, SECOND), (1, 2, TIE), (2, 0, None), (0, 2, FIRST)]
    rates = judging.win_rates(3, judged, default_score=0.25)
    assert rates == pytest.approx([(1 + 1 + 0.25 + 1) / 4, (0 + 0 + 0.5) / 3, (0.5 + 0.25 + 0) / 3])
    assert judging.win_rates(1, [], 0.4) == [0.4]  # nothing to compare with


def test_position_consistency():
    judged = [(0, 1, FIRST), (1, 0, SECOND),  # 0 wins both ways: agree
              (1, 2, FIRST), (2, 1, FIRST),  # the first shown wins both times: a position bias, disagree
              (2, 0, TIE), (0, 2, TIE),  # a tie both ways: agree
              (0, 3, FIRST), (3, 0, None)]  # one order unparsed: not compared
    assert judging.position_consistency(judged) == (2, 3)


# ----------------------------------------------------------------------------------------------- retries
def test_judge_with_retries_asks_again_what_did_not_parse():
    """A scripted judge (the replies a real one might give, by call): 'a' parses at once, 'b' after a failed request
    and one retry, 'c' never within 2 retries. Retries are sampled with new seeds; the first call is greedy."""
    script = {"a": ["\\boxed{1}"], "b": [None, "\\boxed{2}"], "c": ["x", "y", "z"]}
    calls = []

    def judge(conversations, seed):
        calls.append(([c[0]["content"] for c in conversations], seed))
        return [script[c[0]["content"]][len(calls) - 1] for c in conversations]

    convs = [[{"role": "user", "content": k}] for k in "abc"]
    judged, n = judging.judge_with_retries(convs, judge, judging.parse_number, 2,
                                           lambda attempt: None if attempt == 0 else 100 + attempt)
    assert n == 3 and calls == [(["a", "b", "c"], None), (["b", "c"], 101), (["c"], 102)]
    assert [j.value for j in judged] == [1.0, 2.0, None]
    assert [j.retries for j in judged] == [0, 1, 2]
    assert judged[1].replies == [None, "\\boxed{2}"] and judged[2].replies == ["x", "y", "z"]
    assert judging.judge_with_retries([], judge, judging.parse_number, 2, lambda a: None) == ([], 0)
