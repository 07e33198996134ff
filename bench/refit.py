"""Refit time and bandwidth in both modes against a plain in-memory copy of the same bytes.

    python bench/refit.py                                  # the tiny test model (1.3 MB of weights)
    python bench/refit.py --hidden 512 --intermediate 2048 --layers 5    # ~84 MB of random weights
    python bench/refit.py --engine vllm --bucket-mb 16

A policy (dp=2, gloo) and one engine; each mode's refitter is warmed up once (the non-colocated group is set
up then), then timed over --repeats refits. The baseline copies the exported weights in the driver: `clone`
of every tensor, and `torch.cat` into one flat buffer (what packing a bucket costs).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

import torch
from timing import median_seconds  # bench/timing.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--engine", choices=["torch", "vllm"], default="torch")
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from nemo_grpo.config import ClusterConfig, ColocatedConfig, PolicyConfig
    from nemo_grpo.distributed.cluster import init_ray
    from nemo_grpo.generation import make_generation_engine
    from nemo_grpo.weights.refit import make_refitter
    from nemo_grpo.models.tiny import save_tiny_model
    from nemo_grpo.policy import Policy

    workdir = tempfile.TemporaryDirectory()
    path = save_tiny_model(os.path.join(workdir.name, "model"), hidden_size=args.hidden,
                           intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                           num_attention_heads=args.hidden // 32, num_key_value_heads=args.hidden // 32)
    init_ray()
    cluster = ClusterConfig(gpus_per_node=2, num_nodes=1, num_threads_per_worker=1)
    cfg = PolicyConfig(model_name=path)
    cfg.generation.backend, cfg.generation.refit_bucket_size_mb = args.engine, args.bucket_mb
    policy = Policy(cfg, cluster, path)
    engine = make_generation_engine(cfg.generation, path, cluster)
    try:
        state = {k: v for b in policy.export_weights(args.bucket_mb) for k, v in b.items()}
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        print(f"model: {nbytes / 2**20:.1f} MiB in {len(state)} tensors; engine {args.engine}; "
              f"buckets of {args.bucket_mb} MB; median of {args.repeats}")
        rows = [("in-memory clone", median_seconds(lambda: {k: v.clone() for k, v in state.items()}, args.repeats)),
                ("in-memory torch.cat", median_seconds(lambda: torch.cat([v.reshape(-1) for v in state.values()]),
                                              args.repeats))]
        rows.append(("policy export only (to the driver)",
                     median_seconds(lambda: [None for _ in policy.export_weights(args.bucket_mb)], args.repeats)))
        for mode, colocated in (("colocated (object store)", True), ("non-colocated (gloo group)", False)):
            gen_cfg = dataclasses.replace(cfg.generation, colocated=ColocatedConfig(enabled=colocated))
            refitter = make_refitter(policy, engine, gen_cfg)
            start = time.perf_counter()
            refitter.refit()  # warm-up; sets up the group in the non-colocated mode
            print(f"{mode}: first refit {time.perf_counter() - start:.3f} s")
            rows.append((f"refit, {mode}", median_seconds(refitter.refit, args.repeats)))
            if not colocated:
                rows.append(("  of which policy side (gather+send)",
                             sorted(refitter.refit()["send_seconds"] for _ in range(args.repeats))[args.repeats // 2]))
        for name, seconds in rows:
            print(f"  {name:38s} {seconds * 1e3:9.1f} ms  {nbytes / seconds / 2**30:8.2f} GiB/s")
    finally:
        engine.shutdown()
        policy.shutdown()
        workdir.cleanup()


if __name__ == "__main__":
    main()
