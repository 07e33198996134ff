"""Evaluation entry point: pass@k, cons@k, response length and truncation of a model on a data set.

    python -m nemo_grpo.eval [--config configs/eval_tiny_cpu.yaml] [--verbose] [section.key=value ...]
    python -m nemo_grpo.eval policy.model_name=results/grpo_tiny/step_400 eval.num_tests_per_prompt=8 \\
        eval.k_value=4 policy.generation.temperature=1.0

policy.model_name is an HF directory, a builtin: model or a training checkpoint's step_N (exported to
<eval.save_path>/model first); data.* are the keys of one training split (data.train.*); generation settings
are policy.generation's (temperature 0: greedy). Writes <eval.save_path>/samples.jsonl (prompt, response,
reward, extracted answer per sample) and summary.json, and prints the table. Bad input is one line on stderr
naming the key, exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from nemo_grpo.utils.cli import entry_point_parser, log_to_file, resolved_config, run_main
from nemo_grpo.validation import load_eval_config

log = logging.getLogger("nemo_grpo.eval")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = entry_point_parser("python -m nemo_grpo.eval", "YAML recipe with eval, policy, data, env and cluster "
                                "sections", "<eval.save_path>/run.log", "eval.num_tests_per_prompt=8",
                                description=__doc__)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_main(evaluate, parse_args(sys.argv[1:] if argv is None else argv))


def evaluate(args: argparse.Namespace) -> int:
    cfg = resolved_config(args, load_eval_config)
    if cfg is None:  # --print-config
        return 0
    # here, not at the top: build imports ray, transformers and the engines; a config error is reported without
    from nemo_grpo.build import build_evaluator
    from nemo_grpo.utils.logger import prepare_log_dir

    log_to_file(prepare_log_dir(cfg.eval.save_path, "eval.save_path"), args.verbose)
    if cfg.eval.num_tests_per_prompt > 1 and cfg.policy.generation.temperature == 0:
        log.warning("eval.num_tests_per_prompt=%d with policy.generation.temperature=0 (greedy): the samples of a "
                    "prompt are alike", cfg.eval.num_tests_per_prompt)
    evaluator = build_evaluator(cfg, log_to_driver=args.verbose)
    try:
        evaluator.run()
    finally:
        evaluator.close()
    samples_path, summary_path = evaluator.write()
    print(evaluator.table(), flush=True)
    print(f"samples {samples_path} | summary {summary_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
