"""Sandbox cost and code-environment throughput on this machine.

    python bench/sandbox.py [--programs 64] [--repeats 20]

1. Overhead per execution of a trivial program (`print(1)`): a bare `python -I -S` subprocess, the reduced
   sandbox (rlimits + process group + private directory), and the full sandbox (namespaces, user switch,
   private tmpfs), median of --repeats runs each.
2. Executions per second of the code environment (Ray actor, sandbox workers) on --programs trivial
   programs with num_workers 1 and 2, median of 3 batches after a warm-up batch.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import argparse  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from timing import median_seconds, machine_line  # noqa: E402  (bench/timing.py)


def overhead(repeats: int) -> dict[str, float]:
    from nemo_grpo.envs.sandbox import Sandbox

    full = Sandbox()
    reduced = Sandbox.__new__(Sandbox)
    reduced.limits, reduced.python, reduced.mode = full.limits, full.python, "rlimits"
    out = {"bare python -I -S": median_seconds(
        lambda: subprocess.run([full.python, "-I", "-S", "-c", "print(1)"], capture_output=True), repeats)}
    out["reduced sandbox"] = median_seconds(lambda: reduced.run("print(1)"), repeats)
    if full.mode == "namespaces":
        out["full sandbox (namespaces)"] = median_seconds(lambda: full.run("print(1)"), repeats)
    return out


def env_throughput(workers: int, programs: int) -> float:
    import ray

    from nemo_grpo.config import CodeEnvConfig
    from nemo_grpo.envs import create_env

    env = create_env("code", CodeEnvConfig(num_workers=workers))
    logs = [[{"role": "assistant", "content": "print(1)"}]] * programs
    infos = [{"tests": [{"input": "", "output": "1"}]}] * programs
    try:
        ray.get(env.step.remote(logs, infos))  # warm-up
        seconds = median_seconds(lambda: ray.get(env.step.remote(logs, infos)), 3)
    finally:
        ray.get(env.shutdown.remote())
    return programs / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    print(machine_line(), flush=True)
    from nemo_grpo.distributed.cluster import init_ray

    rows = overhead(args.repeats)
    init_ray()
    rates = {w: env_throughput(w, args.programs) for w in (1, 2)}
    print(f"\nper execution of print(1), median of {args.repeats} ({os.cpu_count()} CPUs, {sys.platform}):")
    bare = rows["bare python -I -S"]
    for name, s in rows.items():
        print(f"  {name:28s} {s * 1e3:7.1f} ms   overhead over bare {1e3 * (s - bare):6.1f} ms")
    print(f"\ncode environment, {args.programs} trivial programs per batch:")
    for w, rate in rates.items():
        print(f"  num_workers {w}: {rate:7.1f} executions/s   ({rate / rates[1]:.2f}x num_workers 1)")


if __name__ == "__main__":
    main()
