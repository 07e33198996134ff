"""Async GRPO (`grpo.async_grpo`): generation runs ahead of training, within a bound on staleness.

A `RolloutCollector` thread in the driver produces the rollouts of step after step (prompts, sampling and
rewards: the trainer's own `collect`) on the non-colocated engine, with whatever weights the engine holds,
while the trainer trains. Weight version v is the policy after v optimizer steps (0: the initial weights).
Step k trains on rollouts generated with version v; their age is (k - 1) - v, always 0 in synchronous GRPO.

- The collector starts step k's rollouts once the engine holds version >= k - 1 - max_trajectory_age_steps:
  it runs at most that many steps ahead, and with max_trajectory_age_steps 0 the run is synchronous GRPO's,
  step for step (same prompts, seeds and weights).
- The trainer takes the next rollouts (the wait is timing/generation_wait), drops those older than the bound
  (counted in async/dropped_stale), trains, then refits the engine between generation batches: a generation
  batch and a refit take the engine lock in turn. Validation takes it too.
- A failure in the collector (a dead engine actor, an environment error) is raised in the trainer: the run
  stops with it, never hangs.
- A checkpoint holds the prompt loader's position after the last trained step: rollouts in flight are not
  saved; a resumed run draws the same prompts again and generates them with its newest weights.

    collector = RolloutCollector(produce, first_step=1, max_age=1, version=0, last_step=400)
    collector.start()
    rollouts = collector.next()              # Rollouts of the next step, in order
    with collector.engine_lock: refit()
    collector.weights_updated(version)       # lets the collector run on
    collector.stop()
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

POLL_S = 0.5  # how often a waiting trainer checks that the collector is alive


@dataclass
class Rollouts:
    """One step's rollouts and what the trainer needs to account for them."""

    samples: list  # [N] Sample
    rewards: Any  # [N] tensor, scaled and shaped
    components: dict  # reward component name -> [N]
    stats: dict[str, float]  # reward, gen_batches, fraction_groups_kept
    loader_state: dict = field(default_factory=dict)  # the prompt loader after these prompts were drawn
    prompts_drawn: int = 0
    weight_version: int = 0  # the engine's weights when they were generated
    timings: dict[str, float] = field(default_factory=dict)  # generation, environment seconds
    env_metrics: list = field(default_factory=list)  # the environments' answers (ObjectRefs) on these samples


class GenerationFailed(RuntimeError):
    """Generation (or the refit of its engine) failed; the run cannot go on."""

    def __init__(self, what: str, error: BaseException):
        super().__init__(f"{what}: {error!r}. A dead generation actor is not replaced mid-run: the run stops; start "
                         "it again to resume from its last checkpoint")


class RolloutCollector:
    """Runs `produce(step) -> Rollouts` for step = first_step, first_step + 1, ... (to last_step) in a thread,
    each step once the engine holds weights recent enough (see the module doc), holding `engine_lock` while it
    generates."""

    def __init__(self, produce: Callable[[int], Rollouts], first_step: int, max_age: int, version: int,
                 last_step: Optional[int] = None):
        self.produce, self.max_age, self.last_step = produce, max_age, last_step
        self.engine_lock = threading.Lock()
        self._next_step, self._version = first_step, version
        self._ready: queue.Queue = queue.Queue()
        self._changed = threading.Condition()
        self._stopping = False
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="rollout-collector", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _may_generate(self, step: int) -> bool:
        return self._version >= step - 1 - self.max_age

    def _run(self) -> None:
        try:
            while True:
                with self._changed:
                    self._changed.wait_for(lambda: self._stopping or self._may_generate(self._next_step))
                    if self._stopping or (self.last_step is not None and self._next_step > self.last_step):
                        return
                    step, version = self._next_step, self._version
                with self.engine_lock:
                    rollouts = self.produce(step)
                rollouts.weight_version = version
                self._ready.put(rollouts)
                self._next_step += 1
        except BaseException as e:  # handed to the trainer, which raises it
            self._error = e
            self._stopping = True

    def weights_updated(self, version: int) -> None:
        """The engine now holds weight version `version` (call after the refit)."""
        with self._changed:
            self._version = version
            self._changed.notify_all()

    def next(self) -> Rollouts:
        """The next step's rollouts, waiting for them; raises GenerationFailed if generation failed."""
        while True:
            try:
                return self._ready.get(timeout=POLL_S)
            except queue.Empty:
                if not self._thread.is_alive():
                    self.raise_if_failed()
                    raise RuntimeError(f"no rollouts for step {self._next_step}: the collector has stopped")

    def raise_if_failed(self) -> None:
        """Raise GenerationFailed if generation failed (the trainer checks before it refits the engine)."""
        if self._error is not None:
            raise GenerationFailed(f"rollout generation failed at step {self._next_step}", self._error) \
                from self._error

    @property
    def in_flight(self) -> int:
        """Rollouts generated and not yet taken."""
        return self._ready.qsize()

    def stop(self, timeout_s: float = 600.0) -> None:
        """Stop after the generation batch under way (if any); returns once the thread has ended."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(timeout=POLL_S)
