"""nemo_grpo (vLLM engine, torch engine) against TRL's GRPOTrainer on the same tiny GRPO run, on this CPU.

    python bench/grpo_vs_trl.py --steps 30            # needs the bench extra: make setup-bench
    python bench/grpo_vs_trl.py --steps 30 --only torch trl
    python bench/grpo_vs_trl.py --model builtin:smollm2-135m-instruct --prompts 4 --group 4 --max-new-tokens 64 \
        --steps 6 --warmup 1 --only trl vllm async      # the real checkpoint: longer answers, compute dominates
    python bench/grpo_vs_trl.py ... --precision bfloat16   # both in bf16 mixed precision (fp32 master weights)
    python bench/grpo_vs_trl.py ... --precision auto       # bf16 where this CPU computes it natively, else fp32
    python bench/grpo_vs_trl.py ... --packing              # nemo_grpo packs its rows (policy.sequence_packing)

Same for every run: builtin:tiny-addition (or --model), the 100 additions "a+b=" (through the model's chat
template when it has a real one: SmolLM2's ChatML), 16 prompts x 8 samples per step, at most 4 new tokens
(--prompts, --group, --max-new-tokens), temperature 1.0, AdamW lr 5e-4 (constant), max_grad_norm 0.2, no KL
(beta 0), ratio clip 0.2, group-std advantages, reward = math-verify via nemo_grpo.envs.math_env.verify_answer,
seed 42. --precision auto (nemo_grpo/precision.py: bf16 on a CPU with AVX512-BF16 or AMX, else fp32) is
resolved here once and given to both. --precision bfloat16: ours policy.precision=bfloat16 (the policy's bf16 compute over fp32 master
weights; vLLM on the CPU still samples in fp32), TRL's bf16=True (accelerate's bf16 autocast around its model,
fp32 weights). --packing: nemo_grpo's policy packs each rank's rows into rows of at most micro-batch x longest
tokens (policy.sequence_packing.enabled=true alone); TRL pads, as its GRPOTrainer does.
Loss: ours is token-level (sum over the batch's tokens / global valid-token count); TRL's loss_type="dapo" is
the same normalization (with one gradient-accumulation step "bnpo" would be too).
Differences that stay: TRL generates with the training model in its own process (no refit, no separate
old-policy forward: with num_iterations=1 it reuses the detached current log-probs); nemo_grpo runs Ray actors
(policy ranks, engine, verifiers), computes old-policy log-probs, and refits the engine every step.
Every process runs one torch thread (driver and TRL subprocess: set_num_threads(1) + OMP_NUM_THREADS=1;
Ray actors: cluster.num_threads_per_worker=1).

A fourth run, "nemo_grpo (vllm, async)", is async GRPO (grpo.async_grpo, rollouts at most one step old, the
engine non-colocated, importance-sampling correction on): generation overlaps training, its per-step seconds
come from the step's own timer. It changes the algorithm (one step off-policy): compare its reward too.

Per run: s/step = median wall time of a step after the first --warmup steps; tok/s = generated tokens of those
steps / their seconds (response tokens, EOS included: mean_response_length x samples for nemo_grpo, TRL's
completions/mean_length x samples); reward = mean of the last 10 steps' mean reward.
Refit: median seconds per step, and its bandwidth against an in-memory copy (torch.cat of the flattened
weights, and clone) of the same tensors in the driver: the physical bound.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, here and in the TRL subprocess
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from timing import median_seconds, machine_line  # noqa: E402  (bench/timing.py)

from nemo_grpo.precision import choose_precision  # noqa: E402

TEMPERATURE, LR, GRAD_NORM = 1.0, 5e-4, 0.2
MODEL = "builtin:tiny-addition"
PROMPT_TOKENS = 48  # room for a chat template's system turn around "a+b="
VERIFY_TIMEOUT_S, MAX_ANSWER_CHARS = 5.0, 2048  # env.math defaults


# ---------------------------------------------------------------------------------------------- nemo_grpo
class RecordingRefitter:
    """Wraps the trainer's refitter and keeps each refit's {"seconds", "bytes", "buckets"}."""

    def __init__(self, inner):
        self.inner, self.stats = inner, []

    def refit(self) -> dict[str, float]:
        stats = self.inner.refit()
        self.stats.append(stats)
        return stats

    def close(self) -> None:
        self.inner.close()


def nemo_overrides(engine: str, args, log_dir: str) -> list[str]:
    per_rank = args.samples // args.policy_ranks  # the recipe's micro-batches (32 / 64), or a smaller batch's
    sizes = [f"policy.train_micro_batch_size={min(32, per_rank)}", f"policy.logprob_batch_size={min(64, per_rank)}"]
    if args.model != MODEL:
        sizes += [f"data.max_input_seq_length={PROMPT_TOKENS}",
                  f"policy.max_total_sequence_length={PROMPT_TOKENS + args.max_new_tokens}"]
    if args.packing:
        sizes.append("policy.sequence_packing.enabled=true")
    return sizes + [
            f"policy.model_name={args.model}", f"policy.precision={args.resolved}",
            f"policy.generation.backend={engine}",
            f"grpo.num_prompts_per_step={args.prompts}", f"grpo.num_generations_per_prompt={args.group}",
            f"policy.train_global_batch_size={args.samples}", f"policy.generation.max_new_tokens={args.max_new_tokens}",
            f"policy.generation.temperature={TEMPERATURE}", f"policy.optimizer.lr={LR}",
            f"policy.max_grad_norm={GRAD_NORM}", "loss_fn.reference_policy_kl_penalty=0",
            "loss_fn.token_level_loss=true", "grpo.normalize_rewards=true", f"grpo.max_num_steps={args.steps}",
            f"grpo.seed={args.seed}", "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
            "checkpointing.enabled=false", f"logger.log_dir={log_dir}", "logger.progress_bar=false",
            "logger.tensorboard_enabled=false", "logger.plot=false",
            f"cluster.gpus_per_node={args.policy_ranks}", "cluster.num_threads_per_worker=1"]


def copy_bound(trainer) -> dict[str, float]:
    """Seconds of an in-memory torch.cat / clone of exactly the tensors a refit sends (gathered to the driver)."""
    from nemo_grpo.weights.refit import Senders
    from nemo_grpo.weights.sender import WeightSender

    senders = Senders(trainer.policy.group.actors)
    state = senders.run(WeightSender.gather, [s.name for s in senders.run(WeightSender.specs)[0]])[0]
    return {"cat_s": median_seconds(lambda: torch.cat([v.reshape(-1) for v in state.values()])),
            "clone_s": median_seconds(lambda: [v.clone() for v in state.values()]),
            "bytes": float(sum(t.numel() * t.element_size() for t in state.values()))}


ASYNC = ["policy.generation.colocated.enabled=false", "loss_fn.use_importance_sampling_correction=true",
         "grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1"]


def run_nemo(engine: str, args, asynchronous: bool = False) -> dict:
    """One in-process nemo_grpo run: per-step seconds, generated tokens, rewards, refit stats, copy bound.
    asynchronous: async GRPO (one step off-policy, non-colocated engine) through trainer.run()."""
    from nemo_grpo.build import build_trainer
    from nemo_grpo.validation import load_config

    log_dir = tempfile.mkdtemp(prefix=f"bench_{engine}_")
    overrides = nemo_overrides(engine, args, log_dir) + (ASYNC if asynchronous else [])
    trainer = build_trainer(load_config(None, overrides))
    try:
        trainer.refitter = RecordingRefitter(trainer.refitter)
        if asynchronous:  # the collector runs beside the trainer: per-step seconds from the step's own timer
            history = trainer.run()
            seconds = [h["timing/total"] for h in history]
            sections = [{k.split("/", 1)[1]: v for k, v in h.items() if k.startswith("timing/")} for h in history]
            tokens = [h["mean_response_length"] * args.samples for h in history]
            rewards = [h["reward"] for h in history]
        else:
            seconds, tokens, rewards, sections = [], [], [], []
            for step in range(1, args.steps + 1):
                start = time.perf_counter()
                metrics = trainer.train_step()
                seconds.append(time.perf_counter() - start)
                sections.append(trainer.timer.get_timing_metrics())  # seconds per section of this step
                tokens.append(metrics["mean_response_length"] * args.samples)
                rewards.append(metrics["reward"])
                print(f"  [{engine}] step {step}: {seconds[-1]:.3f} s, reward {rewards[-1]:.3f}", flush=True)
        refits = trainer.refitter.stats[args.warmup:] or trainer.refitter.stats
        refit = {"seconds": statistics.median(r["seconds"] for r in refits), "bytes": refits[-1]["bytes"]}
        return {"seconds": seconds, "tokens": tokens, "rewards": rewards, "refit": refit,
                "bound": copy_bound(trainer), "sections": sections[args.warmup:] or sections}
    finally:
        trainer.close()
        shutil.rmtree(log_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- TRL
def trl_child(args) -> None:
    """In the TRL subprocess: train with TRL's GRPOTrainer and write per-step results as JSON to args.trl_out."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nemo_grpo.data.datasets import addition_problems
    from nemo_grpo.envs.math_env import verify_answer
    from nemo_grpo.models.builtin import resolve_model_path

    def math_verify(completions, answer, **_):
        return [verify_answer(c, a, VERIFY_TIMEOUT_S, MAX_ANSWER_CHARS)[0] for c, a in zip(completions, answer)]

    class StepClock(TrainerCallback):  # wall time between consecutive optimizer-step ends
        def __init__(self):
            self.last, self.seconds = None, []

        def on_train_begin(self, *_, **__):
            self.last = time.perf_counter()

        def on_step_end(self, *_, **__):
            now = time.perf_counter()
            self.seconds.append(now - self.last)
            self.last = now

    path = resolve_model_path(args.model, seed=0)
    problems = addition_problems()
    prompts = [p["problem"] if args.model == MODEL else [{"role": "user", "content": p["problem"]}]
               for p in problems]  # a real checkpoint: conversational, so TRL applies its chat template as we do
    ds = Dataset.from_dict({"prompt": prompts, "answer": [p["answer"] for p in problems]})
    out_dir = tempfile.mkdtemp(prefix="bench_trl_")
    cfg = GRPOConfig(output_dir=out_dir, use_cpu=True, bf16=args.resolved == "bfloat16", learning_rate=LR,
                     lr_scheduler_type="constant",
                     weight_decay=0.0, max_grad_norm=GRAD_NORM, per_device_train_batch_size=args.samples,
                     gradient_accumulation_steps=1, num_generations=args.group,
                     max_completion_length=args.max_new_tokens,
                     temperature=TEMPERATURE, top_p=1.0, beta=0.0, epsilon=0.2, loss_type="dapo",
                     scale_rewards="group", num_iterations=1, max_steps=args.steps, logging_steps=1,
                     report_to="none", save_strategy="no", seed=args.seed, data_seed=args.seed, disable_tqdm=True,
                     dataloader_num_workers=0, model_init_kwargs={"dtype": torch.float32})
    clock = StepClock()
    trainer = GRPOTrainer(model=path, reward_funcs=math_verify, args=cfg, train_dataset=ds,
                          processing_class=AutoTokenizer.from_pretrained(path), callbacks=[clock])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    result = {"seconds": clock.seconds, "rewards": [h["reward"] for h in logs],
              "tokens": [h["completions/mean_length"] * args.samples for h in logs],
              "trl": __import__("trl").__version__,
              "threads": torch.get_num_threads()}
    with open(args.trl_out, "w") as f:
        json.dump(result, f)
    shutil.rmtree(out_dir, ignore_errors=True)


def run_trl(args) -> dict | None:
    """TRL in a subprocess (its own threads, no Ray); None when TRL is not installed."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        print("TRL not installed (pip install -e '.[bench]'): skipping the TRL run", flush=True)
        return None
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--steps", str(args.steps), "--seed", str(args.seed),
           "--model", args.model, "--prompts", str(args.prompts), "--group", str(args.group),
           "--max-new-tokens", str(args.max_new_tokens), "--precision", args.precision, "--trl-out", out]
    try:
        proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"TRL run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}", flush=True)
            return None
        with open(out) as f:
            return json.load(f)
    finally:
        os.remove(out)


# ---------------------------------------------------------------------------------------------- report
def summarize(result: dict, warmup: int) -> dict[str, float]:
    timed = slice(warmup, None) if len(result["seconds"]) > warmup else slice(None)
    seconds, tokens = result["seconds"][timed], result["tokens"][timed]
    last = result["rewards"][-10:]
    return {"s_per_step": statistics.median(seconds), "tok_per_s": sum(tokens) / sum(seconds),
            "reward": sum(last) / len(last)}


def print_table(results: dict[str, dict], args) -> None:
    rows = {name: summarize(r, args.warmup) for name, r in results.items()}
    ref = rows.get("TRL GRPOTrainer")
    print(f"\n{args.model}: {args.steps} steps of {args.prompts} prompts x {args.group} samples, <= "
          f"{args.max_new_tokens} new tokens, {args.precision} -> {args.resolved} on CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}{', nemo_grpo packed' if args.packing else ''}; "
          f"s/step = median "
          f"after {args.warmup} warm-up steps; reward = mean of the last 10 steps; 1 torch thread per process; "
          f"nemo_grpo with {args.policy_ranks} policy rank(s); shared CPU: figures are noisy")
    head = f"{'run':28s} {'s/step':>8s} {'tok/s':>8s} {'reward':>7s}"
    print(head + (f" {'s/step/TRL':>11s} {'tok/s/TRL':>10s} {'reward/TRL':>11s}" if ref else "  (TRL not run)"))
    for name, row in rows.items():
        line = f"{name:28s} {row['s_per_step']:8.3f} {row['tok_per_s']:8.0f} {row['reward']:7.3f}"
        if ref:
            line += "".join(f" {row[k] / ref[k]:{w}.2f}" if ref[k] else f" {'-':>{w}s}"
                            for k, w in (("s_per_step", 11), ("tok_per_s", 10), ("reward", 11)))
        print(line)
    print("\nnemo_grpo step sections (median seconds after warm-up):")
    for name, r in results.items():
        if "sections" in r:
            keys = [k for k in ("generation", "environment", "logprobs", "training", "refit", "generation_wait",
                                "total") if k in r["sections"][0]]
            print(f"  {name:26s} " + ", ".join(
                f"{k} {statistics.median(s.get(k, 0.0) for s in r['sections']):.3f}" for k in keys))
    print("\nrefit (median per step after warm-up) vs an in-memory copy of the same bytes in the driver:")
    for name, r in results.items():
        if "refit" not in r:
            print(f"  {name:26s} no refit: generates with the training model in its own process")
            continue
        nbytes, secs, bound = r["refit"]["bytes"], r["refit"]["seconds"], r["bound"]
        bw, cat_bw, clone_bw = nbytes / secs, bound["bytes"] / bound["cat_s"], bound["bytes"] / bound["clone_s"]
        print(f"  {name:26s} {secs * 1e3:7.1f} ms/step, {nbytes / 2**20:.2f} MiB -> {bw / 2**20:8.1f} MiB/s; "
              f"torch.cat {cat_bw / 2**20:8.1f} MiB/s (refit/cat {bw / cat_bw:.4f}), "
              f"clone {clone_bw / 2**20:8.1f} MiB/s (refit/clone {bw / clone_bw:.4f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the s/step median and tok/s")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--model", default=MODEL, help="builtin:smollm2-135m-instruct: the real checkpoint")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--policy-ranks", type=int, default=2, help="DTensor policy processes (default recipe: 2)")
    ap.add_argument("--precision", choices=["auto", "float32", "bfloat16"], default="float32",
                    help="bfloat16: bf16 mixed precision in both frameworks; auto: bf16 where this CPU computes it "
                         "natively, else fp32")
    ap.add_argument("--packing", action="store_true", help="nemo_grpo packs its rows (sequence packing)")
    ap.add_argument("--only", nargs="+", choices=["vllm", "torch", "trl", "async"],
                    default=["vllm", "torch", "trl", "async"], help="async: nemo_grpo async GRPO, vLLM engine")
    ap.add_argument("--trl-out", help=argparse.SUPPRESS)  # internal: run as the TRL subprocess
    args = ap.parse_args()
    print(machine_line(), flush=True)
    args.samples = args.prompts * args.group
    torch.set_num_threads(1)
    args.resolved = choose_precision(args.precision, torch.device("cpu")).precision
    if args.trl_out:
        return trl_child(args)
    results = {}
    if "trl" in args.only:  # first, so no idle Ray daemons share the CPU with it
        trl = run_trl(args)
        if trl is not None:
            results["TRL GRPOTrainer"] = trl
    for engine in ("vllm", "torch"):
        if engine in args.only:
            results[f"nemo_grpo ({engine} engine)"] = run_nemo(engine, args)
    if "async" in args.only:
        results["nemo_grpo (vllm, async)"] = run_nemo("vllm", args, asynchronous=True)
    if results.get("TRL GRPOTrainer"):
        trl = results["TRL GRPOTrainer"]
        print(f"TRL {trl['trl']}: loss_type='dapo' (token-level, global token count); torch threads in its "
              f"process {trl['threads']}, in this driver {torch.get_num_threads()}")
    print_table(results, args)


if __name__ == "__main__":
    main()
