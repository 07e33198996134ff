"""Helpers of the end-to-end tests: the entry points run as a user runs them (a fresh process) or in this
process on the session's Ray cluster (build_trainer, as the entry point builds it), and their logs.

    from train_runs import builtin_model_cache, read_metrics, run_train  # noqa: F401 (autouse fixture)
"""

import json
import os
import re
import subprocess
import sys

import pytest
from policy_checks import export_state, load_hf

from nemo_grpo.models.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True, scope="module")
def builtin_model_cache(model_cache_dir):
    """Every run of the importing module uses the session's built-in model cache (tests/conftest.py): the
    warm-started models are built once per session, by whichever run needs one first."""
    return model_cache_dir


# Every run the tests make trains in fp32 (a test may override it: later overrides win): their thresholds were
# measured in fp32, and "auto" (the recipes') would run bf16 on a CPU with native bf16. test_precision.py covers
# auto's choice; the SmolLM2 recipe test runs it.
FP32 = "policy.precision=float32"


class ModuleRun:
    """`python -m <module> [--config X] ...` started in a fresh process (its own Ray cluster), as a user runs it;
    logs and checkpoints under tmp_path, stdout and stderr into files there. wait() -> the finished process.
    nice: the process's niceness increment (its Ray cluster's daemons and workers inherit it)."""

    def __init__(self, module: str, tmp_path, *overrides, config: str = None, nice: int = 0):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("RAY_ADDRESS", None)
        self.args = [sys.executable, "-m", module, *(["--config", config] if config else []),
                     f"checkpointing.checkpoint_dir={tmp_path}/ckpt", f"logger.log_dir={tmp_path}/logs", FP32, *overrides]
        self.out, self.err = (open(os.path.join(tmp_path, name), "w+") for name in ("stdout.txt", "stderr.txt"))
        self.proc = subprocess.Popen(self.args, cwd=ROOT, env=env, stdout=self.out, stderr=self.err, text=True,
                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)

    def wait(self, timeout: int = 1500) -> subprocess.CompletedProcess:
        """The finished process (stdout, stderr as text); an AssertionError with their tails unless it exited 0."""
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        self.out.seek(0), self.err.seek(0)
        done = subprocess.CompletedProcess(self.args, code, self.out.read(), self.err.read())
        assert code == 0, done.stdout[-3000:] + done.stderr[-6000:]
        return done

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_module(module: str, tmp_path, *overrides, config: str = None, timeout: int = 1500):
    """ModuleRun(...).wait(): the finished process (stdout, stderr as text); asserts it exited 0."""
    return ModuleRun(module, tmp_path, *overrides, config=config).wait(timeout)


# The default recipe as a user runs it (`python -m nemo_grpo.train [overrides]`), on each back end: the long
# learning runs (test_user_runs.py; conftest.py starts them with the session)
USER_RUNS = {"dtensor": (), "megatron": ("policy.backend=megatron",)}


def first_and_last_10(rewards: list[float]) -> tuple[float, float]:
    return sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10


def start_train(tmp_path, *overrides, config: str = None, nice: int = 0) -> ModuleRun:
    return ModuleRun("nemo_grpo.train", tmp_path, "logger.progress_bar=false", *overrides, config=config, nice=nice)


def run_train(tmp_path, *overrides, config: str = None, timeout: int = 1500):
    return start_train(tmp_path, *overrides, config=config).wait(timeout)


def train_in_process(tmp_path, *overrides, config: str = None, measure=None, pool=None):
    """The run `python -m nemo_grpo.train` would make, built in this process on the session's Ray cluster (the
    caller requests the ray_cluster fixture): logs and checkpoints under tmp_path, no console set-up, the
    trainer closed after run(). measure(trainer) -> value, if given, is taken before and after the run on the
    live policy. pool: the module's run_actors_pool, whose actors the run borrows (reset to their start) when
    it would build the same ones. Returns (trainer, (before, after) or None)."""
    from nemo_grpo.build import build_trainer, start_actors
    from nemo_grpo.validation import load_config

    cfg = load_config(config, [f"checkpointing.checkpoint_dir={tmp_path}/ckpt", f"logger.log_dir={tmp_path}/logs",
                               "logger.progress_bar=false", FP32, *overrides])
    trainer = build_trainer(cfg, start=pool.start if pool is not None else start_actors)
    try:
        before = measure(trainer) if measure else None
        trainer.run()
        after = measure(trainer) if measure else None
    except BaseException:
        if pool is not None:
            trainer.actors.keep = False  # a failed run's actors are not lent again
        raise
    finally:
        trainer.close()
    return trainer, ((before, after) if measure else None)


def policy_expected_reward(trainer) -> float:
    """The exact expected reward at temperature 1 of the trainer's live policy on its training problems (a
    built-in recipe's): mean P(answer + EOS | prompt), from the policy's exported (LoRA: merged) weights. It
    has no sampling noise, so a few steps of learning show in it where the sampled reward needs hundreds."""
    from nemo_grpo.data.datasets import BUILTIN_DATASETS
    from nemo_grpo.models.builtin import expected_reward, resolve_model_path

    path = resolve_model_path(trainer.cfg.policy.model_name)  # cached: the directory build_trainer loaded
    model = load_hf(path, export_state(trainer.policy))
    problems = BUILTIN_DATASETS[trainer.cfg.data.train.dataset_name]()
    return expected_reward(model.eval(), load_tokenizer(path), problems)


def read_metrics(log_dir, prefix):
    """The rows of log_dir/metrics.jsonl logged under `prefix` ("train", "val", "timing"), in order."""
    rows = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    return [r for r in rows if r["prefix"] == prefix]


# the line a finished `python -m nemo_grpo.train` prints last on stdout (GRPOTrainer.summary)
SUMMARY = re.compile(r"done: (?P<steps>\d+) steps(?: \(resumed at step (?P<resumed_at>\d+)\))?"
                     r"(?: \(stopped on (?P<stopped_on>\w+) at step (?P<stopped_at>\d+) of (?P<max_steps>\d+)\))?"
                     r"(?: \| reward (?P<first>[\d.]+) -> (?P<last>[\d.]+))?"
                     r"(?: \| best val:accuracy (?P<best>[\d.]+) at step (?P<best_step>\d+))?"
                     r" \| checkpoint (?P<checkpoint>\S+)(?: \([^)]*\))?(?: \| plot (?P<plot>\S+))?")
# Ray's prefix on a line a worker printed, forwarded to the driver: "(VllmGenerationWorker pid=4584) ..."
WORKER_LINE = re.compile(r"^\S*\((\w+) pid=\d+\)", re.MULTILINE)


def summary(proc) -> dict:
    """The fields of the run's summary line (the last line on stdout of a process, or a trainer's summary());
    an AssertionError if there is none."""
    text = proc.summary() if hasattr(proc, "summary") else proc.stdout
    lines = text.strip().splitlines()
    match = SUMMARY.fullmatch(lines[-1]) if lines else None
    assert match, "no summary line at the end of stdout:\n" + text[-2000:]
    return match.groupdict()


def assert_quiet_console(proc) -> None:
    """Without --verbose the console carries no forwarded worker output (it stays in Ray's session logs)."""
    forwarded = WORKER_LINE.findall(proc.stderr + proc.stdout)
    assert not forwarded, f"worker output on the console from {sorted(set(forwarded))}:\n" + proc.stderr[-3000:]
