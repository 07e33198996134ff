"""Reward-model scoring throughput (sequences/s) and parity with Hugging Face, per back end and layout.

    python bench/score_throughput.py                  # DTensor and Megatron at TP=1 and TP=2, tiny Qwen2 RM
    python bench/score_throughput.py --hidden 512 --layers 6 --seqs 256 --seq-len 128

The model is a randomly initialized Qwen2 sequence classifier (num_labels 1); the batch is --seqs right-padded
sequences of mixed lengths up to --seq-len, scored through Policy.score in chunks of --batch-size per
data-parallel rank (as the reward-model environment does). Figures: median of --repeats calls after one
warm-up, measured at the driver (Ray dispatch included), and the largest |score - HF score| over the batch.
One torch thread per process.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import argparse  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
from timing import median_seconds, machine_line  # noqa: E402  (bench/timing.py)

LAYOUTS = {"dtensor:tp1": ("dtensor", 1), "dtensor:tp2": ("dtensor", 2),
           "megatron:tp1": ("megatron", 1), "megatron:tp2": ("megatron", 2)}


def make_batch(n: int, t: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(t // 4, t + 1, (n,), generator=g)
    ids = torch.randint(3, vocab, (n, t), generator=g) * (torch.arange(t)[None, :] < lengths[:, None])
    return {"input_ids": ids, "input_lengths": lengths}


def hf_scores(path: str, batch: dict) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids, n in zip(batch["input_ids"], batch["input_lengths"].tolist()):
            out.append(model(input_ids=ids[None, :n]).logits[0, 0])
    return torch.stack(out)


def time_layout(name: str, path: str, batch: dict, args) -> dict:
    from nemo_grpo.config import ClusterConfig, RewardModelEnvConfig
    from nemo_grpo.policy import Policy

    backend, tp = LAYOUTS[name]
    cfg = RewardModelEnvConfig(model_name=path, batch_size=args.batch_size, backend=backend)
    cfg.dtensor_cfg.tensor_parallel_size = tp if backend == "dtensor" else 1
    cfg.megatron_cfg.tensor_model_parallel_size = tp if backend == "megatron" else 1
    with Policy(cfg.policy_config(), ClusterConfig(gpus_per_node=tp, num_nodes=1), path,
                scalar_head=True) as policy:
        scores = policy.score(batch)  # warm-up, and the parity check
        seconds = median_seconds(lambda: policy.score(batch), args.repeats)
    return {"seconds": seconds, "scores": scores, "procs": tp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(machine_line(), flush=True)
    torch.set_num_threads(1)

    import ray

    from nemo_grpo.distributed.cluster import init_ray
    from nemo_grpo.models.tiny import save_tiny_model

    init_ray()
    path = save_tiny_model(tempfile.mkdtemp(prefix="bench_rm_"), arch="qwen2", scalar_head=True,
                           hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                           num_attention_heads=args.hidden // 32, num_key_value_heads=args.hidden // 32,
                           max_position_embeddings=max(128, args.seq_len))
    batch = make_batch(args.seqs, args.seq_len, vocab=50)
    reference = hf_scores(path, batch)
    rows = {name: time_layout(name, path, batch, args) for name in args.only}
    ray.shutdown()
    ref = rows.get("dtensor:tp1")
    print(f"\nQwen2 RM hidden {args.hidden}, {args.layers} layers, fp32; {args.seqs} sequences of <= {args.seq_len} "
          f"tokens, {args.batch_size} per forward; median of {args.repeats}; 1 thread per process")
    print(f"{'layout':14s} {'procs':>5s} {'seq/s':>8s} {'vs dtensor:tp1':>15s} {'max |score - HF|':>17s}")
    for name, r in rows.items():
        ratio = f"{(args.seqs / r['seconds']) / (args.seqs / ref['seconds']):14.2f}x" if ref else f"{'-':>15s}"
        diff = (r["scores"] - reference).abs().max().item()
        print(f"{name:14s} {r['procs']:5d} {args.seqs / r['seconds']:8.0f} {ratio} {diff:17.2e}")


if __name__ == "__main__":
    main()
