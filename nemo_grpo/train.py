"""GRPO training entry point.

    python -m nemo_grpo.train [--config configs/X.yaml] [section.key=value ...]

With no argument it runs the tiny CPU recipe (configs/grpo_tiny_cpu.yaml's defaults), which learns
single-digit addition in a few minutes on a laptop.
"""

from __future__ import annotations

import argparse
import logging
import sys

from nemo_grpo.config import TOP_LEVEL_SECTIONS, ConfigError
from nemo_grpo.validation import load_config


def parse_args(argv: list[str]) -> argparse.Namespace:
    sections = "\n".join(f"  {name:<14} {text}" for name, text in TOP_LEVEL_SECTIONS.items())
    parser = argparse.ArgumentParser(
        prog="python -m nemo_grpo.train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="GRPO post-training. Override any key with section.key=value.",
        epilog=f"config sections:\n{sections}\n\nexample: python -m nemo_grpo.train grpo.max_num_steps=50 "
               "policy.dtensor_cfg.tensor_parallel_size=2")
    parser.add_argument("--config", help="YAML recipe (configs/*.yaml); defaults to the tiny CPU recipe")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.max_num_steps=10")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        from nemo_grpo.config import to_yaml

        print(to_yaml(cfg))
        return 0
    from nemo_grpo.build import build_trainer

    trainer = build_trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
