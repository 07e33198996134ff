"""LoRA refit as adapters against merged refit: seconds and bytes per refit, and the engine's generation time.

    python bench/lora_refit.py                                  # SmolLM2-135M-Instruct and the 1B shape, vLLM
    python bench/lora_refit.py --models smollm2 --engines torch vllm --modes colocated non-colocated

Per model: one LoRA policy (DTensor, one rank, fp32, rank --rank on every linear layer of attention and MLP,
one optimizer step taken so the adapters are not zero) and, one after the other, per engine and refit kind an
engine started for it: `adapters` (policy.lora.refit=adapters: the engine starts from the base model with LoRA
on; each refit sends the adapters and installs them) and `merged` (the engine holds plain weights; each refit
after the first sends the engine layers under adapters, W + scale * B @ A). Per mode (colocated: host shared
memory; non-colocated: a gloo group) the first refit is timed alone (merged: it sends every weight), then the
median of --repeats refits. `generate s`: the median of --repeats seeded calls of --prompts prompts of 16 tokens,
--new-tokens each (the adapter engine computes the adapters at every token; the merged one does not).
The 1B shape is bench/refit.py's (Llama-3.2-1B's transformer with the tiny tokenizer's vocabulary, ~0.97B
parameters, 3.6 GiB in float32).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
from policy_layouts import make_batch  # noqa: E402  (bench/policy_layouts.py)
from refit import MODES, model_path  # noqa: E402  (bench/refit.py)
from timing import MeanLogprobLoss, machine_line, median_seconds  # noqa: E402  (bench/timing.py)

KINDS = ("adapters", "merged")


def engine_rows(policy, path: str, kind: str, engine_name: str, args) -> list[dict]:
    """One engine started for `kind` of refit: a row per mode (bytes, first and median refit seconds) with the
    engine's generation time."""
    from nemo_grpo.config import ClusterConfig, ColocatedConfig
    from nemo_grpo.generation import make_generation_engine
    from nemo_grpo.weights.refit import make_refitter

    cluster = ClusterConfig(gpus_per_node=1, num_nodes=1, num_threads_per_worker=1)
    lora_cfg = dataclasses.replace(policy.cfg.lora, refit=kind)
    gen_cfg = dataclasses.replace(policy.cfg.generation, backend=engine_name)
    engine, rows = make_generation_engine(gen_cfg, path, cluster, lora_cfg=lora_cfg), []
    prompts = [[(7 * i + j) % 40 + 5 for j in range(16)] for i in range(args.prompts)]
    try:
        for mode in args.modes:
            refitter = make_refitter(policy, engine, dataclasses.replace(
                gen_cfg, colocated=ColocatedConfig(enabled=mode == "colocated")))
            first = refitter.refit()
            stats = [refitter.refit() for _ in range(args.repeats)]
            refitter.close()
            seconds = sorted(s["seconds"] for s in stats)[len(stats) // 2]
            rows.append({"kind": kind, "engine": engine_name, "mode": mode, "bytes": stats[0]["bytes"],
                         "first bytes": first["bytes"], "first s": first["seconds"], "s": seconds})
            print(f"{kind}, {engine_name}, {mode}: {rows[-1]}", flush=True)
        generate = median_seconds(lambda: engine.generate(prompts, seed=1, max_new_tokens=args.new_tokens),
                                  args.repeats)
    finally:
        engine.shutdown()
    return [dict(r, generate=generate) for r in rows]


def model_rows(name: str, path: str, args) -> list[dict]:
    """Every engine and kind of refit against one LoRA policy of the model."""
    from transformers import AutoConfig

    from nemo_grpo.config import ClusterConfig, PolicyConfig
    from nemo_grpo.policy import Policy

    cfg = PolicyConfig(model_name=path, precision="float32", train_global_batch_size=4, train_micro_batch_size=4,
                       logprob_batch_size=4, max_total_sequence_length=64)
    cfg.lora.enabled, cfg.lora.rank, cfg.lora.alpha = True, args.rank, 2.0 * args.rank
    cfg.generation.refit_bucket_size_mb = args.bucket_mb
    cluster = ClusterConfig(gpus_per_node=1, num_nodes=1, num_threads_per_worker=1)
    rows = []
    with Policy(cfg, cluster, path) as policy:
        policy.train(make_batch(4, 64, vocab=AutoConfig.from_pretrained(path).vocab_size), MeanLogprobLoss())
        for engine_name in args.engines:
            for kind in KINDS:
                rows += [dict(r, model=name) for r in engine_rows(policy, path, kind, engine_name, args)]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=["tiny", "smollm2", "1b"], default=["smollm2", "1b"])
    ap.add_argument("--engines", nargs="+", choices=["torch", "vllm"], default=["vllm"])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=["colocated"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    print(machine_line(), flush=True)
    torch.set_num_threads(1)
    from nemo_grpo.distributed.cluster import init_ray

    init_ray()
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.models:
            rows += model_rows(name, model_path(name, workdir), args)
    print(f"\nLoRA rank {args.rank} on every linear layer, DTensor 1 rank, fp32, buckets of {args.bucket_mb:g} MB; "
          f"median of {args.repeats} refits after the first; generate: {args.prompts} prompts x {args.new_tokens} "
          "new tokens")
    print("| model | engine | mode | refit | MiB a refit | s a refit | first refit MiB | first refit s | generate s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['engine']} | {r['mode']} | {r['kind']} | {r['bytes'] / 2**20:.2f} | {r['s']:.3f} "
              f"| {r['first bytes'] / 2**20:.2f} | {r['first s']:.3f} | {r['generate']:.3f} |")


if __name__ == "__main__":
    main()
