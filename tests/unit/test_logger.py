"""Logger (metrics.jsonl history, TensorBoard scalars, reward plot, optional back ends) and Timer."""

import json
import logging
import sys

import pytest

from nemo_grpo.config import ConfigError, LoggerConfig
from nemo_grpo.utils.logger import Logger, metric_series, prepare_log_dir, read_metrics
from nemo_grpo.utils.timer import Timer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _logger(tmp_path, **overrides) -> Logger:
    cfg = LoggerConfig(log_dir=str(tmp_path / "logs"), progress_bar=False, **overrides)
    return Logger(cfg, run_config={"grpo": {"seed": 1}})


def test_metrics_jsonl_has_one_line_per_call(tmp_path):
    logger = _logger(tmp_path, tensorboard_enabled=False)
    logger.log_metrics({"reward": 0.25, "loss": 1.5}, step=1, prefix="train")
    logger.log_metrics({"accuracy": 0.5}, step=1, prefix="val")
    logger.log_metrics({"reward": 0.75, "loss": 1.0}, step=2, prefix="train")
    logger.close()
    with open(tmp_path / "logs" / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert lines == [{"step": 1, "prefix": "train", "reward": 0.25, "loss": 1.5},
                     {"step": 1, "prefix": "val", "accuracy": 0.5},
                     {"step": 2, "prefix": "train", "reward": 0.75, "loss": 1.0}]


def test_history_survives_a_resume_and_the_last_value_of_a_step_wins(tmp_path):
    first = _logger(tmp_path, tensorboard_enabled=False)
    for step in (1, 2, 3):
        first.log_metrics({"reward": float(step)}, step, prefix="train")
    first.close()
    resumed = _logger(tmp_path, tensorboard_enabled=False)  # resumed from a checkpoint at step 2
    resumed.log_metrics({"reward": 30.0}, 3, prefix="train")
    resumed.close()
    records = read_metrics(str(tmp_path / "logs" / "metrics.jsonl"))
    assert len(records) == 4
    assert metric_series(records, "train", "reward") == ([1, 2, 3], [1.0, 2.0, 30.0])
    assert metric_series(records, "val", "accuracy") == ([], [])


def test_bad_metric_values_name_the_metric(tmp_path):
    logger = _logger(tmp_path, tensorboard_enabled=False)
    with pytest.raises(TypeError, match="train/texts"):
        logger.log_metrics({"texts": ["a", "b"]}, 1, prefix="train")
    with pytest.raises(ValueError, match="reserved"):
        logger.log_metrics({"step": 1.0}, 1, prefix="train")
    logger.close()


def test_tensorboard_event_file_holds_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = _logger(tmp_path)
    logger.log_metrics({"reward": 0.25}, step=1, prefix="train")
    logger.log_metrics({"reward": 0.5}, step=2, prefix="train")
    logger.log_metrics({"generation": 1.5}, step=2, prefix="timing")
    logger.close()
    acc = EventAccumulator(str(tmp_path / "logs" / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/reward", "timing/generation"}
    assert [(e.step, e.value) for e in acc.Scalars("train/reward")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("timing/generation")] == [(2, 1.5)]


def test_save_plot_writes_a_png(tmp_path):
    import matplotlib.image

    logger = _logger(tmp_path, tensorboard_enabled=False)
    for step in range(1, 6):
        logger.log_metrics({"reward": step / 10}, step, prefix="train")
    logger.log_metrics({"accuracy": 0.4}, 5, prefix="val")
    logger.close()
    path = logger.save_plot()  # after close, as the trainer does
    assert path == str(tmp_path / "logs" / "reward.png")
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    height, width = matplotlib.image.imread(path).shape[:2]
    assert (width, height) == (1000, 400)  # two panels side by side


def test_save_plot_without_history_still_writes_a_png(tmp_path):
    logger = _logger(tmp_path, tensorboard_enabled=False)
    path = logger.save_plot(str(tmp_path / "empty.png"))
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC


@pytest.mark.parametrize("key, module", [("wandb_enabled", "wandb"), ("mlflow_enabled", "mlflow")])
def test_missing_optional_package_names_the_key(tmp_path, monkeypatch, key, module):
    monkeypatch.setitem(sys.modules, module, None)  # import fails even where the package is installed
    with pytest.raises(ConfigError, match=rf"logger\.{key} requires the {module} package: "
                                          rf"pip install nemo-grpo\[{module}\]"):
        _logger(tmp_path, **{key: True})
    assert not (tmp_path / "logs" / "tensorboard").exists()  # nothing half-built


def test_progress_reports_step_reward_and_seconds(tmp_path, caplog):
    logger = _logger(tmp_path, tensorboard_enabled=False)
    logger.start_progress(total_steps=10, initial_step=4)
    with caplog.at_level(logging.INFO, logger="nemo_grpo.utils.logger"):
        logger.update_progress(5, reward=0.375, timings={"total": 2.5, "generation": 1.0})
    logger.close()
    assert "step 5/10" in caplog.text and "reward 0.375" in caplog.text and "2.50 s/step" in caplog.text


def test_progress_bar_counts_from_the_resumed_step(tmp_path):
    logger = Logger(LoggerConfig(log_dir=str(tmp_path / "logs"), tensorboard_enabled=False, progress_bar=True))
    logger.start_progress(total_steps=10, initial_step=4)
    logger.update_progress(6, reward=0.5, timings={"step": 1.0})
    assert logger._bar.n == 6 and "reward 0.500" in logger._bar.postfix
    logger.close()


# ----------------------------------------------------------------------------------------------- timer
class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_timer_nested_sections_sum_separately():
    clock = FakeClock()
    timer = Timer(clock=clock)
    with timer.time("step"):
        for turn in range(2):
            with timer.time("generation"):
                clock.now += 1.0 + turn  # 1 s, then 2 s
            with timer.time("environment"):
                clock.now += 0.25
        with timer.time("training"):
            clock.now += 4.0
    assert timer.get_timing_metrics() == {"generation": 3.0, "environment": 0.5, "training": 4.0, "step": 7.5}
    assert timer.get_timing_metrics("mean")["generation"] == 1.5
    assert timer.get_timing_metrics("max")["generation"] == 2.0
    assert timer.get_timing_metrics("count")["environment"] == 2.0
    timer.reset()
    assert timer.get_timing_metrics() == {}


def test_timer_records_a_section_that_raises_and_rejects_reentry():
    clock = FakeClock()
    timer = Timer(clock=clock)
    with pytest.raises(RuntimeError):
        with timer.time("generation"):
            clock.now += 2.0
            raise RuntimeError("engine died")
    assert timer.get_timing_metrics() == {"generation": 2.0}
    with timer.time("step"):
        with pytest.raises(ValueError, match="'step' is already open"):
            with timer.time("step"):
                pass
    with pytest.raises(ValueError, match="sum, mean"):
        timer.get_timing_metrics("median")


# ----------------------------------------------------------------------------------------------- log dir, text
def test_log_dir_that_cannot_hold_files_names_the_key_and_path(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"config key 'logger.log_dir': .*a_file exists but is not a directory"):
        Logger(LoggerConfig(log_dir=str(blocker), tensorboard_enabled=False))
    with pytest.raises(ConfigError, match=r"config key 'logger.log_dir': .*a_file/logs is not a writable directory"):
        Logger(LoggerConfig(log_dir=str(blocker / "logs"), tensorboard_enabled=False))
    assert prepare_log_dir(str(tmp_path / "new" / "logs")) == str(tmp_path / "new" / "logs")
    assert (tmp_path / "new" / "logs").is_dir() and not list((tmp_path / "new" / "logs").iterdir())  # probe gone


def test_log_text_goes_to_logging_and_the_back_ends(tmp_path, caplog):
    logger = _logger(tmp_path, tensorboard_enabled=False)
    got = []

    class Backend:
        def log_text(self, tag, text, step):
            got.append((tag, text, step))

        def close(self):
            pass

    logger.backends.append(Backend())
    with caplog.at_level(logging.INFO, logger="nemo_grpo.utils.logger"):
        logger.log_text("val/samples", "sample 1 | reward 1.000", 7)
    logger.close()
    assert got == [("val/samples", "sample 1 | reward 1.000", 7)]
    assert "val/samples at step 7:\nsample 1 | reward 1.000" in caplog.text
