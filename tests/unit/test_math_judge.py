"""The math environment's judge fallback (nemo_grpo/envs/math_judge.py) with a fake judge, a plain function: what
math-verify could not parse, what it decided and what timed out; which answers are asked and why; the rewards; one
ask per distinct question; the swapped second ask; the records and the metrics' arithmetic. (The judge engine's
own replies: tests/functional/test_llm_judge.py; bad configs: tests/unit/test_bad_input.py.)"""

import pytest
import torch

from nemo_grpo.config import LlmJudgeConfig, MathEnvConfig
from nemo_grpo.envs.judge_modes import RECORD
from nemo_grpo.envs.math_env import MathEnvironment, check_answer
from nemo_grpo.envs.math_judge import (AGREEMENT, FAILED, FALLBACK, UNPARSED, VERIFIED, JudgeFallback,
                                       in_agreement_sample, judge_purposes)

EQ, NE = "[[A=B]]", "[[A!=B]]"
TEMPLATE = "{reference}|{response}"


class FakeJudge:
    """Replies by the filled template (anything else: a reply that does not parse); keeps what it was asked."""

    def __init__(self, replies: dict[str, str]):
        self.replies, self.asked = replies, []

    def __call__(self, conversations, seed):
        contents = [c[-1]["content"] for c in conversations]
        self.asked.append((contents, seed))
        return [self.replies.get(c, "no verdict") for c in contents]


def fallback(replies, fraction=1.0, **cfg) -> tuple[JudgeFallback, FakeJudge]:
    fake = FakeJudge(replies)
    judge_cfg = LlmJudgeConfig(mode="equivalence", model_name="unused", parse_retries=1, default_score=0.25, **cfg)
    return JudgeFallback(judge_cfg, fraction, template=TEMPLATE, judge=fake), fake


def samples(*responses, reference="8"):
    return [{"prompt": "p", "response": r, "reference": reference} for r in responses]


def test_math_verify_says_whether_it_could_parse():
    assert check_answer("so \\boxed{8}", "8", 5.0, 2048) == (1.0, "8", VERIFIED)
    assert check_answer("\\boxed{9}", "8", 5.0, 2048) == (0.0, "9", VERIFIED)  # parsed, wrong
    assert check_answer("no idea", "8", 5.0, 2048) == (0.0, None, UNPARSED)  # nothing to parse
    assert check_answer("8", "", 5.0, 2048) == (0.0, "8", UNPARSED)  # no reference to compare with
    assert check_answer("\\boxed{9^{9^{9^{9}}}}", "8", 0.3, 2048) == (0.0, None, FAILED)  # the alarm


def test_the_agreement_sample_is_a_deterministic_nested_fraction_of_the_pairs():
    pairs = [(f"answer {i}", str(i % 7)) for i in range(2000)]
    chosen = {f: {p for p in pairs if in_agreement_sample(*p, f)} for f in (0.0, 0.1, 0.5, 1.0)}
    assert chosen[0.0] == set() and chosen[1.0] == set(pairs)
    assert chosen[0.1] < chosen[0.5] and 140 < len(chosen[0.1]) < 260 and 900 < len(chosen[0.5]) < 1100
    assert chosen[0.5] == {p for p in pairs if in_agreement_sample(*p, 0.5)}  # the same answers every time
    assert in_agreement_sample("\ud800 lone surrogate", "8", 1.0)  # any text hashes
    statuses = [UNPARSED, VERIFIED, FAILED, VERIFIED]
    assert judge_purposes(samples("a", "b", "c", "d"), statuses, 1.0) == [FALLBACK, AGREEMENT, None, AGREEMENT]
    assert judge_purposes(samples("a", "b", "c", "d"), statuses, 0.0) == [FALLBACK, None, None, None]


def test_unparsed_answers_get_the_judges_verdict_and_parsed_ones_keep_math_verifys():
    """Samples: two identical unparsed answers the judge calls equal, one it calls not equal, one it never
    answers; a verified right answer it agrees with, a verified wrong answer it calls equal; a timed out one."""
    judge, fake = fallback({"8|x z": EQ, "8|x q": NE, "8|\\boxed{8}": EQ, "8|\\boxed{9}": EQ},
                           check_twice_swap=False)
    batch = samples("x z", "x q", "x z", "x k", "\\boxed{8}", "\\boxed{9}", "\\boxed{9^9}")
    statuses = [UNPARSED] * 4 + [VERIFIED, VERIFIED, FAILED]
    rewards, records = judge.judge(batch, [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0], statuses)
    assert rewards == [1.0, 0.0, 1.0, 0.25, 1.0, 0.0, 0.0]
    assert fake.asked[0] == (["8|x z", "8|x q", "8|x k", "8|\\boxed{8}", "8|\\boxed{9}"], None)  # each once, greedy
    assert fake.asked[1][0] == ["8|x k"] and fake.asked[1][1] is not None and len(fake.asked) == 2  # one retry
    assert [r and r["purpose"] for r in records] == [FALLBACK] * 4 + [AGREEMENT, AGREEMENT, None]
    assert records[3] == {"replies": ["no verdict"] * 2, "equal": None, "purpose": FALLBACK, "judge_reward": 0.25,
                          "reward": 0.25}
    assert records[5] == {"replies": [EQ], "equal": True, "purpose": AGREEMENT, "judge_reward": 1.0, "reward": 0.0}
    metrics = judge.metrics()
    assert metrics.pop("judge_seconds_per_call") > 0
    assert metrics == {  # 2 rounds: the 5 questions, then the 1 that did not parse; a sample counted per answer
        "judge_decided": 3.0, "judge_undecided": 1.0, "judge_agreement_samples": 2.0, "judge_agreement": 0.5,
        "judge_calls": 2.0, "judge_requests": 6.0, "judge_retries": 1.0, "judge_parse_failures": 1.0,
        "judge_request_failures": 0.0, "judge_truncated_prompts": 0.0}
    assert judge.metrics()["judge_decided"] == 0.0  # counted since the previous call
    judge.judge(samples("\\boxed{7}"), [0.0], [VERIFIED])  # asked, no verdict: not an agreement sample
    metrics = judge.metrics()
    assert metrics["judge_agreement_samples"] == 0.0 and "judge_agreement" not in metrics


def test_an_equal_verdict_stands_only_if_the_swapped_ask_agrees():
    judge, fake = fallback({"8|x z": EQ, "x z|8": EQ, "8|y z": EQ, "y z|8": NE}, fraction=0.0)
    rewards, records = judge.judge(samples("x z", "y z", "\\boxed{8}"), [0.0, 0.0, 1.0],
                                   [UNPARSED, UNPARSED, VERIFIED])
    assert rewards == [1.0, 0.0, 1.0] and records[2] is None
    assert fake.asked[1][0] == ["x z|8", "y z|8"]
    assert records[1] == {"replies": [EQ], "equal": True, "swap_replies": [NE], "swap_equal": False,
                          "purpose": FALLBACK, "judge_reward": 0.0, "reward": 0.0}
    assert judge.metrics()["judge_decided"] == 2.0


def test_the_environment_records_the_judge_in_the_samples_metadata():
    """MathEnvironment.step with the fallback, its verifier actors replaced by check_answer in-process."""
    env = MathEnvironment.__new__(MathEnvironment)
    env.cfg, env._workers = MathEnvConfig(judge_fallback=True, judge_agreement_fraction=0.0), ["verifier"]
    env._fallback, _ = fallback({"8|no idea z": EQ}, fraction=0.0, check_twice_swap=False)
    env._score_all = lambda pairs: [check_answer(r, g, 5.0, env.cfg.max_answer_chars) for r, g in pairs]
    logs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": r}] for r in ("no idea z", "9")]
    out = env.step(logs, [{"ground_truth": "8", "id": i} for i in range(2)])
    assert out.rewards.tolist() == [1.0, 0.0] and out.answers == [None, "9"]
    assert [o["content"] for o in out.observations] == ["Environment: correct", "Environment: incorrect"]
    assert out.metadata[0] == {"ground_truth": "8", "id": 0, RECORD: {
        "replies": [EQ], "equal": True, "purpose": FALLBACK, "judge_reward": 1.0, "reward": 1.0}}
    assert out.metadata[1] == {"ground_truth": "8", "id": 1}
    batch = {"rewards": out.rewards, "num_generations_per_prompt": 2, "truncated": torch.zeros(2, dtype=torch.bool),
             "response_lengths": torch.ones(2)}
    _, metrics = env.global_post_process_and_metrics(batch)
    assert (metrics["math/accuracy"], metrics["math/judge_decided"], metrics["math/judge_calls"]) == (0.5, 1.0, 1.0)


def test_a_fallback_needs_an_equivalence_judge():
    with pytest.raises(ValueError, match="needs env.llm_judge"):
        MathEnvironment(MathEnvConfig(judge_fallback=True))
    with pytest.raises(ValueError, match="mode equivalence, not pointwise"):
        JudgeFallback(LlmJudgeConfig(model_name="unused"), 0.1, template="{response}", judge=FakeJudge({}))


def test_build_gives_the_math_environment_the_judge(tmp_path, monkeypatch):
    """build.py starts the math environment with what the LLM-judge environment gets (template read on the driver,
    threads, an HTTP judge's API key) and env.llm_judge itself, only with judge_fallback."""
    from nemo_grpo.build import env_judge_kwargs, judged
    from nemo_grpo.config import ClusterConfig, EnvConfig

    template = tmp_path / "equivalence.txt"
    template.write_text("{response} = {reference}?")
    monkeypatch.setenv("JUDGE_KEY", "secret")
    judge_cfg = LlmJudgeConfig(mode="equivalence", judge_prompt_template_fpath=str(template),
                               base_url="http://127.0.0.1:9/v1", model="judge", api_key_env="JUDGE_KEY")
    env = EnvConfig(math=MathEnvConfig(judge_fallback=True), llm_judge=judge_cfg)
    assert judged("math", env) and judged("llm_judge", env) and not judged("code", env)
    assert not judged("math", EnvConfig(llm_judge=judge_cfg))
    extra = env_judge_kwargs("math", env, ClusterConfig(num_threads_per_worker=3))
    assert extra == {"template": "{response} = {reference}?", "num_threads": 3, "judge_cfg": judge_cfg,
                     "api_key": "secret"}  # an argument: a runtime_env's variables show in Ray's dashboard
    assert "judge_cfg" not in env_judge_kwargs("llm_judge", env, ClusterConfig())
