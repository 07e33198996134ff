"""Reward-model evaluation on preference pairs: accuracy per subset (the reward-bench layout), on either back end.

    python -m nemo_grpo.eval_rm reward_model.model_name=results/rm_tiny/hf data_path=pairs.jsonl
    python -m nemo_grpo.eval_rm reward_model.model_name=DIR data_path=pairs.jsonl reward_model.backend=megatron \\
        reward_model.megatron_cfg.tensor_model_parallel_size=2 reward_model.resources.gpus_per_node=2

The `reward_model` section is the reward-model environment's (env.reward_model: back end, layout, precision,
batch_size, max_model_len; its resources are the devices, worker processes on a CPU); a recipe may hold it
(--config). A pair is right when the chosen response scores higher than the rejected one. Rows: {"prompt",
"chosen", "rejected", "subset"} (or chat-message lists, nemo_grpo/data/preferences.py); "builtin:addition"
generates the default task's pairs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from nemo_grpo.utils.cli import run_main


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_grpo.eval_rm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML with a reward_model section (and data_path)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reward_model.model_name=DIR")
    return run_main(eval_rm, parser.parse_args(sys.argv[1:] if argv is None else argv))


def eval_rm(args: argparse.Namespace) -> int:
    # here, not at the top: these import ray, transformers and torch; --help and argument errors are answered
    # without them
    from nemo_grpo.algorithms.reward_model import evaluate
    from nemo_grpo.backends.registry import backend_spec
    from nemo_grpo.data.preferences import read_preference_pairs
    from nemo_grpo.distributed.cluster import init_ray
    from nemo_grpo.validation import load_rm_eval_config

    logging.basicConfig(level=logging.WARNING)
    cfg = load_rm_eval_config(args.config, args.overrides)
    pairs = read_preference_pairs(cfg.data_path)
    r = cfg.reward_model
    init_ray()
    results = evaluate(r, pairs, num_workers=(r.resources.gpus_per_node or 1) * (r.resources.num_nodes or 1))
    layout = backend_spec(r.backend).describe(r)
    print(f"{'subset':32s} {'pairs':>6s} {'accuracy':>9s}   ({r.model_name}, {r.backend}, {layout})")
    for subset, (acc, n) in results.items():
        print(f"{subset:32s} {n:6d} {acc:9.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
