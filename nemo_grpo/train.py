"""GRPO training entry point.

    python -m nemo_grpo.train [--config configs/X.yaml] [--verbose] [section.key=value ...]

With no argument it runs the tiny CPU recipe (configs/grpo_tiny_cpu.yaml's defaults), which learns
single-digit addition in a few minutes on a laptop. The console shows our own progress; third-party output
goes to <logger.log_dir>/run.log and Ray's session logs unless --verbose. Bad input (config, data, output
directories) is one line on stderr and exit status 2; a finished run prints one summary line on stdout.
SIGUSR1 (Slurm's `--signal=B:USR1@120` before a time limit) checkpoints the step under way and exits 0; on a
multi-node Ray cluster a lost node ends the run with one line and exit status 3 (distributed/node_watch.py).
"""

from __future__ import annotations

import argparse
import logging
import sys

from nemo_grpo.config import TOP_LEVEL_SECTIONS
from nemo_grpo.utils.cli import entry_point_parser, log_to_file, resolved_config, run_main
from nemo_grpo.utils.stop_signal import StopSignal
from nemo_grpo.validation import load_config

log = logging.getLogger("nemo_grpo.train")


def parse_args(argv: list[str]) -> argparse.Namespace:
    sections = "\n".join(f"  {name:<14} {text}" for name, text in TOP_LEVEL_SECTIONS.items())
    parser = entry_point_parser(
        "python -m nemo_grpo.train", "YAML recipe (configs/*.yaml); defaults to the tiny CPU recipe",
        "<logger.log_dir>/run.log", "grpo.max_num_steps=10",
        description="GRPO post-training. Override any key with section.key=value.",
        epilog=f"config sections:\n{sections}\n\nexample: python -m nemo_grpo.train grpo.max_num_steps=50 "
               "policy.dtensor_cfg.tensor_parallel_size=2")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_main(train, parse_args(sys.argv[1:] if argv is None else argv))


def train(args: argparse.Namespace) -> int:
    cfg = resolved_config(args, load_config)
    if cfg is None:  # --print-config
        return 0
    # here, not at the top: build imports ray, transformers and the back ends, logger matplotlib and tensorboard;
    # a config error (exit 2) is reported without them
    from nemo_grpo.build import build_trainer
    from nemo_grpo.utils.logger import prepare_log_dir

    log_file = log_to_file(prepare_log_dir(cfg.logger.log_dir), args.verbose)
    with StopSignal():  # a time-limit signal during start-up or close is kept for run(), not fatal
        trainer = build_trainer(cfg, log_to_driver=args.verbose)
        if not args.verbose:
            log.info("third-party log output: %s (--verbose shows it here)", log_file)
        try:
            trainer.run()
        finally:
            trainer.close()
    print(trainer.summary(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
