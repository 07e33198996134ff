"""The LLM judge (env.llm_judge) with SmolLM2-135M-Instruct as judge, in its three modes, on SmolLM2's own answers:
what it costs per call and per sample, how often its replies parse, and how much its verdicts mean.

    python bench/llm_judge.py                 # vLLM, 8 review prompts x 4, 16 problems (14 min, 2 cores, load 11)
    python bench/llm_judge.py --backend torch # the torch engine for the judge and the sampler
    python bench/llm_judge.py --variants pointwise pairwise:review-n   # some rows only

1. Samples: SmolLM2-135M-Instruct (a generation engine, temperature 0.7, seeded) writes --group reviews (<= 48 new
   tokens) for each of --prompts held-out review prompts (nemo_grpo.data.reviews' heldout split), and one answer
   (<= 128 new tokens) to each of --problems word problems (nemo_grpo.data.word_problems' heldout split), scored
   by math-verify (math_env.check_answer); with --controls (default) two control answers per problem as well, the
   reference restated ("So the final answer is \\boxed{N}.", right) and off by 7 (wrong).
2. One judge (judge_clients.EngineJudge: the same model, frozen, greedy first attempts, 2 sampled retries at
   temperature 1.0, <= --judge-max-new-tokens) shared by an LlmJudgeEnvironment per variant (VARIANTS):
   - pointwise, on the reviews: the SmolLM2 judge recipe's template and score_labels
     (configs/grpo_smollm2_judge_cpu.yaml), a 0-10 score read as the reply's first number, and one in \\boxed{};
   - pairwise, within each prompt's reviews: which of two is more negative, answered "Review N" (the reply's
     opening one), a bare 1 or 2, or \\boxed{1} / \\boxed{2}; circular (and all_pairs once), both orders
     (check_twice_swap);
   - equivalence, on the answers and controls: Yes / No, correct / incorrect, or [[A=B]] / [[A!=B]] (the
     default labels), an "equal" asked again swapped (check_twice_swap).
   After one untimed warm-up call, each variant is one `step` over its samples; the figures are the
   environment's llm_judge_env/ metrics (seconds measured around the judge's calls, Ray included).
3. The table: judge requests, calls (attempt rounds), seconds per call and per 64 judged samples (with the ratio to
   the first row), retries, parse failures (judgments given default_score 0) of the judgments asked, those parsed
   at the first (greedy) attempt, the mean reward; pairwise: position consistency (pairs whose verdict survives
   swapping the order, of those parsed both ways) and how often the review shown first wins; equivalence:
   agreement with math-verify where it verified, and how often the final verdict is "equal" on SmolLM2's answers
   math-verify marks right, wrong or could not parse, and on the controls. Below it, each variant's most frequent
   first replies.
One torch thread per process.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import yaml  # noqa: E402
from timing import machine_line  # noqa: E402  (bench/timing.py)

MODEL = "builtin:smollm2-135m-instruct"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "configs", "grpo_smollm2_judge_cpu.yaml")


def recipe_judge() -> tuple[str, dict[str, float]]:
    """The SmolLM2 judge recipe's template text and score_labels, read from the recipe (not a copy that drifts)."""
    with open(RECIPE, encoding="utf-8") as f:
        judge = yaml.safe_load(f)["env"]["llm_judge"]
    with open(os.path.join(ROOT, judge["judge_prompt_template_fpath"]), encoding="utf-8") as f:
        return f.read(), {label: float(score) for label, score in judge["score_labels"].items()}


REVIEW_TEMPLATE, REVIEW_LABELS = recipe_judge()
SCALE = "How negative is the following review, from 0 (not negative at all) to 10 (very negative)? "
BOXED_SCORE = SCALE + "Write only the number, inside \\boxed{}.\n\nReview: {response}"
NUMBER_SCORE = SCALE + "Answer with the number only.\n\nReview: {response}"
TWO_REVIEWS = "Review 1: {response_1}\n\nReview 2: {response_2}"
PAIR_REVIEW_N = ("Which of these two reviews is more negative?\n\n" + TWO_REVIEWS
                 + "\n\nAnswer with \"Review 1\" or \"Review 2\".")
PAIR_NUMBER = TWO_REVIEWS + "\n\nWhich review is more negative, 1 or 2? Answer with the number only."
PAIR_BOXED = ("Which of these two reviews is more negative?\n\n" + TWO_REVIEWS
              + "\n\nAnswer \\boxed{1} if review 1 is more negative, \\boxed{2} if review 2 is.")
SOLUTION = "Reference answer: {reference}\n\nA student's solution: {response}\n\n"
EQUAL_YES_NO = SOLUTION + "Is the student's final answer the same number as the reference answer? Answer Yes or No."
EQUAL_CORRECT = ("The correct answer is {reference}.\n\nAnswer: {response}\n\nIs this answer correct or incorrect? "
                 "Answer with one word.")
EQUAL_BRACKETS = SOLUTION + ("Is the student's final answer the same number as the reference answer? Answer [[A=B]] if "
                             "it is, [[A!=B]] if it is not.")
FIRST_NUMBER = r"^\D*(\d+)"  # the reply's first number (a later one is prose: "0 (not negative at all) to 10")
FIRST_REVIEW_N = r"^\W*Review ([12])"  # the reply's opening "Review N" (a later "Review M" is prose)
# name -> (mode, template, LlmJudgeConfig keys)
VARIANTS = {
    "pointwise": ("pointwise", REVIEW_TEMPLATE, {"score_labels": REVIEW_LABELS}),
    "pointwise:number": ("pointwise", NUMBER_SCORE, {"score_regex": FIRST_NUMBER}),
    "pointwise:boxed": ("pointwise", BOXED_SCORE, {}),
    "pairwise:review-n": ("pairwise", PAIR_REVIEW_N, {"score_regex": FIRST_REVIEW_N}),
    "pairwise:review-n/all": ("pairwise", PAIR_REVIEW_N, {"score_regex": FIRST_REVIEW_N,
                                                          "comparison_strategy": "all_pairs"}),
    "pairwise:number": ("pairwise", PAIR_NUMBER, {"score_regex": r"^\D*([12])"}),
    "pairwise:boxed": ("pairwise", PAIR_BOXED, {}),
    "equivalence:yes-no": ("equivalence", EQUAL_YES_NO, {"judge_equal_label": "Yes", "judge_not_equal_label": "No"}),
    "equivalence:correct": ("equivalence", EQUAL_CORRECT, {"judge_equal_label": "correct",
                                                           "judge_not_equal_label": "incorrect"}),
    "equivalence:[[A=B]]": ("equivalence", EQUAL_BRACKETS, {}),
}
CONTROL = "So the final answer is \\boxed{{{}}}."  # a control answer: the reference restated, or the reference + 7


# ----------------------------------------------------------------------------------------------- samples
def held_out(args) -> tuple[list[str], list[dict]]:
    """The first --prompts held-out review instructions and --problems held-out word problems, as
    `python -m nemo_grpo.data.reviews` and `... word_problems` write them (their default sizes, seed 0)."""
    from nemo_grpo.data import reviews, word_problems

    def read(path: str) -> list[dict]:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    with tempfile.TemporaryDirectory(prefix="bench_judge_data_") as out:
        _, review_path = reviews.write_splits(os.path.join(out, "reviews"), 480, 64, 0)
        _, problem_path = word_problems.write_splits(os.path.join(out, "arith"), 4000, 200, 0)
        return [r["input"] for r in read(review_path)[: args.prompts]], read(problem_path)[: args.problems]


def sample(path: str, args, instructions: list[str], problems: list[dict]) -> tuple[list[str], list[str], float]:
    """SmolLM2's reviews (--group per instruction, in groups) and answers (one per problem), and the seconds."""
    from nemo_grpo.config import ClusterConfig, GenerationConfig
    from nemo_grpo.data.prompts import render_prompt
    from nemo_grpo.generation import make_generation_engine
    from nemo_grpo.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)

    def prompts(texts: list[str]) -> list[list[int]]:
        return [render_prompt(tokenizer, [{"role": "user", "content": t}]) for t in texts]

    gen = GenerationConfig(backend=args.backend, max_new_tokens=48, temperature=0.7)
    start = time.perf_counter()
    engine = make_generation_engine(gen, path, ClusterConfig(gpus_per_node=1, num_nodes=1, num_threads_per_worker=1),
                                    precision="auto")
    try:
        written = engine.generate(prompts([t for t in instructions for _ in range(args.group)]), seed=args.seed)
        answered = engine.generate(prompts([p["input"] for p in problems]), seed=args.seed + 1, max_new_tokens=128)
    finally:
        engine.shutdown()

    def decode(outs) -> list[str]:
        return [tokenizer.decode(o.token_ids, skip_special_tokens=True).strip() for o in outs]

    return decode(written), decode(answered), time.perf_counter() - start


def conversations(prompts: list[str], responses: list[str]) -> list[list[dict]]:
    return [[{"role": "user", "content": p}, {"role": "assistant", "content": r}] for p, r in zip(prompts, responses)]


# ----------------------------------------------------------------------------------------------- judging
def judge_config(args, mode: str = "pointwise", **keys):
    from nemo_grpo.config import JudgeGenerationConfig, LlmJudgeConfig

    gen = JudgeGenerationConfig(backend=args.backend, max_new_tokens=args.judge_max_new_tokens, temperature=1.0)
    return LlmJudgeConfig(mode=mode, model_name=MODEL, generation=gen, parse_retries=2, default_score=0.0, **keys)


def warm_up(judge, texts: list[str]) -> None:
    """One untimed call of the judge, on prompts unlike every variant's (a prefix cache keeps nothing they use)."""
    judge([[{"role": "user", "content": f"Is this sentence hard to read? Answer with one word.\n\n{t}"}]
           for t in texts], None)


def run_variant(name: str, judge, args, samples: dict) -> dict:
    """One step of an LlmJudgeEnvironment of variant `name` over its samples: its metrics and records."""
    from nemo_grpo.envs.llm_judge_env import RECORD, LlmJudgeEnvironment

    mode, template, keys = VARIANTS[name]
    env = LlmJudgeEnvironment(judge_config(args, mode, **keys), template=template, judge=judge)
    logs, infos = samples["problems" if mode == "equivalence" else "reviews"]
    ret = env.step(logs, infos)
    _, metrics = env.global_post_process_and_metrics({"rewards": ret.rewards})
    env.shutdown()  # the shared judge stays up: its owner is main()
    records = [m[RECORD] for m in ret.metadata]
    metrics = {k.split("/", 1)[1]: v for k, v in metrics.items()}
    metrics["seconds"] = metrics.get("seconds_per_call", 0.0) * metrics["judge_calls"]
    return {"name": name, "mode": mode, "samples": len(logs), "metrics": metrics, "records": records,
            "judgments": judgments(mode, records)}


def judgments(mode: str, records: list[dict]) -> list[tuple[list, bool]]:
    """(replies, parsed) of every question the judge was asked (a pairwise comparison once, not per side)."""
    if mode == "pointwise":
        return [(r["replies"], r["score"] is not None) for r in records]
    if mode == "equivalence":
        return ([(r["replies"], r["equal"] is not None) for r in records]
                + [(r["swap_replies"], r["swap_equal"] is not None) for r in records if "swap_replies" in r])
    return [(c["replies"], c["verdict"] is not None) for _, c in sorted(comparisons(records).items())]


def comparisons(records: list[dict]) -> dict[tuple[int, int, int], dict]:
    """Pairwise: (group's first sample, first shown, second shown) -> the comparison's record."""
    out = {}
    for i, r in enumerate(records):
        for c in r["comparisons"]:
            out[(i - r["group_index"], c["first"], c["second"])] = c
    return out


# ----------------------------------------------------------------------------------------------- figures
def pairwise_notes(records: list[dict]) -> str:
    """Position consistency over the pairs parsed in both orders, and how often the first-shown review wins."""
    from nemo_grpo.envs import judging

    groups: dict[int, list] = collections.defaultdict(list)
    for (group, first, second), c in comparisons(records).items():
        groups[group].append((first, second, c["verdict"]))
    agree = compared = 0
    for judged in groups.values():
        a, n = judging.position_consistency(judged)
        agree, compared = agree + a, compared + n
    verdicts = [v for judged in groups.values() for _, _, v in judged if v is not None]
    consistency = f"{agree / compared:.2f} of {compared} pairs" if compared else "- (no pair parsed both ways)"
    first = f"{verdicts.count(judging.FIRST) / len(verdicts):.2f}" if verdicts else "-"
    return f"position consistency {consistency}; first shown wins {first}"


def equivalence_notes(records: list[dict], verified: list[tuple[float, str, str]]) -> str:
    """Agreement with math-verify where it verified and the judge decided; the judge's final "equal" rate on
    SmolLM2's answers math-verify marks right, wrong, and could not parse, and on the two controls."""
    from nemo_grpo.envs.judge_modes import equivalence_verdict
    from nemo_grpo.envs.math_judge import VERIFIED

    verdicts = [equivalence_verdict(r) for r in records]
    pairs = [(v, mv == 1.0) for v, (mv, status, _) in zip(verdicts, verified) if status == VERIFIED and v is not None]
    agree = f"{sum(v == right for v, right in pairs) / len(pairs):.2f} of {len(pairs)}" if pairs else "- of 0"
    rates = []
    for label, keep in (("right", lambda mv, s, k: k == "answer" and mv == 1.0),
                        ("wrong", lambda mv, s, k: k == "answer" and s == VERIFIED and mv == 0.0),
                        ("unparsed", lambda mv, s, k: k == "answer" and s != VERIFIED),
                        ("restated", lambda mv, s, k: k == "restated"), ("+7", lambda mv, s, k: k == "+7")):
        chosen = [v is True for v, info in zip(verdicts, verified) if keep(*info)]
        rates.append(f"{label} {sum(chosen)}/{len(chosen)}")
    return f"agrees with math-verify {agree}; says equal on {', '.join(rates)}"


def print_table(rows: list[dict], verified: list[tuple[float, str, str]]) -> None:
    head = (f"{'variant':22s} {'n':>3s} {'requests':>8s} {'calls':>5s} {'s/call':>7s} {'s/64 samples':>12s} "
            f"{'vs row 1':>8s} {'retries':>7s} {'parse fail':>10s} {'parsed 1st':>10s} {'reward':>6s}")
    print(head)
    base = None
    for r in rows:
        m, judged = r["metrics"], r["judgments"]
        per64 = m["seconds"] / r["samples"] * 64
        base = base or per64
        first = sum(len(replies) == 1 and ok for replies, ok in judged) / max(1, len(judged))
        print(f"{r['name']:22s} {r['samples']:3d} {m['judge_requests']:8.0f} {m['judge_calls']:5.0f} "
              f"{m.get('seconds_per_call', 0.0):7.2f} {per64:12.2f} {per64 / base:7.2f}x {m['retries']:7.0f} "
              f"{m['parse_failures']:3.0f} of {len(judged):<3d} {first:10.2f} {m['mean_score']:6.3f}")
    print()
    for r in rows:
        if r["mode"] == "pairwise":
            print(f"{r['name']:22s} {pairwise_notes(r['records'])}")
        elif r["mode"] == "equivalence":
            print(f"{r['name']:22s} {equivalence_notes(r['records'], verified)}")


def print_replies(rows: list[dict], top: int) -> None:
    """Each variant's most frequent first replies, with their counts."""
    print(f"\nmost frequent first (greedy) replies, of {top}:")
    for r in rows:
        counts = collections.Counter(" ".join(replies[0].split()) if replies[0] else repr(replies[0])
                                     for replies, _ in r["judgments"])
        shown = "; ".join(f"{n}x {text[:60]!r}" for text, n in counts.most_common(top))
        print(f"  {r['name']:22s} {shown}")


# ----------------------------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("vllm", "torch"), default="vllm", help="the judge's and sampler's engine")
    ap.add_argument("--prompts", type=int, default=8, help="held-out review prompts")
    ap.add_argument("--group", type=int, default=4, help="reviews per prompt (a pairwise group)")
    ap.add_argument("--problems", type=int, default=16, help="held-out word problems")
    ap.add_argument("--judge-max-new-tokens", type=int, default=12, help="the recipe's 12")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--controls", action=argparse.BooleanOptionalAction, default=True,
                    help="equivalence: judge the references restated and off by 7 as well (math-verify: right, wrong)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=3, help="most frequent first replies shown per variant")
    return ap.parse_args()


def make_samples(args, path: str) -> tuple[dict, list[tuple[float, str, str]], float]:
    """The samples of each mode's variants (conversations, env_infos), math-verify's (reward, status, kind) of each
    equivalence sample (kind: SmolLM2's "answer", or a control: the reference "restated", the reference "+7"), and
    the seconds SmolLM2 took to write its reviews and answers."""
    from nemo_grpo.envs.math_env import check_answer

    instructions, problems = held_out(args)
    reviews, answers, sampling_s = sample(path, args, instructions, problems)
    questions, references = [p["input"] for p in problems], [p["output"] for p in problems]
    kinds = ["answer"] * len(answers)
    if args.controls:
        answers = (answers + [CONTROL.format(r) for r in references]
                   + [CONTROL.format(int(r) + 7) for r in references])
        questions, references = questions * 3, references * 3
        kinds += ["restated"] * len(problems) + ["+7"] * len(problems)
    verified = [(*check_answer(a, r, 5.0, 2048)[::2], k) for a, r, k in zip(answers, references, kinds)]
    prompts = [t for t in instructions for _ in range(args.group)]
    samples = {"reviews": (conversations(prompts, reviews), [{"ground_truth": "negative"} for _ in reviews]),
               "problems": (conversations(questions, answers), [{"ground_truth": r} for r in references])}
    return samples, verified, sampling_s


def main() -> None:
    args = parse_args()
    print(machine_line(), flush=True)
    torch.set_num_threads(1)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "Timeout is disabled" (check_answer's own)
    import ray

    from nemo_grpo.distributed.cluster import init_ray
    from nemo_grpo.envs.judge_clients import EngineJudge
    from nemo_grpo.models.builtin import resolve_model_path

    load_before = os.getloadavg()[0]  # the machine may be shared: its load is printed with the figures
    init_ray(log_to_driver=False)
    samples, verified, sampling_s = make_samples(args, resolve_model_path(MODEL))
    judge = EngineJudge(judge_config(args), (None,), 1)
    try:
        warm_up(judge, [log[-1]["content"] for log in samples["reviews"][0]])
        rows = [run_variant(name, judge, args, samples) for name in args.variants]
    finally:
        judge.shutdown()
        ray.shutdown()
    right = sum(mv == 1.0 and kind == "answer" for mv, _, kind in verified)
    controls = f" + {2 * args.problems} control answers" if args.controls else ""
    print(f"\nSmolLM2-135M-Instruct judging SmolLM2-135M-Instruct, {args.backend} engines, 1 thread per process; "
          f"{args.prompts} prompts x {args.group} reviews, {args.problems} word-problem answers ({right} right by "
          f"math-verify){controls}; writing them took {sampling_s:.0f} s; the judge: <= {args.judge_max_new_tokens} "
          f"new tokens, greedy, then up to 2 sampled retries; load average {load_before:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end")
    print_table(rows, verified)
    print_replies(rows, args.top)


if __name__ == "__main__":
    main()
