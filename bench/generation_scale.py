"""Generation throughput and refit time with 1 and 2 engine replicas, per model and engine, in one run.

    python bench/generation_scale.py                                  # the tiny model and SmolLM2-135M-Instruct
    python bench/generation_scale.py --models tiny --engines torch --repeats 2

Per model: a policy (DTensor, dp=2, 1 thread per rank) whose ranks stand for two devices, and, one after the
other, each engine with 1 replica, then 2 (two replicas of TP 1: every device of the colocated policy, as
`resource_plan.engine_replicas` places them), each replica an actor with 1 thread. A GRPO-shaped call
(--prompts prompts x --samples samples, --max-new tokens each, seeded) is timed after a warm-up call: generated
tokens per second, median of --repeats calls. Then the colocated refit (host shared memory) into the replicas:
median seconds of --repeats refits after the first. The policy's ranks wait in Ray while the engine generates, as
in a colocated GRPO step, so two replicas have a core each.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

import torch
from timing import median_seconds, machine_line  # bench/timing.py

REPLICAS = (1, 2)
QUESTIONS = ["What is 17 + 25?", "Name three primary colours.", "Write a haiku about rain.",
             "How many legs does a spider have?", "What is the capital of France?", "Explain gravity in a sentence.",
             "Count from one to ten.", "What is 9 times 8?"]


def model_path(name: str, workdir: str) -> str:
    from nemo_grpo.models.builtin import resolve_model_path
    from nemo_grpo.models.tiny import save_tiny_model

    if name == "smollm2":
        return resolve_model_path("builtin:smollm2-135m-instruct")
    return save_tiny_model(os.path.join(workdir, name), arch="llama")


def grpo_call(path: str, prompts: int, samples: int) -> list[list[int]]:
    """`prompts` chat prompts (the questions above, rendered by the model's template), `samples` copies each."""
    from nemo_grpo.models.tokenizer import load_tokenizer

    from nemo_grpo.data.prompts import render_prompt

    tokenizer = load_tokenizer(path)
    rendered = [render_prompt(tokenizer, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] +
                                           " Please." * (i // len(QUESTIONS))}]) for i in range(prompts)]
    return [list(ids) for ids in rendered for _ in range(samples)]


def measure(policy, gen_cfg, path: str, cluster, replicas: int, prompts: list[list[int]], repeats: int) -> dict:
    """{"tokens_per_s", "refit_s"} of an engine of `replicas` replicas (refit from `policy`, colocated)."""
    from nemo_grpo.generation import make_generation_engine
    from nemo_grpo.weights.refit import make_refitter

    engine = make_generation_engine(gen_cfg, path, cluster, replicas=(None,) * replicas)
    try:
        refitter = make_refitter(policy, engine, gen_cfg)
        refitter.refit()  # maps the regions; the engine holds the policy's weights
        refit_s = median_seconds(refitter.refit, repeats)
        refitter.close()
        engine.generate(prompts, seed=0)  # warm-up
        tokens = []

        def call():
            tokens.append(sum(len(o.token_ids) for o in engine.generate(prompts, seed=len(tokens) + 1)))

        seconds = median_seconds(call, repeats)
        return {"tokens_per_s": sorted(tokens)[len(tokens) // 2] / seconds, "refit_s": refit_s}
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=["tiny", "smollm2"], default=["tiny", "smollm2"])
    ap.add_argument("--engines", nargs="+", choices=["torch", "vllm"], default=None,
                    help="default: both where vLLM is installed, else torch")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(machine_line(), flush=True)
    torch.set_num_threads(1)
    from nemo_grpo.config import ClusterConfig, PolicyConfig
    from nemo_grpo.distributed.cluster import init_ray
    from nemo_grpo.generation import vllm_available
    from nemo_grpo.policy import Policy

    engines = args.engines or (["torch", "vllm"] if vllm_available() else ["torch"])
    init_ray()
    cluster = ClusterConfig(gpus_per_node=2, num_nodes=1, num_threads_per_worker=1)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.models:
            path = model_path(name, workdir)
            prompts = grpo_call(path, args.prompts, args.samples)
            cfg = PolicyConfig(model_name=path)
            with Policy(cfg, cluster, path) as policy:
                for kind in engines:
                    gen_cfg = dataclasses.replace(cfg.generation, backend=kind, max_new_tokens=args.max_new,
                                                  temperature=1.0)
                    for n in REPLICAS:
                        rows.append((name, kind, n, measure(policy, gen_cfg, path, cluster, n, prompts, args.repeats)))
                        print(f"{name}, {kind}, {n} replica(s): {rows[-1][3]}", flush=True)
    print(f"\n{args.prompts} prompts x {args.samples} samples, up to {args.max_new} new tokens, seeded; median of "
          f"{args.repeats} calls after a warm-up; refit: colocated, median of {args.repeats} after the first; "
          f"{os.cpu_count()} cores, 1 thread per replica")
    print("| model | engine | replicas | generated tokens/s | vs 1 replica | refit s | vs 1 replica |")
    print("|---|---|---|---|---|---|---|")
    base = {}
    for name, kind, n, r in rows:
        one = base.setdefault((name, kind), r)
        print(f"| {name} | {kind} | {n} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / one['tokens_per_s']:.2f}x | "
              f"{r['refit_s']:.3f} | {r['refit_s'] / one['refit_s']:.2f}x |")


if __name__ == "__main__":
    main()
