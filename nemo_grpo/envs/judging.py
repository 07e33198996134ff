"""What an LLM judge is asked and what its replies mean: pure functions (no Ray, no engine), used by the LLM-judge
environment (envs/llm_judge_env.py) and by config validation.

- templates: a text file with placeholders `{prompt}`, `{response}`, `{reference}` (pointwise, equivalence) or
  `{response_1}`, `{response_2}` (pairwise); `{{name}}` is the literal text `{name}`; every other brace is literal
  (`\\boxed{}`, `\\frac{1}{2}`), so a rubric may show the judge LaTeX.
- replies: a number is the last `\\boxed{...}` holding one, or the last match of a configured regex, or the
  score of the configured label (score_labels: "negative" -> 10) that ends last in the reply; a pointwise
  score is mapped linearly from [score_min, score_max] to [0, 1] and clamped; a pairwise verdict is 1 (the first
  response shown is better), 2 (the second) or 0 (a tie); an equivalence verdict is the equal or not-equal label
  that ends last in the reply. Anything else does not parse (None). Judge output is untrusted input: parsing
  never raises.
- comparisons within a group of G samples: circular (i against i+1 mod G: G pairs; for G = 2 the one pair) or
  all_pairs (G(G-1)/2), each asked in both orders with check_twice_swap. A sample's reward is its win rate over
  the judgments it took part in: 1 a win, 0.5 a tie, 0 a loss, default_score where the judgment never parsed.
- retries: `judge_with_retries` asks again, sampled with a new seed, whatever did not parse.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

MODES = ("pointwise", "pairwise", "equivalence")
STRATEGIES = ("circular", "all_pairs")
# mode -> (placeholders a template must have, placeholders it may have)
PLACEHOLDERS = {
    "pointwise": (("response",), ("prompt", "reference")),
    "pairwise": (("response_1", "response_2"), ("prompt", "reference")),
    "equivalence": (("response", "reference"), ("prompt",)),
}
TIE, FIRST, SECOND = 0, 1, 2  # pairwise verdicts: the number the judge writes
_FIELD = re.compile(r"\{\{([A-Za-z_]\w*)\}\}|\{([A-Za-z_]\w*)\}")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
BOXED = "\\boxed{"

Message = dict[str, str]
# a judge: conversations (each a list of {"role", "content"}) and a seed (None: greedy decoding; else request i of
# the call samples with a seed derived from (seed, i)) -> one reply each, None where the request failed
Judge = Callable[[list[list[Message]], Optional[int]], list[Optional[str]]]


# ----------------------------------------------------------------------------------------------- templates
def template_fields(template: str) -> list[str]:
    """The placeholders of a template, in order of first appearance (escaped `{{name}}` excluded)."""
    names = [m.group(2) for m in _FIELD.finditer(template) if m.group(2)]
    return list(dict.fromkeys(names))


def template_problem(template: str, mode: str) -> Optional[str]:
    """What is wrong with a template for `mode` (a missing or unknown placeholder), None if nothing."""
    required, optional = PLACEHOLDERS[mode]
    fields = template_fields(template)
    missing = [name for name in required if name not in fields]
    if missing:
        return (f"has no {', '.join('{' + n + '}' for n in missing)}; mode {mode} needs "
                f"{', '.join('{' + n + '}' for n in required)}")
    unknown = [name for name in fields if name not in required + optional]
    if unknown:
        return (f"has an unknown placeholder {{{unknown[0]}}}; mode {mode} takes "
                f"{', '.join('{' + n + '}' for n in required + optional)} (write {{{{{unknown[0]}}}}} for the "
                "literal text)")
    return None


def fill_template(template: str, values: dict[str, str]) -> str:
    """The template with each `{name}` replaced by values[name] (inserted as it is: a value's own braces stay),
    `{{name}}` by the literal `{name}`."""
    def replace(m: re.Match) -> str:
        if m.group(1):
            return "{" + m.group(1) + "}"
        return values[m.group(2)] if m.group(2) in values else m.group(0)

    return _FIELD.sub(replace, template)


# ----------------------------------------------------------------------------------------------- replies
def last_boxed(text: str) -> Optional[str]:
    """The content of the last `\\boxed{...}` (braces balanced), None if there is none or it is not closed."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _as_number(text: Optional[str]) -> Optional[float]:
    """A finite number written as the whole of `text` (spaces around allowed), else None."""
    if text is None or not _NUMBER.fullmatch(text.strip()):
        return None
    value = float(text.strip())
    return value if math.isfinite(value) else None


def parse_number(reply: Optional[str], score_regex: Optional[str] = None) -> Optional[float]:
    """The number in a judge's reply: the last match of `score_regex` (its first group if it has groups), or the
    last `\\boxed{...}` when the regex is None; None when there is none or it is not a finite number."""
    if not reply:
        return None
    if score_regex is None:
        return _as_number(last_boxed(reply))
    matches = list(re.finditer(score_regex, reply))
    if not matches:
        return None
    last = matches[-1]
    return _as_number(last.group(1) if last.re.groups else last.group(0))


def map_score(value: float, score_min: float, score_max: float) -> float:
    """A judge's score on [score_min, score_max] as a reward in [0, 1] (linear; outside the range: clamped)."""
    return min(1.0, max(0.0, (value - score_min) / (score_max - score_min)))


def parse_verdict(reply: Optional[str], score_regex: Optional[str] = None) -> Optional[int]:
    """A pairwise verdict: FIRST (the reply's number is 1), SECOND (2) or TIE (0); None for any other reply."""
    value = parse_number(reply, score_regex)
    return int(value) if value in (TIE, FIRST, SECOND) else None


def parse_label(reply: Optional[str], labels: dict[str, Any], ignore_case: bool = False) -> Any:
    """The value of the label (a key of `labels`) that ends last in the reply (where one label ends another, as
    "equal" ends "not equal", the longer one); None when no label appears. ignore_case: "Negative" is "negative"."""
    if not reply:
        return None
    text = reply.lower() if ignore_case else reply
    ends = {}
    for label in labels:
        at = text.rfind(label.lower() if ignore_case else label)
        if at >= 0:
            ends[label] = (at + len(label), len(label))
    return labels[max(ends, key=ends.get)] if ends else None


def parse_equivalence(reply: Optional[str], equal_label: str, not_equal_label: str) -> Optional[bool]:
    """True / False for the equal / not-equal label that ends last in the reply (parse_label), None when neither
    appears."""
    return parse_label(reply, {equal_label: True, not_equal_label: False})


# ----------------------------------------------------------------------------------------------- comparisons
def pair_schedule(group_size: int, strategy: str) -> list[tuple[int, int]]:
    """The pairs (i, j) compared in a group of `group_size` samples: circular, (i, i+1 mod G) for each i (G pairs;
    G = 2: the single pair), or all_pairs, every i < j (G(G-1)/2). None for G < 2."""
    if group_size < 2:
        return []
    if strategy == "all_pairs":
        return [(i, j) for i in range(group_size) for j in range(i + 1, group_size)]
    if strategy != "circular":
        raise ValueError(f"unknown comparison_strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    if group_size == 2:
        return [(0, 1)]
    return [(i, (i + 1) % group_size) for i in range(group_size)]


def ordered_comparisons(group_size: int, strategy: str, swap: bool) -> list[tuple[int, int]]:
    """The (first shown, second shown) orders asked: each scheduled pair, then with `swap` each pair reversed."""
    pairs = pair_schedule(group_size, strategy)
    return pairs + [(j, i) for i, j in pairs] if swap else pairs


def win_rates(group_size: int, judged: Sequence[tuple[int, int, Optional[int]]], default_score: float) -> list[float]:
    """Each sample's reward [G] from judged (first, second, verdict or None) comparisons: the mean of its points
    (1 a win, 0.5 a tie, 0 a loss, default_score where the verdict is None); default_score if it took no part."""
    points: list[list[float]] = [[] for _ in range(group_size)]
    for first, second, verdict in judged:
        if verdict is None:
            a = b = default_score
        else:
            a, b = {FIRST: (1.0, 0.0), SECOND: (0.0, 1.0), TIE: (0.5, 0.5)}[verdict]
        points[first].append(a)
        points[second].append(b)
    return [sum(p) / len(p) if p else default_score for p in points]


def winner(first: int, second: int, verdict: int) -> Optional[int]:
    """The sample a verdict on (first, second) prefers; None for a tie."""
    return {FIRST: first, SECOND: second, TIE: None}[verdict]


def position_consistency(judged: Sequence[tuple[int, int, Optional[int]]]) -> tuple[int, int]:
    """(pairs whose two orders agree, pairs judged in both orders): over the pairs asked both ways with both
    verdicts parsed, how often the verdict (the winner, or a tie) survives swapping the order."""
    verdicts = {(a, b): v for a, b, v in judged if v is not None}
    agree = compared = 0
    for (a, b), v in verdicts.items():
        if a < b and (b, a) in verdicts:
            compared += 1
            agree += winner(a, b, v) == winner(b, a, verdicts[(b, a)])
    return agree, compared


# ----------------------------------------------------------------------------------------------- retries
@dataclass
class Judgment:
    """One question to the judge: its replies, first attempt first (None: the request failed), and the parsed
    value of the last reply (None: nothing parsed)."""
    replies: list[Optional[str]] = field(default_factory=list)
    value: Any = None

    @property
    def retries(self) -> int:
        return max(0, len(self.replies) - 1)


def judge_with_retries(conversations: list[list[Message]], judge: Judge, parse: Callable[[Optional[str]], Any],
                       retries: int, seeds: Callable[[int], Optional[int]]) -> tuple[list[Judgment], int]:
    """Ask `judge` every conversation; ask again (attempt k: seed seeds(k)) those whose reply did not parse, up to
    `retries` times. Returns (one Judgment per conversation, the judge calls made: one per attempt round)."""
    results = [Judgment() for _ in conversations]
    pending, calls = list(range(len(conversations))), 0
    for attempt in range(retries + 1):
        if not pending:
            break
        replies = judge([conversations[i] for i in pending], seeds(attempt))
        calls += 1
        for i, reply in zip(pending, replies, strict=True):
            results[i].replies.append(reply)
            results[i].value = parse(reply)
        pending = [i for i in pending if results[i].value is None]
    return results, calls
