"""Forward + backward (+ optimizer step) time of a ~20M-parameter model per parallel layout, both back ends.

    python bench/policy_layouts.py                 # Megatron TP=1, TP=2, PP=2, DP=2 and DTensor DP=2, TP=2
    python bench/policy_layouts.py --only megatron:tp1 megatron:pp2 --repeats 5

The model: a Qwen2 of hidden 512, 6 layers, 8 heads of 64, FFN 1536 (20.4M parameters without the tiny
vocabulary), random weights, fp32. One `policy.train` call = one optimizer step over --batch sequences of
--seq-len tokens in micro-batches of --micro (PP=2 pipelines them with 1F1B); the figure is the median wall
time of --repeats calls after one warm-up, measured at the driver (Ray dispatch included, a few ms), with
the training tokens per second. Every worker runs one torch thread; on 2 cores the 2-process layouts pay for
gloo collectives that a GPU would not, so read the ratios as this machine's, not a GPU's.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import argparse  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
from timing import median_seconds  # noqa: E402  (bench/timing.py)

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
             num_key_value_heads=8, head_dim=64, max_position_embeddings=1024)


class MeanLogprobLoss:
    """-(mean log-prob of the masked tokens): any differentiable loss does for timing."""

    def __call__(self, logprobs, mb, global_valid_seqs, global_valid_toks):
        loss = -(logprobs * mb["token_mask"]).sum() / global_valid_toks
        return loss, {}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4, help="micro-batch per rank (DP layouts: half of it)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)

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
