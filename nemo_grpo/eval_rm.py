"""Reward-model evaluation on preference pairs: accuracy per subset (the reward-bench layout), on either back end.

    python -m nemo_grpo.eval_rm --model results/rm_tiny/hf --data pairs.jsonl
    python -m nemo_grpo.eval_rm --model DIR --data pairs.jsonl --backend megatron --tensor-parallel-size 2 --gpus 2

A pair is right when the chosen response scores higher than the rejected one. Rows: {"prompt", "chosen",
"rejected", "subset"} (or chat-message lists, nemo_grpo/data/preferences.py); "builtin:addition" generates
the default task's pairs. Scores come from the same `Policy.score` the reward-model environment uses.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import defaultdict
from typing import Optional


def evaluate(env_cfg, pairs: list[dict], num_workers: int = 1) -> dict[str, tuple[float, int]]:
    """env.reward_model-style config + preference pairs -> {subset: (accuracy, pairs)}, plus "all"."""
    from nemo_grpo.algorithms.reward_model import pair_accuracy
    from nemo_grpo.config import ClusterConfig
    from nemo_grpo.data.preferences import render_conversation, right_padded
    from nemo_grpo.envs.reward_model_env import reward_model_policy_config, reward_model_tokenizer
    from nemo_grpo.policy import Policy

    tokenizer, pad = reward_model_tokenizer(env_cfg)
    rows = [render_conversation(tokenizer, p[side], env_cfg.max_model_len)[0] for p in pairs
            for side in ("chosen", "rejected")]
    cluster = ClusterConfig(gpus_per_node=num_workers, num_nodes=1)
    with Policy(reward_model_policy_config(env_cfg), cluster, env_cfg.model_name, scalar_head=True,
                name="reward_model") as policy:
        scores = policy.score(right_padded(rows, pad))  # [2P]: chosen, rejected, ...
    right: dict[str, list[float]] = defaultdict(list)
    for pair, won in zip(pairs, pair_accuracy(scores).tolist()):
        right[pair["subset"]].append(float(won))
        right["all"].append(float(won))
    return {subset: (sum(v) / len(v), len(v)) for subset, v in sorted(right.items())}


def main(argv: Optional[list[str]] = None) -> int:
    from nemo_grpo.config import RewardModelEnvConfig
    from nemo_grpo.data.datasets import DataError
    from nemo_grpo.data.preferences import read_preference_pairs
    from nemo_grpo.distributed.cluster import init_ray

    ap = argparse.ArgumentParser(prog="python -m nemo_grpo.eval_rm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local HF directory of the reward model")
    ap.add_argument("--data", required=True, help="JSONL of preference pairs (or builtin:addition)")
    ap.add_argument("--backend", choices=["dtensor", "megatron"], default="dtensor")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--pipeline-parallel-size", type=int, default=1, help="megatron only")
    ap.add_argument("--gpus", type=int, default=1, help="worker processes (devices)")
    ap.add_argument("--precision", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=4096)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING)
    cfg = RewardModelEnvConfig(model_name=args.model, precision=args.precision, batch_size=args.batch_size,
                               max_model_len=args.max_len, backend=args.backend)
    cfg.dtensor_cfg.tensor_parallel_size = args.tensor_parallel_size if args.backend == "dtensor" else 1
    cfg.megatron_cfg.tensor_model_parallel_size = args.tensor_parallel_size if args.backend == "megatron" else 1
    cfg.megatron_cfg.pipeline_model_parallel_size = args.pipeline_parallel_size
    try:
        pairs = read_preference_pairs(args.data)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    init_ray()
    results = evaluate(cfg, pairs, num_workers=args.gpus)
    print(f"{'subset':32s} {'pairs':>6s} {'accuracy':>9s}   ({args.model}, {args.backend}, "
          f"tp={args.tensor_parallel_size}, pp={args.pipeline_parallel_size})")
    for subset, (acc, n) in results.items():
        print(f"{subset:32s} {n:6d} {acc:9.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
