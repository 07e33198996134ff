"""The async rollout collector on its own (no Ray): how far it runs ahead of the weights, that it takes the engine
lock per generation batch, that a failure reaches the trainer instead of a hang, and that stop() returns."""

import threading
import time

import pytest

from nemo_grpo.algorithms.async_rollouts import GenerationFailed, RolloutCollector, Rollouts


def rollouts(step: int) -> Rollouts:
    return Rollouts(samples=[step], rewards=None, components={}, stats={})


class Recorder:
    """produce(step): notes the step and the weight version the collector had when it started it."""

    def __init__(self):
        self.started: list[int] = []
        self.collector = None

    def __call__(self, step: int) -> Rollouts:
        assert self.collector.engine_lock.locked()  # generation holds the engine
        self.started.append(step)
        return rollouts(step)


def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("max_age", [0, 1, 2])
def test_runs_at_most_max_age_steps_ahead_of_the_weights(max_age):
    rec = Recorder()
    rec.collector = collector = RolloutCollector(rec, first_step=1, max_age=max_age, version=0)
    collector.start()
    try:
        for step in range(1, 6):
            wait_until(lambda: len(rec.started) >= min(step + max_age, 5 + max_age))
            time.sleep(0.05)  # it would run further now if it could
            assert len(rec.started) == step + max_age  # steps up to version + 1 + max_age, no more
            got = collector.next()
            assert got.samples == [step] and got.weight_version == max(0, step - 1 - max_age)
            assert step - 1 - got.weight_version <= max_age
            with collector.engine_lock:
                pass  # the refit
            collector.weights_updated(step)
    finally:
        collector.stop()


def test_zero_age_alternates_generation_and_refit():
    order = []
    rec = Recorder()
    rec.collector = collector = RolloutCollector(lambda s: (order.append(f"gen{s}"), rec(s))[1], 1, 0, version=0,
                                                 last_step=3)
    collector.start()
    try:
        for step in range(1, 4):
            collector.next()
            order.append(f"refit{step}")
            collector.weights_updated(step)
        time.sleep(0.05)
    finally:
        collector.stop()
    assert order == ["gen1", "refit1", "gen2", "refit2", "gen3", "refit3"]  # nothing past the last step


def test_a_failed_generation_is_raised_in_the_trainer():
    def produce(step):
        if step == 2:
            raise RuntimeError("the engine actor died")
        return rollouts(step)

    collector = RolloutCollector(produce, 1, max_age=3, version=0)
    collector.start()
    assert collector.next().samples == [1]
    with pytest.raises(GenerationFailed, match="the engine actor died"):
        collector.next()
    collector.stop()


def test_stop_returns_while_the_collector_waits_for_weights():
    collector = RolloutCollector(rollouts, 1, max_age=0, version=0)
    collector.start()
    wait_until(lambda: collector.in_flight == 1)  # step 1 done; step 2 waits for version 1
    done = threading.Event()
    threading.Thread(target=lambda: (collector.stop(), done.set())).start()
    assert done.wait(5.0)
