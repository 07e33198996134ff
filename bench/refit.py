"""Refit time and bandwidth in both modes, against torch's memcpy of the same bytes, per model, in one run.

    python bench/refit.py                                 # SmolLM2-135M-Instruct and a 1B-shaped random Llama
    python bench/refit.py --models tiny --engines torch   # the tiny test model (seconds)
    python bench/refit.py --models 1b --bucket-mb 64 --repeats 5

Per model: a policy (DTensor, dp=2, gloo, 1 thread per rank) and, one after the other, each engine (torch; vLLM
where installed); each mode's refitter is warmed up once (it maps its region, or sets up its group, then), then timed over
--repeats refits: colocated (host shared memory, `SharedMemoryRefitter`) and non-colocated (a gloo group,
`CollectiveRefitter`). The baseline is `dst.copy_(src)` of the refit's bytes between two buffers allocated
and touched beforehand (memcpy at the memory's bandwidth); `clone` (allocating, first touch) is shown too.
The 1B shape is Llama-3.2-1B's transformer (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192) with the
tiny tokenizer's vocabulary, so the embedding is small: ~0.97B parameters, 3.6 GiB in float32.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

import torch
from timing import median_seconds, machine_line  # bench/timing.py

MODES = ("colocated", "non-colocated")
SHAPES = {"tiny": {}, "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                             "num_attention_heads": 32, "num_key_value_heads": 8}}


def model_path(name: str, workdir: str) -> str:
    from nemo_grpo.models.builtin import resolve_model_path
    from nemo_grpo.models.tiny import save_tiny_model

    if name == "smollm2":
        return resolve_model_path("builtin:smollm2-135m-instruct")
    return save_tiny_model(os.path.join(workdir, name), arch="llama", **SHAPES[name])


def memcpy_seconds(nbytes: int, repeats: int) -> tuple[float, float]:
    """(median seconds of copy_ between two touched buffers, of clone) for nbytes."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    copy = median_seconds(lambda: dst.copy_(src), repeats)
    dst = None  # its memory back before clone allocates
    return copy, median_seconds(src.clone, repeats)


def refit_seconds(name: str, path: str, engines: list[str], args) -> dict:
    """{engine: {mode: median seconds, mode + " first": seconds}, "bytes": refit bytes} for one model; a mode
    that fails (e.g. non-colocated on a GPU machine without devices for generation) is None, its error printed."""
    from nemo_grpo.config import ClusterConfig, ColocatedConfig, PolicyConfig
    from nemo_grpo.generation import make_generation_engine
    from nemo_grpo.policy import Policy
    from nemo_grpo.weights.refit import make_refitter

    cluster = ClusterConfig(gpus_per_node=args.world_size, num_nodes=1, num_threads_per_worker=1)
    cfg = PolicyConfig(model_name=path)
    cfg.generation.refit_bucket_size_mb = args.bucket_mb
    out: dict = {}
    with Policy(cfg, cluster, path) as policy:
        out["devices"] = policy.devices
        for kind in engines:
            gen_cfg = dataclasses.replace(cfg.generation, backend=kind)
            engine, times = make_generation_engine(gen_cfg, path, cluster), {}
            try:
                for mode in MODES:
                    times[mode] = None
                    try:
                        refitter = make_refitter(policy, engine, dataclasses.replace(
                            gen_cfg, colocated=ColocatedConfig(enabled=mode == "colocated")))
                        first = refitter.refit()  # maps the region / sets up the group
                        out["bytes"], times[f"{mode} first"] = first["bytes"], first["seconds"]
                        times[mode] = median_seconds(refitter.refit, args.repeats)
                        refitter.close()  # its region's memory, before the next mode's
                    except Exception as err:  # noqa: BLE001 -- a bench row, not a program: report and go on
                        print(f"{name}, {kind} engine: {mode} refit failed: {type(err).__name__}: {err}", flush=True)
                        continue
                    print(f"{name}, {kind} engine: {mode} refit {times[mode]:.3f} s (first {first['seconds']:.3f} s)",
                          flush=True)
            finally:
                engine.shutdown()
            out[kind] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=["tiny", "smollm2", "1b"], default=["smollm2", "1b"])
    ap.add_argument("--engines", nargs="+", choices=["torch", "vllm"], default=None,
                    help="default: both where vLLM is installed, else torch")
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=2,
                    help="policy ranks (DTensor data parallel); on a GPU machine one per GPU, e.g. 1 on one GPU")
    args = ap.parse_args()
    print(machine_line(), flush=True)
    torch.set_num_threads(1)
    from nemo_grpo.distributed.cluster import init_ray
    from nemo_grpo.generation import vllm_available

    engines = args.engines or (["torch", "vllm"] if vllm_available() else ["torch"])
    init_ray()
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.models:
            result = refit_seconds(name, model_path(name, workdir), engines, args)
            copy, clone = memcpy_seconds(int(result["bytes"]), args.repeats)
            rows += [(name, kind, result["bytes"], result[kind], copy, clone) for kind in engines]
    print(f"\npolicy DTensor dp={args.world_size} on {result['devices']}; buckets of {args.bucket_mb:g} MB; median of "
          f"{args.repeats} refits; GiB/s of the refit's bytes; vs memcpy = memcpy seconds / refit seconds")
    print("| model | engine | MiB | memcpy s (GiB/s) | clone s | colocated s (GiB/s) | vs memcpy | "
          "non-colocated s (GiB/s) | vs memcpy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, kind, nbytes, r, copy, clone in rows:
        gib = nbytes / 2**30
        cells = [f"{r[m]:.3f} ({gib / r[m]:.2f}) | {copy / r[m]:.2f}" if r[m] else "failed | -" for m in MODES]
        print(f"| {name} | {kind} | {nbytes / 2**20:.0f} | {copy:.3f} ({gib / copy:.2f}) | {clone:.3f} | "
              f"{cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
