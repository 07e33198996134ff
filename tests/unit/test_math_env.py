"""Math environment: equivalence, bounded scoring of adversarial output, how a batch is cut among the workers.
The Ray actor end to end: tests/functional/test_math_env_actor.py."""

import random
import signal
import threading
import time

import pytest

from nemo_grpo.envs.math_env import _chunks, check_answer, verify_answer

TIMEOUT_S = 1.0
SLACK_S = 3.0  # correctness bound on the wall time of one call, not a benchmark
MB = 1 << 20


def score(response, gold, timeout_s=TIMEOUT_S, max_answer_chars=2048):
    return verify_answer(response, gold, timeout_s, max_answer_chars)


def random_text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(map(chr, rng.choices(range(32, 0x3000), k=n)))


def binary_junk(n: int, seed: int = 0) -> str:
    return random.Random(seed).randbytes(n).decode("utf-8", errors="replace") + "\x00" * 64


# ------------------------------------------------------------------------------------------ verify_answer
@pytest.mark.parametrize("gold,response", [
    ("8", "8"),
    ("8", "3 + 5 = 8"),
    ("8", "The answer is \\boxed{8}."),
    ("0.5", "\\boxed{\\frac{1}{2}}"),
    ("0.5", "The answer is $\\boxed{1/2}$"),
    ("$\\frac{1}{2}$", "$\\boxed{0.5}$"),
    ("\\frac{1}{2}", "\\boxed{0.5}"),  # bare LaTeX gold
    ("2", "$x=2$"),
    ("$\\sqrt{2}$", "\\boxed{2^{1/2}}"),
    ("$(1,2)$", "\\boxed{(1, 2)}"),
    ("(1,2)", "so the point is $(1, 2)$"),  # bare tuple gold
])
def test_equivalent_forms_score_one(gold, response):
    assert score(response, gold)[0] == 1.0


@pytest.mark.parametrize("gold,response", [
    ("8", "9"),
    ("8", ""),
    ("2", "\\boxed{3}"),
    ("42", "no answer"),
    ("$(1,2)$", "\\boxed{(2, 1)}"),
    ("0.5", "\\boxed{\\frac{1}{3}}"),
    ("8", "8 then 9"),  # the last answer counts
])
def test_wrong_forms_score_zero(gold, response):
    assert score(response, gold)[0] == 0.0


def test_extracted_answer_is_reported():
    assert score("so \\boxed{8}", "8") == (1.0, "8")
    assert score("\\boxed{9}", "8") == (0.0, "9")
    assert score("no digits here", "8") == (0.0, None)


def test_only_the_tail_is_parsed():
    response = "\\boxed{8}" + " filler" * 20  # 149 chars; the answer sits in the first 9
    assert score(response, "8", max_answer_chars=len(response))[0] == 1.0
    assert score(response, "8", max_answer_chars=len(response) - 9)[0] == 0.0
    assert score("8", "8", max_answer_chars=0)[0] == 0.0


PATHOLOGICAL = {  # name -> builder, so that parametrizing builds none of the 1 MB strings
    "nested_frac": lambda: "\\frac{" * 5000,
    "nested_braces": lambda: "\\boxed{" + "{" * 100_000 + "8" + "}" * 100_000,
    "nested_sqrt": lambda: "$" + "\\sqrt{" * 3000 + "2" + "}" * 3000 + "$",
    "random_1mb": lambda: random_text(MB),
    "random_1mb_wrong_answer": lambda: random_text(MB, seed=1) + " The answer is \\boxed{9}",
    "binary_junk": lambda: binary_junk(64 * 1024),
    "nul_bytes": lambda: "\x00" * MB,
    "lone_surrogates": lambda: "\ud800\udfff" * 1000,
    "empty": lambda: "",
    "none": lambda: None,
    "bytes": lambda: b"\xff\xfe8\x00",
    "not_a_string": lambda: 12345,
    "huge_power": lambda: "\\boxed{9^{9^{9^{9}}}}",  # sympy would compute for minutes: the alarm must stop it
    "huge_factorial": lambda: "\\boxed{(10^{1000000})!}",
}


@pytest.mark.parametrize("name", list(PATHOLOGICAL))
def test_pathological_inputs_score_zero_in_time(name):
    response = PATHOLOGICAL[name]()
    start = time.monotonic()
    reward, _ = score(response, "8")
    elapsed = time.monotonic() - start
    assert reward == 0.0
    assert elapsed < TIMEOUT_S + SLACK_S, f"{name} took {elapsed:.1f} s"


def test_an_alarm_swallowed_by_a_bare_except_fires_again():
    """A library's bare `except:` (mpmath's convert) may swallow the alarm's _SampleTimeout; the alarm repeats, so
    the sample still stops (a single alarm left the suite computing (10^1000000)! for good, under load)."""
    from nemo_grpo.envs.math_env import _SampleTimeout, _time_limit

    start = time.monotonic()
    with pytest.raises(_SampleTimeout):
        with _time_limit(0.2):
            try:
                time.sleep(2)  # the first alarm lands here
            except:  # noqa: E722 -- what the library does
                pass
            while time.monotonic() - start < 5:  # pure-Python work: the repeated alarm interrupts it
                pass
    assert time.monotonic() - start < 0.2 + SLACK_S
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_the_alarm_interrupts_a_slow_sample_and_is_disarmed_after():
    before = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    assert score("\\boxed{9^{9^{9^{9}}}}", "8", timeout_s=0.3)[0] == 0.0
    assert time.monotonic() - start < 0.3 + SLACK_S
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before
    assert score("8", "8")[0] == 1.0  # and scoring still works after a timeout


def test_huge_input_with_the_right_answer_at_the_end_scores_one():
    assert score(random_text(MB, seed=2) + " so \\boxed{8}", "8")[0] == 1.0


def test_refuses_to_run_off_the_main_thread():
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_raises(lambda: score("8", "8"))))
    thread.start()
    thread.join()
    assert isinstance(errors[0], RuntimeError) and "main thread" in str(errors[0])


def _raises(fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        return e
    return None


# ------------------------------------------------------------------------------------------ the actor's chunks
@pytest.mark.parametrize("n_items,n_workers", [(0, 2), (1, 3), (4, 3), (7, 2), (128, 2)])
def test_chunks_are_contiguous_and_balanced(n_items, n_workers):
    chunks = _chunks(list(range(n_items)), n_workers)
    assert len(chunks) == n_workers
    assert sum(chunks, []) == list(range(n_items))
    assert max(map(len, chunks)) - min(map(len, chunks)) <= 1


def test_identical_pairs_are_verified_once_and_every_sample_gets_its_score():
    """A group's G samples often end alike: each distinct (reply tail, reference) pair goes to the verifiers once,
    and the scores come back to every sample in order."""
    from nemo_grpo.config import MathEnvConfig
    from nemo_grpo.envs.math_env import MathEnvironment

    env = MathEnvironment.__new__(MathEnvironment)  # its verifier actors replaced by verify_answer in-process
    env.cfg, env._workers, env._fallback, seen = MathEnvConfig(), ["verifier"], None, []

    def score_all(pairs):
        seen.extend(pairs)
        return [check_answer(r, g, 5.0, env.cfg.max_answer_chars) for r, g in pairs]

    env._score_all = score_all
    replies = ["\\boxed{7}", "7", "\\boxed{7}", "8", "\\boxed{7}", "7"]
    golds = ["7", "7", "7", "7", "8", "7"]
    out = env.step([[{"role": "assistant", "content": r}] for r in replies], [{"ground_truth": g} for g in golds])
    assert out.rewards.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert out.answers == ["7", "7", "7", "8", "7", "7"]
    assert sorted(seen) == sorted({("\\boxed{7}", "7"), ("7", "7"), ("8", "7"), ("\\boxed{7}", "8")})
