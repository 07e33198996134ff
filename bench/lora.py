"""LoRA vs full-parameter training: trainable parameters, optimizer-state memory, train-step time, refit bytes.

    python bench/lora.py                                   # builtin:tiny-addition and SmolLM2-135M, DTensor
    python bench/lora.py --models builtin:smollm2-135m-instruct --backend megatron --repeats 3

Per model and mode (full, LoRA rank --rank on every linear layer of attention and MLP), one policy of one rank
(fp32, one thread): the trainable parameters and the Adam state the optimizer holds after a step (measured on
the worker: the bytes of its state tensors), the median time of a `Policy.train` call of one optimizer step
over --batch sequences of --seq-len tokens after a warm-up, and the bytes a refit sends after the first
(LoRA: only the engine layers under adapters; full: everything). Ratios are LoRA / full of the same model.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import argparse  # noqa: E402

from policy_layouts import make_batch  # noqa: E402  (bench/policy_layouts.py)
from timing import MeanLogprobLoss, median_seconds, machine_line  # noqa: E402  (bench/timing.py)

MODELS = ["builtin:tiny-addition", "builtin:smollm2-135m-instruct"]


def measure(model: str, lora: bool, args) -> dict:
    """One policy: trainable parameters, optimizer-state bytes, median train-call seconds, refit bytes."""
    from transformers import AutoConfig

    from nemo_grpo.config import ClusterConfig, PolicyConfig
    from nemo_grpo.models.builtin import resolve_model_path
    from nemo_grpo.policy import Policy
    from nemo_grpo.weights.refit import Senders
    from nemo_grpo.weights.sender import WeightSender

    path = resolve_model_path(model)
    cfg = PolicyConfig(model_name=path, backend=args.backend, train_global_batch_size=args.batch,
                       train_micro_batch_size=args.batch, logprob_batch_size=args.batch,
                       max_total_sequence_length=args.seq_len)
    cfg.lora.enabled, cfg.lora.rank, cfg.lora.alpha = lora, args.rank, 2.0 * args.rank
    batch = make_batch(args.batch, args.seq_len, vocab=AutoConfig.from_pretrained(path).vocab_size)
    with Policy(cfg, ClusterConfig(gpus_per_node=1, num_nodes=1, num_threads_per_worker=1), path) as policy:
        policy.train(batch, MeanLogprobLoss())
        seconds = median_seconds(lambda: policy.train(batch, MeanLogprobLoss()), args.repeats)
        memory = policy.optimizer_memory()
        senders = Senders(policy.group.actors)
        info = senders.run(WeightSender.open_region, "bench", 256.0, "float32")[0]
        senders.run(WeightSender.close, "bench")
    plan = info["plan"]
    return {**memory, "seconds": seconds, "tok_per_s": args.batch * args.seq_len / seconds,
            "refit_bytes": float(sum(s.nbytes for bucket in plan[info["trained_from"] if lora else 0:]
                                     for s in bucket))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--backend", default="dtensor", choices=["dtensor", "megatron"])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(machine_line(), flush=True)
    from nemo_grpo.distributed.cluster import init_ray

    init_ray()
    print(f"{args.backend}, fp32, 1 rank, {args.batch} x {args.seq_len} tokens per step, LoRA rank {args.rank}")
    print("| model | mode | trainable params | optimizer state MiB | s / step | tok/s | refit MiB after the "
          "first | state vs full | step time vs full |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        full = measure(model, False, args)
        for mode, r in (("full", full), (f"LoRA r={args.rank}", measure(model, True, args))):
            print(f"| {model.removeprefix('builtin:')} | {mode} | {r['trainable_parameters'] / 1e6:.3f}M | "
                  f"{r['optimizer_state_bytes'] / 2**20:.2f} | {r['seconds']:.3f} | {r['tok_per_s']:.0f} | "
                  f"{r['refit_bytes'] / 2**20:.2f} | "
                  f"{r['optimizer_state_bytes'] / full['optimizer_state_bytes']:.3f}x | "
                  f"{r['seconds'] / full['seconds']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
