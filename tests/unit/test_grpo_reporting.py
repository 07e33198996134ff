"""What the trainer reports, without a cluster: environment metrics per task (each environment sees only the
samples of its own task), the validation samples it prints, the run's summary line, the epoch limit and the
stop on SIGUSR1."""

import dataclasses
import os
import signal

import pytest

from nemo_grpo.algorithms.grpo import GRPOState, GRPOTrainer, env_metric_views, format_samples
from nemo_grpo.algorithms.async_rollouts import Rollouts
from nemo_grpo.algorithms.rollout import new_sample
from nemo_grpo.data.prompts import Datum, PromptLoader
from nemo_grpo.utils.timer import Timer
from nemo_grpo.validation import load_config

G = 2  # samples per prompt


def sample(task: str, prompt: str, reply: str, reward: float, idx: int = 0):
    datum = Datum(message_log=[{"role": "user", "content": prompt}], prompt_ids=[1] * len(prompt),
                  extra_env_info={}, task_name=task, idx=idx)
    s = new_sample(datum)
    s.token_ids += [2] * len(reply)
    s.token_mask += [1.0] * len(reply)
    s.generation_logprobs += [0.0] * len(reply)
    s.response_length, s.text, s.reward = len(reply), reply, reward
    s.message_log.append({"role": "assistant", "content": reply})
    return s


def mixed_samples():
    """Groups of G in the order math, code, math: rows 0-1 math, 2-3 code, 4-5 math."""
    samples = [sample("math", "1+1=", "2", 1.0), sample("math", "1+1=", "3", 0.0),
               sample("code", "code:2 times 3=", "print(6)", 1.0), sample("code", "code:2 times 3=", "print(", 0.0),
               sample("math", "2+2=", "44", 0.0), sample("math", "2+2=", "4", 1.0)]
    samples[3].truncated = True
    return samples


class FakeEnv:
    """Records the view each metrics call receives; `.remote` runs inline (the trainer's _gather is identity)."""

    def __init__(self, name):
        self.name, self.views = name, []
        self.global_post_process_and_metrics = self

    def remote(self, view):
        self.views.append(view)
        return view, {f"{self.name}/num_samples": float(len(view["rewards"])),
                      f"{self.name}/accuracy": float(view["rewards"].mean())}


def bare_trainer(**cfg_changes) -> GRPOTrainer:
    cfg = load_config()
    for section, values in cfg_changes.items():
        setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **values))
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.cfg, trainer.state, trainer.timer = cfg, GRPOState(), Timer()
    trainer.history, trainer.val_history = [], []
    trainer.resumed_at = trainer.last_checkpoint = trainer.plot_path = trainer.collector = None
    trainer.checkpoint_step = trainer.stopped_on = None
    trainer._gather = lambda results: results  # FakeEnv's .remote returns the result itself
    trainer.task_to_env = {"math": FakeEnv("math")}
    return trainer


# ----------------------------------------------------------------------------------------------- env metrics
def test_each_environment_gets_only_the_rows_of_its_task():
    views = env_metric_views(mixed_samples(), G)
    assert set(views) == {"math", "code"}
    assert views["math"]["rewards"].tolist() == [1.0, 0.0, 0.0, 1.0]  # rows 0, 1, 4, 5: whole groups, in order
    assert views["math"]["text"] == ["2", "3", "44", "4"]
    assert views["math"]["response_lengths"].tolist() == [1, 1, 2, 1]
    assert views["code"]["rewards"].tolist() == [1.0, 0.0] and views["code"]["text"] == ["print(6)", "print("]
    assert views["code"]["truncated"].tolist() == [False, True]
    assert views["code"]["prompt_lengths"].tolist() == [15, 15]
    assert all(v["num_generations_per_prompt"] == G for v in views.values())


def test_trainer_env_metrics_do_not_mix_tasks():
    trainer = bare_trainer(grpo={"num_generations_per_prompt": G})
    math, code = FakeEnv("math"), FakeEnv("code")
    trainer.task_to_env = {"math": math, "code": code}
    rollouts = Rollouts([], None, {}, {}, env_metrics=trainer._request_env_metrics(mixed_samples()))
    metrics = trainer._env_metrics(rollouts)
    assert [len(v["rewards"]) for v in math.views] == [4] and [len(v["rewards"]) for v in code.views] == [2]
    assert metrics == {"math/num_samples": 4.0, "math/accuracy": 0.5, "code/num_samples": 2.0, "code/accuracy": 0.5}


def test_an_environment_without_rows_this_step_is_not_asked():
    trainer = bare_trainer(grpo={"num_generations_per_prompt": G})
    math, code = FakeEnv("math"), FakeEnv("code")  # validation on code, training on math: code gets no call
    trainer.task_to_env = {"math": math, "code": code}
    math_only = [sample("math", "1+1=", "2", 1.0), sample("math", "1+1=", "5", 0.0)]
    assert trainer._env_metrics(Rollouts([], None, {}, {}, env_metrics=trainer._request_env_metrics(math_only))) == {
        "math/num_samples": 2.0, "math/accuracy": 0.5}
    assert code.views == []


# ----------------------------------------------------------------------------------------------- validation text
def test_format_samples_shows_prompt_every_turn_and_reward():
    s = sample("guess", "guess:", "5", 0.0)
    s.message_log += [{"role": "environment", "content": " lower "}, {"role": "assistant", "content": "3"}]
    s.reward = 1.0
    text = format_samples([s, sample("math", "1+1=", "2", 1.0)], 1)
    assert text == "sample 1 | reward 1.000\n  prompt:   'guess:'\n  response: '5\\n[environment]  lower \\n3'"


class FakeLogger:
    def __init__(self):
        self.texts, self.metrics = [], []

    def log_metrics(self, metrics, step, prefix=""):
        self.metrics.append((prefix, step, metrics))

    def log_text(self, tag, text, step):
        self.texts.append((tag, text, step))


@pytest.mark.parametrize("n", [0, 2, 50])
def test_validation_prints_num_val_samples_to_print(n):
    trainer = bare_trainer(logger={"num_val_samples_to_print": n}, grpo={"max_val_samples": 3})
    trainer.cfg.policy.generation.colocated.enabled = False
    trainer.logger, trainer.val_datums, trainer.state.step = FakeLogger(), [None] * 5, 7
    done = [sample("math", f"{i}+1=", str(i + 1), float(i % 2)) for i in range(3)]
    trainer._rollout = lambda datums, seed, greedy: done[: len(datums)]
    metrics = trainer.validate()
    assert metrics["accuracy"] == pytest.approx(1 / 3) and trainer.val_history == [(7, pytest.approx(1 / 3))]
    if n == 0:
        assert trainer.logger.texts == []
    else:
        [(tag, text, step)] = trainer.logger.texts
        assert (tag, step) == ("val/samples", 7)
        assert text == format_samples(done, min(n, 3)) and text.count("sample ") == min(n, 3)


def test_validation_reports_the_eval_metrics():
    """val/* are python -m nemo_grpo.eval's metrics (one greedy sample per prompt), `accuracy` kept."""
    trainer = bare_trainer(grpo={"max_val_samples": 4})
    trainer.cfg.policy.generation.colocated.enabled = False
    trainer.logger, trainer.val_datums = FakeLogger(), [None] * 4
    done = [sample("math", f"{i}+1=", "x" * (i + 1), float(i < 3)) for i in range(4)]
    done[3].truncated = True
    trainer._rollout = lambda datums, seed, greedy: done[: len(datums)]
    metrics = trainer.validate()
    assert metrics == pytest.approx({"accuracy": 0.75, "pass@1": 0.75, "cons@1": 0.0,  # no extracted answers
                                     "mean_response_length": 2.5, "fraction_truncated": 0.25, "num_prompts": 4.0,
                                     "num_samples": 4.0})
    assert trainer.logger.metrics == [("val", 0, metrics)]


# ----------------------------------------------------------------------------------------------- summary
def test_summary_line():
    trainer = bare_trainer()
    trainer.state.step = 400
    trainer.history = [{"reward": 0.2211}, {"reward": 0.5}, {"reward": 0.9149}]
    trainer.val_history = [(0, 0.4), (350, 0.95), (400, 0.95)]  # a tie goes to the first step that reached it
    trainer.last_checkpoint, trainer.plot_path = "/ckpt/step_400", "/logs/reward.png"
    assert trainer.summary() == ("done: 400 steps | reward 0.22 -> 0.91 | best val:accuracy 0.95 at step 350 | "
                                 "checkpoint /ckpt/step_400 | plot /logs/reward.png")
    trainer.resumed_at, trainer.history, trainer.val_history, trainer.plot_path = 400, [], [], None
    trainer.last_checkpoint = None
    trainer.cfg.checkpointing.enabled = False
    assert trainer.summary() == "done: 400 steps (resumed at step 400) | checkpoint none (checkpointing.enabled=false)"


# ----------------------------------------------------------------------------------------------- epochs
class Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append(name)


def looping_trainer(max_num_epochs: int = 1000, save_period: int = 100, enabled: bool = True,
                    on_step=lambda step: None):
    """A trainer whose train_step only draws prompts (10 prompts, 3 per step, grpo.max_num_steps 10) and calls
    on_step(step); its save() records the step in `trainer.saved` as the real one marks the checkpoint."""
    trainer = bare_trainer(grpo={"max_num_epochs": max_num_epochs, "max_num_steps": 10, "val_at_start": False,
                                 "val_period": 0, "val_at_end": False, "num_prompts_per_step": 3},
                           checkpointing={"save_period": save_period, "enabled": enabled, "resume": False})
    datums = [Datum(message_log=[], prompt_ids=[1], extra_env_info={}, task_name="math", idx=i) for i in range(10)]
    trainer.loader, trainer.logger, trainer.val_datums = PromptLoader(datums, 3, seed=0), Recorder(), []
    trainer.saved = []

    def save():
        trainer.saved.append(trainer.state.step)
        trainer.last_checkpoint, trainer.checkpoint_step = f"/ckpt/step_{trainer.state.step}", trainer.state.step
        return trainer.last_checkpoint

    def train_step():
        trainer.loader.next_batch()
        trainer.state.step += 1
        trainer.state.loader = trainer.loader.state_dict()
        on_step(trainer.state.step)
        return {"reward": 0.5}

    trainer.save, trainer.train_step = save, train_step
    return trainer


@pytest.mark.parametrize("max_num_epochs, steps", [(1, 4), (2, 7), (1000, 10)])
def test_run_stops_after_max_num_epochs(max_num_epochs, steps):
    """10 prompts, 3 per step: epoch 1 ends inside step 4, epoch 2 inside step 7; grpo.max_num_steps is 10."""
    trainer = looping_trainer(max_num_epochs)
    history = trainer.run()
    assert len(history) == steps == trainer.state.step
    assert trainer.saved == [steps]  # the last step checkpoints, as at max_num_steps
    assert trainer.summary().startswith(f"done: {steps} steps | reward 0.50 -> 0.50")


def sigusr1_at(at: int):
    """on_step for looping_trainer: SIGUSR1 to this process while step `at` runs."""
    return lambda step: os.kill(os.getpid(), signal.SIGUSR1) if step == at else None


@pytest.mark.parametrize("save_period, saved", [(100, [3]), (3, [3]), (2, [2, 3])])
def test_sigusr1_ends_the_run_at_the_step_boundary_with_its_checkpoint(save_period, saved, caplog):
    """The step under way finishes and checkpoints once (save_period or not), the loop ends, and the previous
    SIGUSR1 handler is back."""
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        trainer = looping_trainer(save_period=save_period, on_step=sigusr1_at(3))
        with caplog.at_level("INFO", logger="nemo_grpo"):
            history = trainer.run()
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert len(history) == 3 == trainer.state.step and trainer.saved == saved
    assert ("received SIGUSR1 (a time limit): checkpoint at step 3 saved to /ckpt/step_3; stopping before step 4 "
            "of 10") in caplog.messages
    assert not any("max_num_epochs" in m for m in caplog.messages)
    assert trainer.summary() == ("done: 3 steps (stopped on SIGUSR1 at step 3 of 10) | reward 0.50 -> 0.50 | "
                                 "checkpoint /ckpt/step_3")


def test_sigusr1_without_checkpointing_still_stops(caplog):
    trainer = looping_trainer(enabled=False, on_step=sigusr1_at(2))
    with caplog.at_level("INFO", logger="nemo_grpo"):
        trainer.run()
    assert trainer.state.step == 2 and trainer.saved == []
    assert ("received SIGUSR1 (a time limit): no checkpoint could be saved (checkpointing.enabled=false); stopping "
            "before step 3 of 10") in caplog.messages
    assert trainer.summary().startswith("done: 2 steps (stopped on SIGUSR1 at step 2 of 10) | ")
