"""Helpers of the end-to-end tests: the entry points run as a user runs them, in a fresh process, and their logs.

    from train_runs import builtin_model_cache, read_metrics, run_train  # noqa: F401 (autouse fixture)
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", autouse=True)
def builtin_model_cache(tmp_path_factory):
    """The warm-started built-in model is built once for the importing module's runs (NEMO_GRPO_CACHE)."""
    old = os.environ.get("NEMO_GRPO_CACHE")
    os.environ["NEMO_GRPO_CACHE"] = str(tmp_path_factory.mktemp("nemo_grpo_cache"))
    yield
    if old is None:
        os.environ.pop("NEMO_GRPO_CACHE")
    else:
        os.environ["NEMO_GRPO_CACHE"] = old


def run_module(module: str, tmp_path, *overrides, config: str = None, timeout: int = 1500):
    """`python -m <module> [--config X] ...` in a fresh process (its own Ray cluster), as a user runs it; logs
    and checkpoints under tmp_path. Returns the finished process (stdout, stderr as text)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    args = (["--config", config] if config else []) + [
        f"checkpointing.checkpoint_dir={tmp_path}/ckpt", f"logger.log_dir={tmp_path}/logs", *overrides]
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, timeout=timeout,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def run_train(tmp_path, *overrides, config: str = None, timeout: int = 1500):
    return run_module("nemo_grpo.train", tmp_path, "logger.progress_bar=false", *overrides, config=config,
                      timeout=timeout)


def read_metrics(log_dir, prefix):
    """The rows of log_dir/metrics.jsonl logged under `prefix` ("train", "val", "timing"), in order."""
    rows = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    return [r for r in rows if r["prefix"] == prefix]


# the line a finished `python -m nemo_grpo.train` prints last on stdout (GRPOTrainer.summary)
SUMMARY = re.compile(r"done: (?P<steps>\d+) steps(?: \(resumed at step (?P<resumed_at>\d+)\))?"
                     r"(?: \| reward (?P<first>[\d.]+) -> (?P<last>[\d.]+))?"
                     r"(?: \| best val:accuracy (?P<best>[\d.]+) at step (?P<best_step>\d+))?"
                     r" \| checkpoint (?P<checkpoint>\S+)(?: \([^)]*\))?(?: \| plot (?P<plot>\S+))?")
# Ray's prefix on a line a worker printed, forwarded to the driver: "(VllmGenerationWorker pid=4584) ..."
WORKER_LINE = re.compile(r"^\S*\((\w+) pid=\d+\)", re.MULTILINE)


def summary(proc) -> dict:
    """The fields of the run's summary line (the last line on stdout); an AssertionError if there is none."""
    lines = proc.stdout.strip().splitlines()
    match = SUMMARY.fullmatch(lines[-1]) if lines else None
    assert match, "no summary line at the end of stdout:\n" + proc.stdout[-2000:]
    return match.groupdict()


def assert_quiet_console(proc) -> None:
    """Without --verbose the console carries no forwarded worker output (it stays in Ray's session logs)."""
    forwarded = WORKER_LINE.findall(proc.stderr + proc.stdout)
    assert not forwarded, f"worker output on the console from {sorted(set(forwarded))}:\n" + proc.stderr[-3000:]
