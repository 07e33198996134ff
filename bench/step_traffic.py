"""What the driver ships to its actors in one GRPO step, in bytes per actor method, and the step's time split.

    python bench/step_traffic.py                                   # the default recipe, 8 steps (~1 min)
    python bench/step_traffic.py --config configs/grpo_smollm2_arith_cpu.yaml --model builtin:smollm2-135m-instruct \
        --steps 3 --warmup 1 grpo.num_prompts_per_step=4 policy.train_global_batch_size=32 \
        policy.generation.max_new_tokens=64

Runs the recipe (`--config`, default configs/grpo_tiny_cpu.yaml, plus any dotted overrides) in this process,
without validation or checkpoints, and counts every payload the driver hands to Ray: the arguments of each
actor method call (`ActorMethod._remote`) and each `ray.put` (named by the
public nemo_grpo function that made it). A payload's bytes are its tensors' bytes plus
its strings' UTF-8 bytes plus the pickled size of any other object (numbers, configs, the loss function); an
ObjectRef counts nothing where it is passed (its object was counted at its `ray.put`). Per method: KiB per
step (mean over the steps after --warmup). Seconds: the median of the trainer's own timer sections.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import collections  # noqa: E402
import pickle  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402
from ray.actor import ActorMethod  # noqa: E402
from timing import machine_line  # noqa: E402  (bench/timing.py)

SECTIONS = ("generation", "environment", "logprobs", "training", "refit", "total")


def payload_bytes(obj) -> int:
    """Bytes of what Ray serializes for obj: tensors, strings, and the pickle of anything else."""
    if isinstance(obj, ray.ObjectRef):
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, str):
        return len(obj.encode())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(payload_bytes(k) + payload_bytes(v) for k, v in obj.items())
    try:
        return len(pickle.dumps(obj))
    except Exception:  # noqa: BLE001 -- an object Ray pickles its own way: not counted
        return 0


def public_caller() -> str:
    """The innermost public nemo_grpo function on the stack (e.g. Policy.train for its shards' ray.put)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if f"{os.sep}nemo_grpo{os.sep}" in code.co_filename and code.co_name[0] not in "_<":
            return code.co_qualname
        frame = frame.f_back
    return "?"


class TrafficCounter:
    """Bytes per actor method name (and "ray.put") since the last `take()`, counted by patching Ray's entries."""

    def __init__(self):
        self.bytes: collections.Counter = collections.Counter()
        self._remote, self._put = ActorMethod._remote, ray.put

    def __enter__(self) -> "TrafficCounter":
        counter, remote, put = self, self._remote, self._put

        def counted_remote(method, args=None, kwargs=None, **options):
            counter.bytes[method._method_name] += payload_bytes(args or ()) + payload_bytes(kwargs or {})
            return remote(method, args, kwargs, **options)

        def counted_put(value, *a, **k):
            counter.bytes[f"ray.put in {public_caller()}"] += payload_bytes(value)
            return put(value, *a, **k)

        ActorMethod._remote, ray.put = counted_remote, counted_put
        return self

    def __exit__(self, *exc) -> None:
        ActorMethod._remote, ray.put = self._remote, self._put

    def take(self) -> dict[str, int]:
        out, self.bytes = dict(self.bytes), collections.Counter()
        return out


def run(args) -> tuple[list[dict[str, int]], list[dict[str, float]]]:
    """Per step after the warm-up: bytes per method, and the trainer's timer sections (seconds)."""
    from nemo_grpo.build import build_trainer
    from nemo_grpo.validation import load_config

    log_dir = tempfile.mkdtemp(prefix="bench_traffic_")
    overrides = [f"policy.model_name={args.model}", f"grpo.max_num_steps={args.steps}", "grpo.val_period=0",
                 "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.enabled=false",
                 f"logger.log_dir={log_dir}", "logger.progress_bar=false", "logger.tensorboard_enabled=false",
                 "logger.plot=false", *args.overrides]
    trainer = build_trainer(load_config(args.config, overrides))
    traffic, timings = [], []
    try:
        trainer.maybe_resume()
        with TrafficCounter() as counter:
            for _ in range(args.steps):
                counter.take()
                trainer.train_step()
                traffic.append(counter.take())
                timings.append(trainer.timer.get_timing_metrics())
    finally:
        trainer.close()
        shutil.rmtree(log_dir, ignore_errors=True)
    return traffic[args.warmup:], timings[args.warmup:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/grpo_tiny_cpu.yaml")
    ap.add_argument("--model", default="builtin:tiny-addition")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, as for python -m nemo_grpo.train")
    args = ap.parse_args()
    print(machine_line(), flush=True)
    torch.set_num_threads(1)
    traffic, timings = run(args)
    methods = sorted({m for t in traffic for m in t}, key=lambda m: -sum(t.get(m, 0) for t in traffic))
    print(f"\n{args.model}: {len(traffic)} steps after {args.warmup} warm-up; KiB the driver ships per step")
    print("| method | KiB / step |\n|---|---|")
    for m in methods:
        print(f"| {m} | {statistics.mean(t.get(m, 0) for t in traffic) / 2**10:.1f} |")
    print(f"| **all** | {statistics.mean(sum(t.values()) for t in traffic) / 2**10:.1f} |")
    print("\n| section | median s / step |\n|---|---|")
    for k in SECTIONS:
        print(f"| {k} | {statistics.median(t.get(k, 0.0) for t in timings):.3f} |")


if __name__ == "__main__":
    main()
