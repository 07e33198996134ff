"""`CodeEnvironment`: rewards from running model-written Python against test cases, in the sandbox
(nemo_grpo/envs/sandbox.py: namespaces, unprivileged user, rlimits, wall-clock kill).

Per sample, `env_info` carries the cases:
  {"tests": [{"input": "3 4\\n", "output": "7"}, {"assert": "assert add(2, 2) == 4"}, ...]}
    stdin/stdout cases pass when the program's stdout equals "output" (trailing whitespace ignored per line);
    assert cases append the statement to the program and pass when it exits with status 0;
  {"answer": "42"} (program of thought; else the dataset's reference answer, "ground_truth"): the program's
    last printed line must equal the answer.
A JSONL dataset row carries them as {"input": ..., "output": ..., "extra_env_info": {"tests": [...]}}.
The code is the last fenced block of the reply (```python ... ``` or ``` ... ```), else the whole reply.

Single turn (`terminate_on_evaluation: true`): extract, run the cases, reward = fraction passed (or 1/0 with
`reward_mode: all_or_nothing`), terminated. Multi-turn (`false`): a reply with a code block is executed
(no stdin) and its output returned as the next observation; a reply without one is the final answer, and the
last executed program is scored against the cases (or, with "answer", the reply's last line is compared).
Identical programs of one step run once (`run_identical_once`, default true): the result of a program is a
function of its code and cases unless it reads time or randomness, and a policy that has learned a task writes
the same program many times per step.
Metrics: code/{pass_rate, accuracy, timeouts, errors, syntax_errors, num_samples} (per sample, copies counted).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Optional

import ray
import torch

from nemo_grpo.envs.interface import EnvironmentInterface, EnvironmentReturn, MessageLog
from nemo_grpo.envs.sandbox import Sandbox, SandboxLimits

FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
OUTPUT_CHARS = 2000  # of a multi-turn observation


def extract_code(text: str, require_fence: bool = False) -> Optional[str]:
    """The last fenced code block of `text`; the whole text when there is none (None if require_fence)."""
    blocks = FENCE.findall(text)
    if blocks:
        return blocks[-1]
    return None if require_fence else text


def _same_output(got: str, expected: str) -> bool:
    strip = lambda s: "\n".join(line.rstrip() for line in s.strip().splitlines())  # noqa: E731
    return strip(got) == strip(expected)


class SandboxWorker:
    """A Ray actor with one Sandbox; runs one program against its cases at a time."""

    def __init__(self, limits):
        self.sandbox = Sandbox(limits)

    def mode(self) -> str:
        return self.sandbox.mode

    def run(self, code: str, stdin: str = "") -> dict[str, Any]:
        r = self.sandbox.run(code, stdin)
        return {"stdout": r.stdout, "stderr": r.stderr, "returncode": r.returncode, "timed_out": r.timed_out}

    def evaluate(self, code: Optional[str], cases: list[dict[str, str]], answer: Optional[str]) -> dict[str, Any]:
        """{"passed", "total", "timeouts", "errors", "syntax_error"} of `code` on the cases (or the answer)."""
        total = len(cases) if cases else 1
        out = {"passed": 0, "total": total, "timeouts": 0, "errors": 0, "syntax_error": False}
        try:
            compile(code or "", "<model>", "exec")
        except (SyntaxError, ValueError):
            out["syntax_error"] = True
            return out
        for case in cases or [{"answer": answer}]:
            program = code + ("\n" + case["assert"] if "assert" in case else "")
            r = self.sandbox.run(program, case.get("input", ""))
            out["timeouts"] += int(r.timed_out)
            out["errors"] += int(not r.timed_out and r.returncode != 0)
            if r.timed_out or r.returncode != 0:
                continue
            if "output" in case:
                out["passed"] += int(_same_output(r.stdout, case["output"]))
            elif "answer" in case:
                lines = r.stdout.strip().splitlines()
                out["passed"] += int(bool(lines) and lines[-1].strip() == str(case["answer"]).strip())
            else:
                out["passed"] += 1
        return out


class CodeEnvironment(EnvironmentInterface):
    """Scores code with `cfg.num_workers` sandbox workers; started as a Ray actor by `create_env`."""

    def __init__(self, cfg):
        self.cfg = cfg
        limits = SandboxLimits(timeout_s=cfg.timeout_s, cpu_s=cfg.cpu_s, memory_mb=cfg.memory_mb,
                               max_output_bytes=cfg.max_output_bytes)
        self.workers = [ray.remote(SandboxWorker).options(num_cpus=0).remote(limits) for _ in range(cfg.num_workers)]
        modes = ray.get([w.mode.remote() for w in self.workers])
        if "namespaces" not in modes:
            logging.getLogger(__name__).warning(
                "CodeEnvironment: the sandbox runs with REDUCED isolation (%s); see nemo_grpo/envs/sandbox.py", modes)
        self._counts = {"timeouts": 0, "errors": 0, "syntax_errors": 0}  # since the last metrics call

    def step(self, message_logs: list[MessageLog], env_infos: list[dict[str, Any]]) -> EnvironmentReturn:
        n = len(message_logs)
        replies = [log_[-1]["content"] if log_ else "" for log_ in message_logs]
        infos = [dict(info or {}) for info in env_infos]
        multi = not self.cfg.terminate_on_evaluation
        blocks = [extract_code(r, require_fence=multi) for r in replies]
        observations = [{"role": "environment", "content": ""} for _ in range(n)]
        rewards, terminated = torch.zeros(n), torch.ones(n, dtype=torch.bool)
        calls, refs = {}, {}  # sample -> (kind, key); key -> the one execution of identical programs
        for i, (code, info) in enumerate(zip(blocks, infos)):
            if multi and code is not None:  # an intermediate turn: run it, show the output
                info["last_code"] = code
                call = ("run", code)
            else:
                final = info.get("last_code") if multi else code
                answer = info.get("answer", info.get("ground_truth"))
                call = ("eval", final, info.get("tests") or [], answer)
            key = repr(call) if self.cfg.run_identical_once else i
            if key not in refs:
                worker = self.workers[len(refs) % len(self.workers)]
                refs[key] = worker.run.remote(*call[1:]) if call[0] == "run" else worker.evaluate.remote(*call[1:])
            calls[i] = (call[0], key)
        results = dict(zip(refs, ray.get(list(refs.values()))))
        for i, (kind, key) in calls.items():
            result = results[key]
            if kind == "run":
                text = (result["stdout"] + result["stderr"])[-OUTPUT_CHARS:]
                observations[i] = {"role": "environment", "content": f"output:\n{text}"}
                terminated[i] = False
            else:
                rewards[i] = self._reward(result)
        return EnvironmentReturn(observations=observations, metadata=infos, next_stop_strings=[None] * n,
                                 rewards=rewards, terminateds=terminated, answers=blocks)

    def _reward(self, result: dict[str, Any]) -> float:
        c = self._counts
        c["timeouts"] += result["timeouts"]
        c["errors"] += result["errors"]
        c["syntax_errors"] += int(result["syntax_error"])
        if self.cfg.reward_mode == "all_or_nothing":
            return float(result["passed"] == result["total"])
        return result["passed"] / result["total"]

    def global_post_process_and_metrics(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        """code/pass_rate (mean reward) and code/accuracy (fraction of samples that passed every case) over the
        batch's samples; code/{timeouts, errors, syntax_errors}: counts over the programs this environment
        evaluated since the previous call (validation rollouts in between included)."""
        rewards = torch.as_tensor(batch["rewards"], dtype=torch.float32).reshape(-1)  # [N]
        c, n = self._counts, rewards.numel()
        metrics = {"pass_rate": float(rewards.mean()) if n else 0.0,
                   "accuracy": float((rewards >= 1.0).float().mean()) if n else 0.0,
                   "timeouts": float(c["timeouts"]), "errors": float(c["errors"]),
                   "syntax_errors": float(c["syntax_errors"]), "num_samples": float(n)}
        self._counts = dict.fromkeys(c, 0)
        return batch, {f"code/{k}": v for k, v in metrics.items()}

    def shutdown(self) -> None:
        for w in getattr(self, "workers", []):
            ray.kill(w)
        self.workers = []
