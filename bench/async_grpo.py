"""Step time of async GRPO against synchronous GRPO, both with non-colocated generation, in one run.

    python bench/async_grpo.py                          # the default recipe's model, 20 steps each (~1 min)
    python bench/async_grpo.py --steps 30 --max-new-tokens 4 --max-age 2

Same for both runs: the default recipe (builtin:tiny-addition, 16 prompts x 8 samples, AdamW 5e-4; at most
--max-new-tokens 8, where generation with scoring and training take about the same time), engine --engine on
actors of its own (policy.generation.colocated.enabled=false), importance-sampling correction on,
no validation, no checkpoints, --policy-ranks DTensor ranks, one torch thread per process. The async run has
grpo.async_grpo.enabled=true with max_trajectory_age_steps --max-age. Per run: median seconds per step after
--warmup steps, and the median of each section: generation (+ environment) of the step's rollouts, log-probs,
training, refit, and generation_wait (the trainer idle, waiting for rollouts). In the async run generation
overlaps the previous step's training: a step costs about max(generation, training) + refit instead of the
sum. Ratio = async s/step / sync s/step.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
from timing import machine_line  # noqa: E402  (bench/timing.py)

SECTIONS = ("generation", "environment", "logprobs", "training", "refit", "generation_wait", "total")


def overrides(args, log_dir: str, asynchronous: bool) -> list[str]:
    out = [f"policy.generation.backend={args.engine}", "policy.generation.colocated.enabled=false",
           "loss_fn.use_importance_sampling_correction=true", f"policy.generation.max_new_tokens={args.max_new_tokens}",
           f"grpo.max_num_steps={args.steps}", "grpo.val_period=0", "grpo.val_at_start=false",
           "grpo.val_at_end=false", "checkpointing.enabled=false", f"logger.log_dir={log_dir}",
           "logger.progress_bar=false", "logger.tensorboard_enabled=false", "logger.plot=false",
           f"cluster.gpus_per_node={args.policy_ranks}", "cluster.num_threads_per_worker=1"]
    if asynchronous:
        out += ["grpo.async_grpo.enabled=true", f"grpo.async_grpo.max_trajectory_age_steps={args.max_age}"]
    return out


def run(args, asynchronous: bool) -> dict[str, float]:
    """Median seconds per section after the warm-up steps, and the mean trajectory age."""
    from nemo_grpo.build import build_trainer
    from nemo_grpo.validation import load_config

    log_dir = tempfile.mkdtemp(prefix="bench_async_")
    trainer = build_trainer(load_config(None, overrides(args, log_dir, asynchronous)))
    try:
        history = trainer.run()[args.warmup:]
    finally:
        trainer.close()
        shutil.rmtree(log_dir, ignore_errors=True)
    out = {k: statistics.median(h.get(f"timing/{k}", 0.0) for h in history) for k in SECTIONS}
    out["age"] = statistics.mean(h.get("async/trajectory_age_mean", 0.0) for h in history)
    out["reward"] = statistics.mean(h["reward"] for h in history[-10:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--engine", choices=["vllm", "torch"], default="vllm")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--max-age", type=int, default=1)
    ap.add_argument("--policy-ranks", type=int, default=1)
    args = ap.parse_args()
    print(machine_line(), flush=True)
    torch.set_num_threads(1)
    results = {"sync": run(args, False), f"async (age <= {args.max_age})": run(args, True)}
    print(f"\n{args.steps} steps, median after {args.warmup}; engine {args.engine}, non-colocated; "
          f"{args.policy_ranks} policy rank(s); <= {args.max_new_tokens} new tokens; seconds")
    print("| run | s/step | vs sync | generation | environment | log-probs | training | refit | waiting | "
          "mean age | reward (last 10) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = results["sync"]["total"]
    for name, r in results.items():
        print(f"| {name} | {r['total']:.3f} | {r['total'] / base:.2f}x | {r['generation']:.3f} | "
              f"{r['environment']:.3f} | {r['logprobs']:.3f} | {r['training']:.3f} | {r['refit']:.3f} | "
              f"{r['generation_wait']:.3f} | {r['age']:.2f} | {r['reward']:.3f} |")


if __name__ == "__main__":
    main()
