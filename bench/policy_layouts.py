"""Forward + backward (+ optimizer step) time of a ~20M-parameter model per parallel layout, both back ends.

    python bench/policy_layouts.py                 # Megatron TP=1, TP=2, PP=2, DP=2 and DTensor DP=2, TP=2
    python bench/policy_layouts.py --only megatron:tp1 megatron:pp2 --repeats 5
    python bench/policy_layouts.py --attention     # Megatron core attention: unfused vs SDPA at 512 and 2,048 tokens

The model: a Qwen2 of hidden 512, 6 layers, 8 heads of 64, FFN 1536 (20.4M parameters without the tiny
vocabulary), random weights, fp32. One `policy.train` call = one optimizer step over --batch sequences of
--seq-len tokens in micro-batches of --micro (PP=2 pipelines them with 1F1B); the figure is the median wall
time of --repeats calls after one warm-up, measured at the driver (Ray dispatch included, a few ms), with
the training tokens per second. Every worker runs one torch thread; on 2 cores the 2-process layouts pay for
gloo collectives that a GPU would not, so read the ratios as this machine's, not a GPU's.

--attention: the same model's Megatron-Core GPTModel (TP=1, local spec) with each core attention
(policy.megatron_cfg.attention_backend: Megatron's unfused DotProductAttention, or SDPA), forward + backward of
2,048 tokens per call (4 x 512 or 1 x 2,048) in a fresh process each: tokens/s (median of --repeats after a
warm-up) and the peak memory above the built model: torch.cuda.max_memory_allocated on a GPU, the process's
peak resident set (ru_maxrss) less its resident set before the first call on a CPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
from timing import MeanLogprobLoss, median_seconds, machine_line  # noqa: E402  (bench/timing.py)

LAYOUTS = {  # name -> (backend, world size, policy overrides)
    "megatron:tp1": ("megatron", 1, {}),
    "megatron:tp2": ("megatron", 2, {"tensor_model_parallel_size": 2}),
    "megatron:tp2_sp": ("megatron", 2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "megatron:pp2": ("megatron", 2, {"pipeline_model_parallel_size": 2}),
    "megatron:dp2": ("megatron", 2, {}),
    "dtensor:dp2": ("dtensor", 2, {}),
    "dtensor:tp2": ("dtensor", 2, {"tensor_parallel_size": 2}),
}
MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=8, head_dim=64, max_position_embeddings=2048)


def make_batch(n: int, t: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(3, vocab, (n, t), generator=g), "input_lengths": torch.full((n,), t),
            "token_mask": torch.ones(n, t), "sample_mask": torch.ones(n)}


def time_train_steps(cfg, cluster, path: str, batch: dict, repeats: int, warmup: int = 1) -> dict:
    """Median seconds of a `Policy.train(batch)` call (one optimizer step when batch is one global batch) after
    `warmup` calls, with the workers' devices ("cuda:0" | "cpu", by rank) and process-group backend."""
    from nemo_grpo.policy import Policy

    with Policy(cfg, cluster, path) as policy:
        for _ in range(warmup):
            policy.train(batch, MeanLogprobLoss())
        seconds = median_seconds(lambda: policy.train(batch, MeanLogprobLoss()), repeats)
        return {"seconds": seconds, "devices": policy.devices, "dist_backend": policy.dist_backend}


def time_layout(name: str, path: str, args) -> dict:
    from nemo_grpo.config import ClusterConfig, PolicyConfig

    backend, world, overrides = LAYOUTS[name]
    cfg = PolicyConfig(model_name=path, backend=backend, train_global_batch_size=args.batch,
                       train_micro_batch_size=args.micro if world == 1 or "dp" not in name else args.micro // 2,
                       logprob_batch_size=args.micro, max_total_sequence_length=args.seq_len)
    for key, value in overrides.items():
        setattr(cfg.megatron_cfg if backend == "megatron" else cfg.dtensor_cfg, key, value)
    cluster = ClusterConfig(gpus_per_node=world, num_nodes=1, num_threads_per_worker=1)
    batch = make_batch(args.batch, args.seq_len, vocab=50)
    s = time_train_steps(cfg, cluster, path, batch, args.repeats)["seconds"]
    return {"seconds": s, "tok_per_s": args.batch * args.seq_len / s, "world": world}


ATTENTION_CHILD = r"""
import json, resource, sys, time, torch
import torch.distributed as dist
torch.set_num_threads(1)
attention, batch, seq_len, repeats, model = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
    json.loads(sys.argv[5])
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
from types import SimpleNamespace
from megatron.core import parallel_state as ps, tensor_parallel
from transformers import Qwen2Config
from nemo_grpo.backends.mcore import model as mmodel, shim
from nemo_grpo.models.spec import model_spec
shim.apply()
with shim.device_context():
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
spec = model_spec(Qwen2Config(vocab_size=1000, **model, architectures=["Qwen2ForCausalLM"]))
layout = SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, sequence_parallel=False,
                         activation_checkpointing=False)
dtype = torch.bfloat16 if cuda else torch.float32
with shim.device_context():
    gpt = mmodel.build_gpt(spec, mmodel.transformer_config(spec, layout, dtype), attention)
device = "cuda" if cuda else "cpu"
gpt = gpt.to(device)
for p in gpt.parameters():
    torch.nn.init.normal_(p, std=0.02)
ids = torch.randint(0, 1000, (batch, seq_len), device=device)
pos = torch.arange(seq_len, device=device)[None].expand(batch, seq_len)
def step():
    gpt(input_ids=ids, position_ids=pos, attention_mask=None).float().mean().backward()
    if cuda:
        torch.cuda.synchronize()
rss_before = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
if cuda:
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
step()
peak = torch.cuda.max_memory_allocated() - base if cuda else \
    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
times = []
for _ in range(repeats):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
print(json.dumps({"seconds": sorted(times)[len(times) // 2], "peak": peak, "device": device,
                  "dtype": str(dtype)}))
"""


def attention_table(args) -> None:
    """Unfused vs SDPA core attention at 512 and 2,048 tokens per sequence (2,048 tokens per call), one fresh
    process per cell: tokens/s and peak memory, SDPA's ratios to unfused."""
    rows = []
    for batch, seq_len in ((4, 512), (1, 2048)):
        cells = {}
        for attention in ("unfused", "sdpa"):
            proc = subprocess.run([sys.executable, "-c", ATTENTION_CHILD, attention, str(batch), str(seq_len),
                                   str(args.repeats), json.dumps(MODEL)], capture_output=True, text=True,
                                  env=dict(os.environ, OMP_NUM_THREADS="1"))
            if proc.returncode:
                raise SystemExit(f"{attention} at {seq_len} tokens failed:\n{proc.stderr[-3000:]}")
            cells[attention] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"  {attention} {batch} x {seq_len}: {cells[attention]['seconds']:.3f} s", flush=True)
        rows.append((batch, seq_len, cells))
    cell = rows[0][2]["sdpa"]
    print(f"\nMegatron-Core GPTModel TP=1 (the Qwen2 above), {cell['dtype']} on "
          f"{cell['device']}: forward + backward of 2,048 tokens; median of {args.repeats} after a warm-up")
    print(f"{'seq len':>7s} {'attention':>9s} {'s/call':>8s} {'tok/s':>8s} {'peak MiB':>9s} {'tok/s vs unfused':>17s} "
          f"{'peak vs unfused':>16s}")
    for batch, seq_len, cells in rows:
        for name, c in cells.items():
            ref = cells["unfused"]
            print(f"{seq_len:7d} {name:>9s} {c['seconds']:8.3f} {batch * seq_len / c['seconds']:8.0f} "
                  f"{c['peak'] / 2**20:9.0f} {ref['seconds'] / c['seconds']:16.2f}x {c['peak'] / ref['peak']:15.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4, help="micro-batch per rank (DP layouts: half of it)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--attention", action="store_true", help="only the unfused vs SDPA core-attention table")
    args = ap.parse_args()
    print(machine_line(), flush=True)
    torch.set_num_threads(1)
    if args.attention:
        return attention_table(args)

    import ray

    from nemo_grpo.distributed.cluster import init_ray
    from nemo_grpo.models.tiny import save_tiny_model

    init_ray()
    path = save_tiny_model(tempfile.mkdtemp(prefix="bench_20m_"), arch="qwen2", **MODEL)
    params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(path).parameters())
    rows = {}
    for name in args.only:
        rows[name] = time_layout(name, path, args)
        print(f"  {name}: {rows[name]['seconds']:.3f} s/step", flush=True)
    ray.shutdown()
    ref = rows.get("megatron:tp1")
    print(f"\nQwen2 {params / 1e6:.1f}M parameters, fp32; one optimizer step over {args.batch} x {args.seq_len} "
          f"tokens, micro-batch {args.micro}; median of {args.repeats} after a warm-up; 1 thread per process")
    print(f"{'layout':18s} {'procs':>5s} {'s/step':>8s} {'tok/s':>8s}" + (f" {'vs megatron:tp1':>16s}" if ref else ""))
    for name, r in rows.items():
        line = f"{name:18s} {r['world']:5d} {r['seconds']:8.3f} {r['tok_per_s']:8.0f}"
        print(line + (f" {r['seconds'] / ref['seconds']:15.2f}x" if ref else ""))


if __name__ == "__main__":
    main()
