"""Bradley-Terry reward-model training on either back end (the loop: nemo_grpo/algorithms/reward_model.py).

    python -m nemo_grpo.train_rm --config configs/rm_tiny_cpu.yaml [section.key=value ...]

Data: JSONL preference pairs (nemo_grpo/data/preferences.py: "chosen"/"rejected" as chat messages, or strings
with a "prompt"), or builtin:addition. The trained model lands in `rm.output_dir/hf`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

from nemo_grpo.utils.cli import run_main


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_grpo.train_rm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML recipe (e.g. configs/rm_tiny_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rm.max_num_steps=10")
    return run_main(train_rm, parser.parse_args(sys.argv[1:] if argv is None else argv))


def train_rm(args: argparse.Namespace) -> int:
    # here, not at the top: reward_model imports ray and transformers, validation torch; --help and argument
    # errors are answered without them
    from nemo_grpo.algorithms.reward_model import RewardModelTrainer
    from nemo_grpo.validation import load_rm_train_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_rm_train_config(args.config, args.overrides)
    trainer = RewardModelTrainer(cfg)
    try:
        val = trainer.run()
    finally:
        trainer.close()
    print(f"reward model saved to {os.path.join(cfg.rm.output_dir, 'hf')}; validation {val}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
