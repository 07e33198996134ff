"""The LLM-judge environment with an in-cluster judge: one torch engine on a tiny random qwen2 model (fp32), started
once for the module and shared by an environment per mode (LlmJudgeEnvironment(judge=...)) and by the math
environment's judge fallback (MathEnvironment(..., judge=...)).

A random tied-embedding model decodes greedily by repeating the prompt's last token, so the templates end with the
sample text whose last character the judge should echo: a digit parses at the first (greedy) attempt, a letter
does not and is retried, sampled with new seeds, then given default_score. In every mode each reward is what the
parser makes of the judge's replies recorded in the sample's metadata, and each first reply is what Hugging Face
greedy decoding of the filled template gives: the judge's actual output.
"""

import pytest
import torch
from train_runs import read_metrics, train_in_process
from transformers import AutoModelForCausalLM

from nemo_grpo.config import JudgeGenerationConfig, LlmJudgeConfig
from nemo_grpo.data.prompts import render_prompt
from nemo_grpo.envs import judging
from nemo_grpo.envs.llm_judge_env import RECORD, LlmJudgeEnvironment
from nemo_grpo.models.tokenizer import load_tokenizer

MAX_NEW = 6
RETRIES = 2
DEFAULT = 0.25  # distinct from every score below
DIGIT = r"(\d)"  # the judge's score: the last digit of its reply


def judge_config(path: str, **overrides) -> LlmJudgeConfig:
    return LlmJudgeConfig(model_name=path, generation=JudgeGenerationConfig(backend="torch", max_new_tokens=MAX_NEW),
                          parse_retries=RETRIES, default_score=DEFAULT, **overrides)


@pytest.fixture(scope="module")
def judge_path(tiny_model_dir):
    return tiny_model_dir("qwen2", seed=0)


@pytest.fixture(scope="module")
def judge(ray_cluster, judge_path):
    from nemo_grpo.envs.judge_clients import EngineJudge

    engine_judge = EngineJudge(judge_config(judge_path))
    yield engine_judge
    engine_judge.shutdown()


@pytest.fixture(scope="module")
def hf_greedy(judge_path):
    """conversation -> the reply Hugging Face's greedy generate gives for it under the judge's chat template."""
    tokenizer, model = load_tokenizer(judge_path), AutoModelForCausalLM.from_pretrained(judge_path).eval()

    def reply(conversation) -> str:
        ids = render_prompt(tokenizer, conversation)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    return reply


def conversations(prompts_responses: list[tuple[str, str]]) -> list[list[dict]]:
    return [[{"role": "user", "content": p}, {"role": "assistant", "content": r}] for p, r in prompts_responses]


def step(env: LlmJudgeEnvironment, logs, references=None):
    infos = [{"ground_truth": ref, "keep": i} for i, ref in enumerate(references or [None] * len(logs))]
    ret = env.step(logs, infos)
    assert ret.terminateds.all() and [m["keep"] for m in ret.metadata] == list(range(len(logs)))  # env_info kept
    _, metrics = env.global_post_process_and_metrics({"rewards": ret.rewards})
    return ret.rewards.tolist(), [m[RECORD] for m in ret.metadata], metrics


def check_attempts(replies, parse) -> None:
    """Every reply but the last did not parse; the last parsed, or there were 1 + RETRIES of them."""
    assert 1 <= len(replies) <= 1 + RETRIES
    assert all(parse(r) is None for r in replies[:-1])
    assert parse(replies[-1]) is not None or len(replies) == 1 + RETRIES


def test_pointwise_rewards_are_the_parsed_scores_of_the_judges_replies(judge, judge_path, hf_greedy):
    template = "q {prompt} a {response}"
    cfg = judge_config(judge_path, score_regex=DIGIT, score_min=0, score_max=9)
    env = LlmJudgeEnvironment(cfg, template=template, judge=judge)
    logs = conversations([("1+2=", "3"), ("1+2=", "7"), ("2+2=", "ab"), ("2+2=", "4x")])
    rewards, records, metrics = step(env, logs)
    parse = lambda r: judging.parse_number(r, DIGIT)  # noqa: E731
    for log, reward, record in zip(logs, rewards, records):
        check_attempts(record["replies"], parse)
        score = parse(record["replies"][-1])
        assert record["score"] == score
        assert reward == pytest.approx(DEFAULT if score is None else judging.map_score(score, 0, 9))
        filled = template.format(prompt=log[0]["content"], response=log[1]["content"])
        assert record["replies"][0] == hf_greedy([{"role": "user", "content": filled}])
    assert records[0]["replies"] == ["333333"] and rewards[0] == pytest.approx(3 / 9)  # echoed: parsed at once
    assert all(len(r["replies"]) > 1 for r in records[2:])  # letters echoed: retried (sampled)
    retries = sum(len(r["replies"]) - 1 for r in records)
    assert metrics["llm_judge_env/retries"] == retries > 0
    assert metrics["llm_judge_env/judge_requests"] == len(logs) + retries
    assert metrics["llm_judge_env/parse_failures"] == sum(r["score"] is None for r in records)
    assert metrics["llm_judge_env/mean_score"] == pytest.approx(sum(rewards) / 4)
    assert metrics["llm_judge_env/seconds_per_call"] > 0

    never = LlmJudgeEnvironment(judge_config(judge_path, score_regex=r"#(\d)"), template=template, judge=judge)
    rewards, records, metrics = step(never, logs)  # '#' is not in the judge's vocabulary: nothing ever parses
    assert rewards == [DEFAULT] * 4 and all(len(r["replies"]) == 1 + RETRIES for r in records)
    assert (metrics["llm_judge_env/parse_failures"], metrics["llm_judge_env/retries"],
            metrics["llm_judge_env/judge_calls"]) == (4, 4 * RETRIES, 1 + RETRIES)


def test_pairwise_rewards_are_win_rates_of_the_judges_verdicts(judge, judge_path, hf_greedy):
    """Two groups (one per prompt) of 4 and 3; circular with both orders. The judge echoes the last character of
    response_2: 1 (the first wins), 2 (the second wins), 0 (a tie), else a retry."""
    template = "{prompt} {response_1} or {response_2}"
    env = LlmJudgeEnvironment(judge_config(judge_path, mode="pairwise", score_regex=DIGIT), template=template,
                              judge=judge)
    logs = conversations([("p", "a1"), ("p", "b2"), ("p", "c0"), ("p", "d7"), ("q", "x2"), ("q", "y1"), ("q", "zz")])
    rewards, records, metrics = step(env, logs)
    groups = [list(range(4)), [4, 5, 6]]
    assert [r["group_size"] for r in records] == [4] * 4 + [3] * 3
    agree = compared = 0
    for members in groups:
        judged = {}
        for i in members:
            for c in records[i]["comparisons"]:
                check_attempts(c["replies"], lambda r: judging.parse_verdict(r, DIGIT))
                assert c["verdict"] == judging.parse_verdict(c["replies"][-1], DIGIT)
                first, second = (logs[members[c["first"]]], logs[members[c["second"]]])
                filled = template.format(prompt=first[0]["content"], response_1=first[1]["content"],
                                         response_2=second[1]["content"])
                assert c["replies"][0] == hf_greedy([{"role": "user", "content": filled}])
                judged[(c["first"], c["second"])] = c["verdict"]
        assert sorted(judged) == sorted(judging.ordered_comparisons(len(members), "circular", swap=True))
        verdicts = [(a, b, v) for (a, b), v in judged.items()]
        expected = judging.win_rates(len(members), verdicts, DEFAULT)
        assert [rewards[i] for i in members] == pytest.approx(expected)
        a, n = judging.position_consistency(verdicts)
        agree, compared = agree + a, compared + n
    assert judged[(0, 1)] == judging.FIRST and judged[(1, 0)] == judging.SECOND  # "y1" then "x2" echoed
    assert metrics["llm_judge_env/position_consistency"] == pytest.approx(agree / compared)
    assert metrics["llm_judge_env/single_sample_groups"] == 0
    lone, _, lone_metrics = step(env, conversations([("r", "5")]))  # a group of one: nothing to compare
    assert lone == [DEFAULT] and lone_metrics["llm_judge_env/judge_calls"] == 0


def test_equivalence_asks_again_swapped_and_needs_both(judge, judge_path, hf_greedy):
    """The judge echoes the last character of {reference} (then, swapped, of the response): z is the equal label,
    q the not-equal one, anything else does not parse."""
    template = "{prompt} {response} {reference}"
    env = LlmJudgeEnvironment(judge_config(judge_path, mode="equivalence", judge_equal_label="zz",
                                           judge_not_equal_label="qq"), template=template, judge=judge)
    logs = conversations([("p", "5z"), ("p", "5q"), ("p", "5z"), ("p", "x")])
    references = ["az", "bz", "cq", "dk"]
    rewards, records, metrics = step(env, logs, references)
    parse = lambda r: judging.parse_equivalence(r, "zz", "qq")  # noqa: E731
    for log, ref, reward, record in zip(logs, references, rewards, records):
        check_attempts(record["replies"], parse)
        assert record["equal"] == parse(record["replies"][-1])
        assert record["replies"][0] == hf_greedy([{"role": "user", "content": f"p {log[1]['content']} {ref}"}])
        assert ("swap_replies" in record) == (record["equal"] is True)
        verdicts = [record["equal"], record.get("swap_equal", record["equal"])]
        assert reward == (DEFAULT if None in verdicts else float(all(verdicts)))
        if "swap_replies" in record:
            assert record["swap_replies"][0] == hf_greedy([{"role": "user",
                                                            "content": f"p {ref} {log[1]['content']}"}])
    assert [r["equal"] for r in records[:3]] == [True, True, False]  # the reference's last letter, echoed
    assert [r.get("swap_equal") for r in records[:2]] == [True, False] and rewards[:3] == [1.0, 0.0, 0.0]
    assert metrics["llm_judge_env/judge_requests"] == sum(
        len(r["replies"]) + len(r.get("swap_replies", [])) for r in records)


def test_the_math_judge_fallback_decides_what_math_verify_cannot_parse(judge, judge_path, hf_greedy):
    """env.math.judge_fallback with the module's judge engine, every answer math-verify decided in the agreement
    sample. The template ends with {response}: the judge echoes the answer's last character, z the equal label, q
    the not-equal one, anything else does not parse. Answers math-verify parsed keep its reward; the others get
    what the parser makes of the judge's recorded replies; the two identical unparsed answers are asked once."""
    from nemo_grpo.config import MathEnvConfig
    from nemo_grpo.envs.math_env import MathEnvironment

    template = "{prompt} {reference} {response}"
    cfg = judge_config(judge_path, mode="equivalence", judge_equal_label="zz", judge_not_equal_label="qq",
                       check_twice_swap=False)
    env = MathEnvironment(MathEnvConfig(num_workers=1, judge_fallback=True, judge_agreement_fraction=1.0), cfg,
                          template=template, judge=judge)
    answers = ["\\boxed{8} so z", "\\boxed{9} so z", "\\boxed{9}.q", "no idea z", "hmmq", "no idea z", "nothing k"]
    math_verify = [1.0, 0.0, 0.0]  # the first three parse; the rest have no answer
    try:
        ret = env.step(conversations([("p", a) for a in answers]), [{"ground_truth": "8", "keep": i} for i in
                                                                     range(len(answers))])
        rewards = ret.rewards.tolist()
        _, metrics = env.global_post_process_and_metrics({
            "rewards": ret.rewards, "num_generations_per_prompt": len(answers), "response_lengths": torch.ones(7),
            "truncated": torch.zeros(7, dtype=torch.bool)})
    finally:
        env.shutdown()
    assert [m["keep"] for m in ret.metadata] == list(range(7))
    records = [m[RECORD] for m in ret.metadata]
    parse = lambda r: judging.parse_equivalence(r, "zz", "qq")  # noqa: E731
    for answer, reward, record in zip(answers, rewards, records):
        check_attempts(record["replies"], parse)
        assert record["equal"] == parse(record["replies"][-1]) and record["reward"] == reward
        assert record["replies"][0] == hf_greedy([{"role": "user", "content": f"p 8 {answer}"}])
    assert rewards[:3] == math_verify and [r["purpose"] for r in records] == ["agreement"] * 3 + ["fallback"] * 4
    assert rewards[3:] == [DEFAULT if r["equal"] is None else float(r["equal"]) for r in records[3:]]
    assert [r["equal"] for r in records[:5]] == [True, True, False, True, False] and rewards[3:5] == [1.0, 0.0]
    asked = records[:5] + records[6:]  # the distinct questions
    assert metrics.pop("math/judge_seconds_per_call") > 0 and metrics == pytest.approx({
        "math/accuracy": sum(r > 0 for r in rewards) / 7, "math/pass@7": 1.0,
        "math/fraction_of_samples_properly_ended": 1.0, "math/mean_response_length": 1.0, "math/num_samples": 7.0,
        "math/judge_decided": sum(r["equal"] is not None for r in records[3:]),
        "math/judge_undecided": sum(r["equal"] is None for r in records[3:]),
        "math/judge_agreement_samples": 3.0, "math/judge_agreement": 2 / 3,
        "math/judge_calls": max(len(r["replies"]) for r in asked),
        "math/judge_requests": sum(len(r["replies"]) for r in asked),
        "math/judge_retries": sum(len(r["replies"]) - 1 for r in asked),
        "math/judge_parse_failures": sum(r["equal"] is None for r in asked),
        "math/judge_request_failures": 0.0, "math/judge_truncated_prompts": 0.0})


@pytest.mark.slow
def test_a_grpo_step_judged_through_build(ray_cluster, tiny_model_dir, judge_path, tmp_path):
    """data.train.env_name=llm_judge as a user runs it: build.py reads the template, reserves the judge's device
    (cluster.gpus_per_node 2: one for the policy, one for the judge) and starts the environment's own engine there;
    the step's rewards and llm_judge_env/ metrics come from it. The policy: a random tiny model (no warm start).
    (The one judge engine this module starts besides the shared one: this path is what the test is about.)"""
    template = tmp_path / "judge.txt"
    template.write_text("{prompt}{response}")
    train_in_process(
        tmp_path, f"policy.model_name={tiny_model_dir('qwen2', seed=1)}", "data.train.env_name=llm_judge",
        "data.validation=null", f"env.llm_judge.model_name={judge_path}",
        f"env.llm_judge.judge_prompt_template_fpath={template}", "env.llm_judge.generation.backend=torch",
        "env.llm_judge.generation.max_new_tokens=3", f"env.llm_judge.score_regex={DIGIT}", "env.llm_judge.score_max=9",
        "grpo.max_num_steps=1", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8", "policy.generation.backend=torch",
        "checkpointing.enabled=false", "grpo.val_at_start=false", "grpo.val_at_end=false")
    step = read_metrics(f"{tmp_path}/logs", "train")[0]
    assert step["llm_judge_env/num_samples"] == 16 and step["llm_judge_env/judge_calls"] >= 1
    assert step["llm_judge_env/judge_requests"] == 16 + step["llm_judge_env/retries"]
    assert step["reward"] == pytest.approx(step["llm_judge_env/mean_score"], abs=1e-6)
