"""Colocated generation hands the devices over: the policy leaves before the rollouts and comes back after,
the engine sleeps in between, and a refit wakes its weights first (no-ops on a CPU; the order is the contract).
The refitter owns that first step: every refit prepares the engine before it sets up or sends anything."""

import dataclasses

from nemo_grpo.algorithms.grpo import GRPOTrainer
from nemo_grpo.validation import load_config
from nemo_grpo.weights.refit import Refitter


class Recorder:
    """Any method call is recorded by name."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append(name)


def trainer_with(colocated: bool, calls: list) -> GRPOTrainer:
    cfg = load_config()
    cfg.policy.generation = dataclasses.replace(
        cfg.policy.generation, colocated=dataclasses.replace(cfg.policy.generation.colocated, enabled=colocated))
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.cfg, trainer.policy, trainer.engine, trainer.refitter = cfg, Recorder(calls), Recorder(calls), Recorder(calls)
    return trainer


def test_colocated_rollouts_and_refit_hand_memory_over_in_order():
    calls = []
    trainer = trainer_with(True, calls)
    with trainer._generation_phase():
        calls.append("generate")
    trainer.refit()
    assert calls == ["offload", "prepare_for_generation", "generate", "finish_generation", "onload", "refit"]


class PhaseRecorder(Refitter):
    """A refitter whose set-up and transfer only record themselves (a 3-bucket plan, the last one trained)."""

    def _setup(self):
        self.senders.calls.append("setup")
        self.plan, self.trained_from = [[], [], []], 2

    def _transfer(self, first):
        self.senders.calls.append(f"transfer from {first}")
        return {"bytes": 0.0, "buckets": float(len(self.plan) - first)}


def test_every_refit_prepares_the_engine_first_and_sets_up_once():
    calls = []
    refitter = PhaseRecorder(Recorder(calls), Recorder(calls), bucket_size_mb=1.0)
    assert refitter.refit()["buckets"] == 3
    assert refitter.refit()["buckets"] == 1  # later refits: only what a train step changes
    assert calls == ["prepare", "setup", "transfer from 0", "prepare", "transfer from 2"]


def test_the_policy_comes_back_even_when_a_rollout_fails():
    calls = []
    trainer = trainer_with(True, calls)
    try:
        with trainer._generation_phase():
            raise RuntimeError("environment died")
    except RuntimeError:
        pass
    assert calls[-2:] == ["finish_generation", "onload"]


def test_separate_engines_keep_their_devices():
    calls = []
    with trainer_with(False, calls)._generation_phase():
        calls.append("generate")
    assert calls == ["generate"]
