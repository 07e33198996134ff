"""Math environment: a response scores 1.0 when its final answer is equivalent to the reference answer.

What is scored: the last message of each conversation (the model's reply) against `env_info["ground_truth"]`,
with math-verify 0.9 (`parse` then `verify`). Answers may be `\\boxed{...}`, `$...$` or plain ("8");
equivalent forms match ("0.5" = "\\frac{1}{2}", "x=2" = "2"). The reward is 0.0 or 1.0. With env.math.judge_fallback,
env.llm_judge (equivalence) decides the answers math-verify could not parse (math_judge.py).

How untrusted output is bounded (model output is untrusted input):
- size: only the last `max_answer_chars` characters of a reply are parsed (answers come at the end);
  the environment actor cuts replies to that tail before shipping them to a worker.
- time, per sample: one `setitimer` alarm covers parsing both sides and comparing, and raises a
  BaseException the library cannot swallow; math-verify's own alarms are turned off because they would
  cancel ours. Signals only work on a process's main thread, so `verify_answer` refuses to run elsewhere.
- time, per worker: an alarm cannot interrupt a long call into C (a huge regex or integer operation). If
  a worker has not answered within `timeout_s * chunk_size + safety_slack_s`, or it died, it is killed
  and restarted and its chunk scores 0.0; the environment keeps serving.
- errors: any exception while scoring (bad input, parser bug, RecursionError, MemoryError) gives 0.0.
Not isolated: memory. A worker is an ordinary process; nothing caps what sympy allocates.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import ray
import torch
from math_verify import parse, verify  # imported here, not inside the per-sample alarm: the first import is slow

from nemo_grpo.config import LlmJudgeConfig, MathEnvConfig
from nemo_grpo.envs.interface import EnvironmentInterface, EnvironmentReturn, MessageLog
from nemo_grpo.envs.judge_modes import RECORD, template_values
from nemo_grpo.envs.math_judge import FAILED, UNPARSED, VERIFIED, JudgeFallback

logger = logging.getLogger(__name__)

CORRECT = "Environment: correct"
INCORRECT = "Environment: incorrect"
WORKER_START_TIMEOUT_S = 120.0  # a verifier process that has not started by then is an error
ALARM_REPEAT_S = 0.1  # a sample past its time limit is interrupted again this often until it stops


# ------------------------------------------------------------------------------------------ scoring
class _SampleTimeout(BaseException):
    """Raised by the per-sample alarm; a BaseException so that `except Exception` in libraries lets it through."""


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise `_SampleTimeout` in the body after `seconds` (wall clock), and again every ALARM_REPEAT_S until the
    body has left: a library's bare `except:` (mpmath's convert has one) may swallow one alarm, never all. Main
    thread only (SIGALRM)."""

    def on_alarm(signum, frame):
        raise _SampleTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3), ALARM_REPEAT_S)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:  # even if the alarm fires right here
            signal.signal(signal.SIGALRM, previous)


def _as_text(value: Any) -> str:
    """Message content as a string: None -> "", bytes decoded with replacement characters."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value if isinstance(value, str) else str(value)


def answer_tail(response: Any, max_answer_chars: int) -> str:
    """The last `max_answer_chars` characters of a response (the part that is parsed)."""
    text = _as_text(response)
    return text[-max_answer_chars:] if max_answer_chars > 0 else ""


def _parse_gold(gold: str) -> list:
    """Gold as written; a bare LaTeX answer such as "(1,2)" or "\\frac12" is retried inside $...$. Each gold
    answer is parsed once per process (every step meets the same ones again; parsing is 40% of a verify)."""
    return list(_parse_gold_cached(gold))


@functools.lru_cache(maxsize=65536)
def _parse_gold_cached(gold: str) -> tuple:
    parsed = parse(gold, parsing_timeout=None)
    if not parsed and "$" not in gold:
        parsed = parse(f"${gold}$", parsing_timeout=None)
    return tuple(parsed)


def _score(tail: str, gold: str) -> tuple[float, Optional[str], str]:
    pred = parse(tail, parsing_timeout=None)
    # the extracted string, never str(sympy expr), which can itself hang
    answer = next((p for p in pred if isinstance(p, str)), None)
    gold_parsed = _parse_gold(gold)
    if not pred or not gold_parsed:
        return 0.0, answer, UNPARSED
    return (1.0 if verify(gold_parsed, pred, timeout_seconds=None) else 0.0), answer, VERIFIED


def check_answer(response: str, ground_truth: str, timeout_s: float,
                 max_answer_chars: int) -> tuple[float, Optional[str], str]:
    """Reward (0.0 or 1.0) of `response` against `ground_truth`, the extracted answer (None if none) and how
    math-verify decided: VERIFIED (both sides parsed and compared), UNPARSED (no answer in the response's tail, or
    the reference does not parse) or FAILED (a timeout or an error).

    Only the last `max_answer_chars` characters of `response` are parsed; parsing and comparison together
    get `timeout_s` seconds of wall clock. Never raises on any input (a timeout or an error scores 0.0);
    raises RuntimeError when called off a process's main thread, where the timeout cannot work.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("verify_answer needs a process's main thread (its timeout uses SIGALRM); "
                           "run it in a process or a plain Ray actor, not a thread pool or async actor")
    try:
        with _time_limit(timeout_s):
            return _score(answer_tail(response, max_answer_chars), _as_text(ground_truth))
    except _SampleTimeout:
        return 0.0, None, FAILED
    except Exception:  # noqa: BLE001 -- untrusted input: any failure is a wrong answer
        logger.debug("verify_answer failed", exc_info=True)
        return 0.0, None, FAILED


def verify_answer(response: str, ground_truth: str, timeout_s: float,
                  max_answer_chars: int) -> tuple[float, Optional[str]]:
    """check_answer's reward and extracted answer."""
    reward, answer, _ = check_answer(response, ground_truth, timeout_s, max_answer_chars)
    return reward, answer


# ------------------------------------------------------------------------------------------ workers
class VerifierWorker:
    """Scores chunks of (response, ground_truth) pairs; started as a plain Ray actor (main thread, SIGALRM)."""

    def __init__(self, timeout_s: float, max_answer_chars: int):
        self.timeout_s = timeout_s
        self.max_answer_chars = max_answer_chars
        # we disable math-verify's alarms on purpose; its "timeout is disabled" warning is noise here
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        _score("\\boxed{\\frac{1}{2}}", "0.5")  # warm up (regex compilation, sympy caches) outside any alarm

    def ready(self) -> bool:
        return True

    def score(self, pairs: list[tuple[str, str]]) -> list[tuple[float, Optional[str], str]]:
        return [check_answer(r, g, self.timeout_s, self.max_answer_chars) for r, g in pairs]


def _chunks(items: list, n: int) -> list[list]:
    """Split into n contiguous chunks whose sizes differ by at most one (empty ones when len(items) < n)."""
    q, r = divmod(len(items), n)
    bounds = [i * q + min(i, r) for i in range(n + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(n)]


# ------------------------------------------------------------------------------------------ environment
class MathEnvironment(EnvironmentInterface):
    """Scores math answers with `cfg.num_workers` verifier processes; started as a Ray actor by `create_env`."""

    worker_cls = VerifierWorker
    safety_slack_s = 10.0  # added to timeout_s * chunk_size before a silent worker is killed

    def __init__(self, cfg: MathEnvConfig, judge_cfg: Optional[LlmJudgeConfig] = None, **judge_kwargs):
        """judge_cfg: env.llm_judge, the judge of cfg.judge_fallback (math_judge.JudgeFallback; judge_kwargs:
        template, replicas, num_threads or a started judge, as LlmJudgeEnvironment takes them)."""
        if cfg.num_workers < 1:
            raise ValueError(f"env.math.num_workers must be >= 1, got {cfg.num_workers}")
        if cfg.timeout_s <= 0:
            raise ValueError(f"env.math.timeout_s must be > 0, got {cfg.timeout_s}")
        if cfg.judge_fallback and judge_cfg is None:
            raise ValueError("env.math.judge_fallback needs env.llm_judge (mode equivalence)")
        self.cfg = cfg
        self._fallback = JudgeFallback(judge_cfg, cfg.judge_agreement_fraction, **judge_kwargs) \
            if cfg.judge_fallback else None
        try:
            self._workers = self._start_workers(cfg.num_workers)
        except BaseException:
            if self._fallback is not None:
                self._fallback.shutdown()
            raise

    def _start_workers(self, n: int) -> list:
        """Start n verifier actors at once and wait until all have imported and warmed up."""
        workers = [ray.remote(self.worker_cls).options(num_cpus=0, max_restarts=0).remote(
            self.cfg.timeout_s, self.cfg.max_answer_chars) for _ in range(n)]
        ray.get([w.ready.remote() for w in workers], timeout=WORKER_START_TIMEOUT_S)
        return workers

    def _restart_workers(self, indices: list[int]) -> None:
        for i in indices:
            ray.kill(self._workers[i], no_restart=True)
        for i, worker in zip(indices, self._start_workers(len(indices))):
            self._workers[i] = worker

    def _score_all(self, pairs: list[tuple[str, str]]) -> list[tuple[float, Optional[str], str]]:
        """Split pairs across the workers; a worker that hangs past the safety bound or dies scores 0.0."""
        chunks = _chunks(pairs, len(self._workers))
        refs = {i: self._workers[i].score.remote(c) for i, c in enumerate(chunks) if c}
        bound_s = self.cfg.timeout_s * max(len(c) for c in chunks) + self.safety_slack_s
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=bound_s)
        ready, results, failed = set(ready), [], []
        for i, ref in refs.items():
            try:
                if ref not in ready:
                    raise TimeoutError(f"no answer within {bound_s:.0f} s")
                results += ray.get(ref)
            except (TimeoutError, ray.exceptions.RayError) as e:
                logger.warning("math verifier %d failed (%s); restarting it, its %d samples score 0",
                               i, type(e).__name__, len(chunks[i]))
                failed.append(i)
                results += [(0.0, None, FAILED)] * len(chunks[i])
        if failed:
            self._restart_workers(failed)
        return results

    def step(self, message_logs: list[MessageLog], env_infos: list[dict[str, Any]]) -> EnvironmentReturn:
        """Score the last message of each of the B conversations against env_info["ground_truth"]. Identical
        (reply tail, reference) pairs, common within a group of G samples, are verified once. With
        cfg.judge_fallback the judge decides the answers math-verify could not parse (math_judge.py); the samples
        it was asked about get its record in their metadata under "llm_judge"."""
        if not self._workers:
            raise RuntimeError("MathEnvironment.step called after shutdown()")
        pairs = [(answer_tail(log[-1].get("content") if log else None, self.cfg.max_answer_chars),
                  _as_text((info or {}).get("ground_truth")))
                 for log, info in zip(message_logs, env_infos, strict=True)]
        unique = list(dict.fromkeys(pairs))  # scoring is a function of (tail, gold): each distinct pair once
        scored = dict(zip(unique, self._score_all(unique))) if unique else {}
        results = [scored[p] for p in pairs]
        rewards, metadata = [r for r, _, _ in results], list(env_infos)
        if self._fallback is not None:
            samples = [dict(template_values(log, info or {}), response=tail, reference=gold)
                       for log, info, (tail, gold) in zip(message_logs, env_infos, pairs)]
            rewards, records = self._fallback.judge(samples, rewards, [status for _, _, status in results])
            metadata = [info if record is None else {**(info or {}), RECORD: record}
                        for info, record in zip(metadata, records)]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": CORRECT if r == 1.0 else INCORRECT} for r in rewards],
            metadata=metadata,
            next_stop_strings=[None] * len(results),
            rewards=torch.tensor(rewards, dtype=torch.float32),  # [B]
            terminateds=torch.ones(len(results), dtype=torch.bool),  # [B], single turn
            answers=[a for _, a, _ in results],
        )

    def global_post_process_and_metrics(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        """Metrics over N = P * G samples (G contiguous samples per prompt); the batch is returned unchanged.

        A sample is correct when its reward is positive. math/pass@G is the fraction of the P prompts with at
        least one correct sample. With cfg.judge_fallback, also the judge's math/judge_* metrics since the previous
        call (math_judge.JudgeFallback.metrics).
        """
        judged = {f"math/{k}": v for k, v in self._fallback.metrics().items()} if self._fallback is not None else {}
        rewards = torch.as_tensor(batch["rewards"], dtype=torch.float32).reshape(-1)  # [N]
        group = int(batch["num_generations_per_prompt"])
        n = rewards.numel()
        if n == 0:
            return batch, {"math/num_samples": 0.0, **judged}
        if group < 1 or n % group:
            raise ValueError(f"{n} samples are not a whole number of groups of num_generations_per_prompt={group}")
        correct = rewards > 0  # [N]
        truncated = torch.as_tensor(batch["truncated"], dtype=torch.bool).reshape(-1)  # [N]
        lengths = torch.as_tensor(batch["response_lengths"], dtype=torch.float32).reshape(-1)  # [N]
        metrics = {
            "math/accuracy": correct.float().mean().item(),
            f"math/pass@{group}": correct.view(-1, group).any(dim=1).float().mean().item(),
            "math/fraction_of_samples_properly_ended": 1.0 - truncated.float().mean().item(),
            "math/mean_response_length": lengths.mean().item(),
            "math/num_samples": float(n),
            **judged,
        }
        return batch, metrics

    def shutdown(self) -> None:
        """Kill the verifier workers and free the fallback's judge if it started one; safe to call twice."""
        workers, self._workers = self._workers, []
        for worker in workers:
            ray.kill(worker, no_restart=True)
        if getattr(self, "_fallback", None) is not None:
            self._fallback.shutdown()
