"""Memory and layout planner: per-GPU memory of every role of a recipe on its cluster, before a cluster is spent.

    python -m nemo_grpo.plan --config configs/grpo_math_70B_megatron.yaml [section.key=value ...]

Model directories need not exist yet: the planner reads their config.json, or the published config of a known
model matched on the directory's name (nemo_grpo/planning/params.py). Exit status 0 when every GPU fits
cluster.gpu_memory_gib, 1 when one does not (the reasons, with the numbers, on stderr), 2 for a bad config.
"""

from __future__ import annotations

import argparse
import sys

from nemo_grpo.distributed.resource_plan import plan_resources
from nemo_grpo.utils.cli import run_main
from nemo_grpo.validation import load_config


def plan_recipe(path: str | None, overrides: list[str]):
    """(config, resource plan, memory plan) of a recipe; ConfigError for a bad one. No file needs to exist
    but the recipe."""
    from nemo_grpo.planning.memory import plan_memory  # here, not at the top: it imports transformers (~1 s)

    cfg = load_config(path, overrides, files=False)
    resources = plan_resources(cfg)
    return cfg, resources, plan_memory(cfg, resources)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_grpo.plan", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML recipe (configs/*.yaml); defaults to the tiny CPU recipe")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. cluster.num_nodes=16")
    return run_main(plan, parser.parse_args(sys.argv[1:] if argv is None else argv))


def plan(args: argparse.Namespace) -> int:
    cfg, resources, memory = plan_recipe(args.config, args.overrides)
    c = cfg.cluster
    print(f"cluster: {c.num_nodes} node(s) x {c.gpus_per_node} GPUs of {c.gpu_memory_gib:g} GiB\n"
          f"{resources.describe()}\n\n{memory.table()}")
    problems = memory.problems()
    for p in problems:
        print(f"does not fit: {p}", file=sys.stderr)
    if not problems:
        print("\nevery GPU fits")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
