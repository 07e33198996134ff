"""Context parallelism at long context: one forward + backward of a small model at 4k, 8k and 16k tokens, CP=1 vs CP=2.

    python bench/long_context.py                          # Megatron, 4k / 8k / 16k, CP 1 and 2
    python bench/long_context.py --backend dtensor --lengths 4096 8192

The model: a Qwen3 of hidden 256, 2 layers, 4 heads of 64 (1 KV head: K/V a quarter of the hidden size, as in
Llama-3-8B), FFN 768, vocabulary 1,000, random weights, fp32. One call = one micro-batch of one row of `length`
tokens through the worker's own training step (forward, loss on the gathered log-probs, backward, optimizer step),
run on every rank of a fresh policy. Per cell: the median wall time of --repeats calls after the first, tokens/s,
and the largest rank's peak memory of the first call above its resident set before it (ru_maxrss less
/proc/self/statm, as bench/policy_layouts.py measures it), the smallest of --starts fresh policies: from one fresh
process to the next it varied by up to 30% here. "exchange" and "attention" split one profiled call's CPU time
(torch.profiler on rank 0): the K/V all-gather and its backward's all-reduce against the SDPA kernels, forward and
backward. Each worker runs one torch thread; CP=2 runs two processes on two cores, so its wall time also gains from
the second core.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import argparse  # noqa: E402
import resource  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from timing import MeanLogprobLoss, resident_bytes, machine_line  # noqa: E402  (bench/timing.py)

MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=64, vocab_size=1000, max_position_embeddings=16384)
def _profiled_split(call) -> dict:
    """CPU seconds of one call in the K/V exchange (backends/context_parallel.py's record_function ranges: the
    all-gathers and the all-reduces of their backward) and in the SDPA kernels, forward and backward; the names
    counted under "attention" too, to check what was matched."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    split, names = {"exchange": 0.0, "attention": 0.0}, []
    for event in prof.key_averages():
        if event.key.startswith("context_parallel.gather"):
            split["exchange"] += event.cpu_time_total / 1e6
        elif event.key == "aten::scaled_dot_product_attention" or (  # forward; backward: the outermost range
                event.key.startswith("autograd::engine::evaluate_function") and "ScaledDotProduct" in event.key):
            split["attention"] += event.cpu_time_total / 1e6
            names.append(event.key)
    return {**split, "attention_ops": names}


def measure_on_worker(worker, length: int, repeats: int) -> dict:
    """On every rank (through Ray's __ray_call__): the worker's own training step on one row of `length`
    tokens; seconds (median after the first call), peak memory of the first call, rank 0's profiled split."""
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(3, MODEL["vocab_size"], (1, length), generator=g),
             "input_lengths": torch.tensor([length]), "token_mask": torch.ones(1, length),
             "sample_mask": torch.ones(1)}
    worker.engine.model.train()

    def step():
        worker._train_step(batch, MeanLogprobLoss(), 1.0, float(length), [[0]], float(length))

    before = resident_bytes()
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    split = _profiled_split(step) if worker.rank == 0 else step() or {}  # every rank steps (collectives)
    return {"seconds": sorted(times)[len(times) // 2], "peak": peak, **split}


def measure(path: str, backend: str, cp: int, length: int, repeats: int, starts: int) -> dict:
    from nemo_grpo.config import ClusterConfig, PolicyConfig
    from nemo_grpo.policy import Policy

    cfg = PolicyConfig(model_name=path, backend=backend, train_global_batch_size=1, train_micro_batch_size=1,
                       logprob_batch_size=1, max_total_sequence_length=length)
    (cfg.megatron_cfg if backend == "megatron" else cfg.dtensor_cfg).context_parallel_size = cp
    cluster = ClusterConfig(gpus_per_node=cp, num_nodes=1, num_threads_per_worker=1)
    peaks = []
    for _ in range(starts):  # the first-call peak varies from one fresh process to the next (the allocator's state)
        with Policy(cfg, cluster, path) as policy:
            ranks = policy.group.run_all("__ray_call__", lambda w: measure_on_worker(w, length, repeats))
        peaks.append(max(r["peak"] for r in ranks))
    return {**ranks[0], "peak": min(peaks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["megatron", "dtensor"], default="megatron")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--starts", type=int, default=2, help="fresh policies per cell: the smallest peak is reported")
    args = ap.parse_args()
    print(machine_line(), flush=True)
    torch.set_num_threads(1)

    import ray

    from nemo_grpo.distributed.cluster import init_ray
    from nemo_grpo.models.tiny import save_tiny_model

    init_ray()
    path = save_tiny_model(tempfile.mkdtemp(prefix="bench_long_"), arch="qwen3", **MODEL)
    rows = []
    for length in args.lengths:
        for cp in (1, 2):
            r = measure(path, args.backend, cp, length, args.repeats, args.starts)
            rows.append((length, cp, r))
            print(f"  {length} tokens, CP={cp}: {r['seconds']:.2f} s, peak {r['peak'] / 2**20:.0f} MiB; attention ops "
                  f"{r['attention_ops']}", flush=True)
    ray.shutdown()
    print(f"\n{args.backend}, Qwen3 hidden 256 x 2 layers, fp32; one training step on one row; median of "
          f"{args.repeats} after the first; 1 thread per process")
    print(f"{'tokens':>6s} {'CP':>3s} {'s/call':>7s} {'tok/s':>7s} {'peak MiB/rank':>13s} {'peak vs CP=1':>12s} "
          f"{'exchange s':>10s} {'attention s':>11s}")
    for length, cp, r in rows:
        ref = next(x for n, c, x in rows if n == length and c == 1)
        print(f"{length:6d} {cp:3d} {r['seconds']:7.2f} {length / r['seconds']:7.0f} {r['peak'] / 2**20:13.0f} "
              f"{r['peak'] / ref['peak']:11.2f}x {r['exchange']:10.3f} {r['attention']:11.3f}")


if __name__ == "__main__":
    main()
