"""Expert parallelism on Megatron: one training step and one log-prob pass of a small Qwen3-MoE, EP=1 vs EP=2.

    python bench/moe.py                                   # 8 rows x 256 tokens, median of 3 calls after the first
    python bench/moe.py --rows 8 --tokens 512 --repeats 5

The model: a Qwen3-MoE of hidden 512, 2 layers, 8 heads of 64 (4 KV heads), 16 experts of FFN 512, top-2 with the
top-k weights renormalised, every layer sparse, vocabulary 1,000, random weights, fp32; the router losses on
(aux_loss 0.01, backends/router.py). Both layouts run 2 worker processes (gloo, one torch thread each): EP=1 is
dp 2 (every rank holds the 16 experts; Megatron's alltoall dispatcher skips its all-to-all over a group of one),
EP=2 is dp 2 x ep 2 (each rank holds 8 experts and exchanges tokens with the other all-to-all). Each rank takes
half the rows. A call runs in every worker (through Ray's __ray_call__): the worker's own training step (forward,
loss, backward, gradient reduction, Adam step) or its get_logprobs (forward only, in chunks of --rows / 2 rows).
Per cell: the median wall time of --repeats calls after the first, tokens/s over both ranks, and each rank's
memory: its peak resident set (ru_maxrss, the whole process: Python, torch, weights, Adam state) and that peak
above the resident set before the first training call (activations, gradients, Adam state). "all-to-all" and
"experts" split one profiled call on rank 0 (torch.profiler, record_function ranges, as shares of that call's
wall time): the all-to-all collectives of token dispatch and combine, forward and backward (ranges around
torch.distributed.all_to_all_single: the exchange and the wait for the other rank), against the experts (ranges
opened by hooks on Megatron's SequentialMLP: its forward, and its backward from the gradient of its output to
that of its input); "all-reduce": the gradient sums over the data-parallel ranks (torch.distributed.all_reduce;
at EP=2 the experts' gradients have no other rank to be summed with). On 2 CPU cores the all-to-all is a gloo
exchange in shared memory plus the wait for the other rank; on GPUs it would be NVLink / InfiniBand traffic:
read the shares as this machine's.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import resource  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from timing import MeanLogprobLoss, resident_bytes, machine_line  # noqa: E402  (bench/timing.py)
from nemo_grpo.backends.batching import fixed_size_groups  # noqa: E402
from nemo_grpo.batch import StepBatch  # noqa: E402

MODEL = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             num_experts=16, num_experts_per_tok=2, moe_intermediate_size=512, vocab_size=1000,
             max_position_embeddings=4096)


def _expert_ranges(model) -> list:
    """record_function ranges "moe.experts" around every SequentialMLP's forward and backward (module hooks)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    handles = []
    for module in (m for m in model.modules() if isinstance(m, SequentialMLP)):
        box = {}

        def open_range(key, *args, box=box):
            box[key] = torch.autograd.profiler.record_function(f"moe.experts.{key}")
            box[key].__enter__()

        def close_range(key, *args, box=box):
            box.pop(key).__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(lambda *a, o=open_range: o("forward")),
                    module.register_forward_hook(lambda *a, c=close_range: c("forward")),
                    module.register_full_backward_pre_hook(lambda *a, o=open_range: o("backward")),
                    module.register_full_backward_hook(lambda *a, c=close_range: c("backward"))]
    return handles


@contextlib.contextmanager
def _collective_ranges():
    """record_function ranges "collective.<name>" around torch.distributed's all_to_all_single (Megatron's token
    dispatch and combine, and their backward) and all_reduce (the gradient sums), the wait for the peer included
    (the c10d ops' own events end before it)."""
    saved = {name: getattr(dist, name) for name in ("all_to_all_single", "all_reduce")}

    def ranged(name, fn):
        def call(*args, **kwargs):
            with torch.autograd.profiler.record_function(f"collective.{name}"):
                return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, ranged(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _profiled_split(worker, call) -> dict:
    """CPU seconds of one call in the all-to-all collectives, in the experts (forward + backward) and in the
    all-reduces (the gradient sums), with the wall seconds of that call; the op names counted as all-to-all,
    to check what was matched."""
    handles = _expert_ranges(worker.engine.model)
    start = time.perf_counter()
    with _collective_ranges(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    wall = time.perf_counter() - start
    for h in handles:
        h.remove()
    split, calls = {"alltoall": 0.0, "experts": 0.0, "allreduce": 0.0}, {}
    for event in prof.key_averages():
        name = {"collective.all_to_all_single": "alltoall", "collective.all_reduce": "allreduce"}.get(event.key)
        if name is None and event.key.startswith("moe.experts."):
            name = "experts"
        if name is not None:
            split[name] += event.cpu_time_total / 1e6
            calls[event.key] = event.count
    return {**split, "profiled_wall": wall, "calls": calls}


def measure_on_worker(worker, rows: int, tokens: int, repeats: int) -> dict:
    """On every rank: this rank's half of the rows through the worker's own training step and get_logprobs;
    seconds (median after the first call), memory, and rank 0's profiled splits."""
    g = torch.Generator().manual_seed(1 + worker.rank)
    batch = StepBatch(torch.randint(3, MODEL["vocab_size"], (rows, tokens), generator=g),
                      torch.full((rows,), tokens), torch.ones(rows, tokens), torch.ones(rows)).rows()
    total_rows = rows * worker.engine.dp_size
    worker.hold("bench", batch)  # as Policy.ship would

    def train():
        worker.engine.model.train()
        groups = fixed_size_groups(rows, worker.cfg.train_micro_batch_size)
        worker._train_step(batch, MeanLogprobLoss(), float(total_rows), float(total_rows * tokens), groups,
                           float(total_rows * tokens))

    def logprobs():
        worker.get_logprobs("bench", fixed_size_groups(rows, worker.cfg.logprob_batch_size))

    before = resident_bytes()
    out = {}
    for name, call in (("train", train), ("logprobs", logprobs)):
        call()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        out[name] = {"seconds": sorted(times)[len(times) // 2]}
        if worker.rank == 0:
            out[name].update(_profiled_split(worker, call))
        else:
            call()  # every rank runs the profiled call too (collectives)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {**out, "peak": peak, "step_peak": peak - before, "experts": _local_experts(worker)}


def _local_experts(worker) -> int:
    return sum(1 for n in worker.engine.params if n.startswith("decoder.layers.0.mlp.experts.") and n.endswith("fc1.weight"))


def measure(path: str, ep: int, rows: int, tokens: int, repeats: int) -> dict:
    from nemo_grpo.config import ClusterConfig, PolicyConfig
    from nemo_grpo.policy import Policy

    cfg = PolicyConfig(model_name=path, backend="megatron", train_global_batch_size=rows, train_micro_batch_size=2,
                       logprob_batch_size=rows // 2, max_total_sequence_length=tokens)
    m = cfg.megatron_cfg
    m.expert_model_parallel_size, m.moe_router_load_balancing_type, m.moe_aux_loss_coeff = ep, "aux_loss", 0.01
    cluster = ClusterConfig(gpus_per_node=2, num_nodes=1, num_threads_per_worker=1)
    with Policy(cfg, cluster, path) as policy:
        return policy.group.run_all("__ray_call__", lambda w: measure_on_worker(w, rows // 2, tokens, repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8, help="rows per call over both ranks (even)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per row")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(machine_line(), flush=True)
    torch.set_num_threads(1)

    import ray

    from nemo_grpo.distributed.cluster import init_ray
    from nemo_grpo.models.tiny import save_tiny_model

    init_ray()
    path = save_tiny_model(tempfile.mkdtemp(prefix="bench_moe_"), arch="qwen3_moe", **MODEL)
    results = {}
    for ep in (1, 2):
        ranks = measure(path, ep, args.rows, args.tokens, args.repeats)
        results[ep] = ranks
        print(f"  EP={ep}: experts per rank {[r['experts'] for r in ranks]}; ranges in one training step "
              f"(calls): {ranks[0]['train']['calls']}", flush=True)
    ray.shutdown()
    n = args.rows * args.tokens
    print(f"\nMegatron, Qwen3-MoE hidden 512 x 2 layers, 16 experts top-2, fp32; {args.rows} rows x {args.tokens} "
          f"tokens over 2 ranks (dp 2); median of {args.repeats} after the first; 1 thread per process")
    print(f"{'pass':>8s} {'EP':>3s} {'s/call':>7s} {'tok/s':>7s} {'vs EP=1':>7s} {'all-to-all':>10s} "
          f"{'experts':>8s} {'all-reduce':>10s} {'peak MiB/rank':>14s} {'step MiB/rank':>14s}")
    for name in ("train", "logprobs"):
        for ep in (1, 2):
            r0, ref = results[ep][0][name], results[1][0][name]
            peaks = "/".join(f"{r['peak'] / 2**20:.0f}" for r in results[ep])
            steps = "/".join(f"{r['step_peak'] / 2**20:.0f}" for r in results[ep])
            share = {k: r0[k] / r0["profiled_wall"] for k in ("alltoall", "experts", "allreduce")}
            print(f"{name:>8s} {ep:3d} {r0['seconds']:7.2f} {n / r0['seconds']:7.0f} "
                  f"{ref['seconds'] / r0['seconds']:6.2f}x {share['alltoall']:10.1%} {share['experts']:8.1%} "
                  f"{share['allreduce']:10.1%} {peaks:>14s} {steps:>14s}")


if __name__ == "__main__":
    main()
