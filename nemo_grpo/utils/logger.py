"""Metrics to TensorBoard / W&B / MLflow, a JSON-lines history, a progress bar and a reward plot.

Everything logged goes to `<log_dir>/metrics.jsonl` (one line per log_metrics call:
{"step": ..., "prefix": ..., **metrics}) and to each enabled back end under the key "<prefix>/<name>"
("train/reward", "val/accuracy", "timing/generation"). The history outlives the run: a resumed run appends
to it, and readers keep the last value logged for a step (steps repeated after a resume overwrite the
ones logged before the crash). save_plot draws train/reward and val/accuracy per step from it.

W&B and MLflow are optional packages, imported only when enabled (logger.wandb_enabled,
logger.mlflow_enabled); their back ends are thin wrappers over the packages' own calls.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import re
import tempfile
import time
from typing import Any, Optional

from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from nemo_grpo.config import ConfigError, LoggerConfig

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "reward.png"
RESERVED_KEYS = ("step", "prefix")


def _require(module: str, key: str, extra: str):
    """Import an optional package, or raise a ConfigError that names the config key that asked for it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"logger.{key} requires the {module} package: pip install nemo-grpo[{extra}] "
                          f"(or set logger.{key}=false)") from None


def prepare_log_dir(path: str, key: str = "logger.log_dir") -> str:
    """Create the directory `path` if needed and check that files can be written in it; returns its absolute
    path. A ConfigError names `key` and the path otherwise (checked before anything is started)."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"config key '{key}': {path} exists but is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"config key '{key}': {path} is not a writable directory ({e.strerror or e})") from None
    return path


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


# ----------------------------------------------------------------------------------------------- back ends
class TensorBoardBackend:
    """torch.utils.tensorboard SummaryWriter in <log_dir>/tensorboard; flushed after every call."""

    def __init__(self, log_dir: str, run_config: Optional[dict]):
        self.writer = SummaryWriter(log_dir=os.path.join(log_dir, "tensorboard"))
        if run_config:
            self.writer.add_text("config", "```\n" + json.dumps(run_config, indent=2, default=str) + "\n```", 0)
            self.writer.flush()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """One W&B run (logger.wandb.project / name) holding the run config; files under <log_dir>."""

    def __init__(self, wandb, cfg: LoggerConfig, run_config: Optional[dict]):
        self.wandb = wandb
        self.run = wandb.init(project=cfg.wandb.project, name=cfg.wandb.name, config=run_config, dir=cfg.log_dir)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.run.log({tag: self.wandb.Html(f"<pre>{text}</pre>")}, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowBackend:
    """One MLflow run in logger.mlflow.experiment_name; the run config is logged as flattened params."""

    _BAD_CHARS = re.compile(r"[^\w\-. /]")  # what MLflow accepts in a metric or param name

    def __init__(self, mlflow, cfg: LoggerConfig, run_config: Optional[dict]):
        self.mlflow = mlflow
        if cfg.mlflow.tracking_uri:
            mlflow.set_tracking_uri(cfg.mlflow.tracking_uri)
        mlflow.set_experiment(cfg.mlflow.experiment_name)
        self.run = mlflow.start_run(run_name=cfg.mlflow.run_name)
        params = {self._name(k): str(v)[:250] for k, v in _flatten(run_config or {}).items()}
        items = list(params.items())
        for start in range(0, len(items), 100):  # MLflow takes at most 100 params per call
            mlflow.log_params(dict(items[start : start + 100]))

    def _name(self, key: str) -> str:
        return self._BAD_CHARS.sub("_", key)  # "math/pass@8" -> "math/pass_8"

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({self._name(k): v for k, v in metrics.items()}, step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.mlflow.log_text(text, f"{self._name(tag)}/step_{step}.txt")

    def close(self) -> None:
        self.mlflow.end_run()


# ----------------------------------------------------------------------------------------------- history
def read_metrics(path: str) -> list[dict]:
    """Every record of a metrics.jsonl file, in the order logged ([] if the file does not exist)."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def metric_series(records: list[dict], prefix: str, name: str) -> tuple[list[int], list[float]]:
    """Steps (ascending) and values of one metric; the last record of a step wins (a resumed run's values)."""
    by_step: dict[int, float] = {}
    for r in records:
        if r.get("prefix") == prefix and name in r and r[name] is not None:
            by_step[int(r["step"])] = float(r[name])
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_reward_curves(metrics_path: str, png_path: str) -> str:
    """PNG with two panels: train/reward and val/accuracy per step, read from metrics_path."""
    # here, not at the top: matplotlib's first import on a machine builds its font cache (fc-list, seconds)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(metrics_path)
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)  # attaches the Agg canvas: no pyplot, no display, no global backend switch
    panels = [("train", "reward", "mean train reward", "tab:blue"),
              ("val", "accuracy", "validation accuracy", "tab:orange")]
    for i, (prefix, name, title, color) in enumerate(panels):
        ax = fig.add_subplot(1, 2, i + 1)
        steps, values = metric_series(records, prefix, name)
        if steps:
            ax.plot(steps, values, marker="o" if len(steps) < 50 else None, markersize=3, color=color)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{title} ({prefix}/{name})")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, format="png")
    return png_path


# ----------------------------------------------------------------------------------------------- logger
class Logger:
    """Fan-out of metrics to the enabled back ends plus metrics.jsonl; progress bar; reward plot."""

    def __init__(self, cfg: LoggerConfig, run_config: Optional[dict] = None):
        self.cfg = cfg
        wandb = _require("wandb", "wandb_enabled", "wandb") if cfg.wandb_enabled else None
        mlflow = _require("mlflow", "mlflow_enabled", "mlflow") if cfg.mlflow_enabled else None
        self.log_dir = prepare_log_dir(cfg.log_dir)
        self.metrics_path = os.path.join(self.log_dir, METRICS_FILE)
        self.backends: list = []
        if cfg.tensorboard_enabled:
            self.backends.append(TensorBoardBackend(self.log_dir, run_config))
        if wandb is not None:
            self.backends.append(WandbBackend(wandb, cfg, run_config))
        if mlflow is not None:
            self.backends.append(MLflowBackend(mlflow, cfg, run_config))
        self._bar = None
        self._total_steps: Optional[int] = None
        self._last_update: Optional[float] = None
        self._closed = False

    # ------------------------------------------------------------------------------------------ metrics
    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str = "") -> None:
        """Log scalars at `step` as "<prefix>/<name>" to every back end and append one line to metrics.jsonl."""
        values: dict[str, float] = {}
        for name, value in metrics.items():
            if name in RESERVED_KEYS:
                raise ValueError(f"metric name '{name}' is reserved in {METRICS_FILE} (reserved: {RESERVED_KEYS})")
            try:
                values[name] = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"metric '{_join(prefix, name)}' must be a number, "
                                f"got {type(value).__name__}") from None
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": step, "prefix": prefix, **values}) + "\n")
        keyed = {_join(prefix, name): v for name, v in values.items()}
        for backend in self.backends:
            backend.log_metrics(keyed, step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Log a block of text (e.g. a few validation samples) through Python logging (the console and the
        run's log file) and to the back ends under `tag`."""
        log.info("%s at step %d:\n%s", tag, step, text)
        for backend in self.backends:
            backend.log_text(tag, text, step)

    # ------------------------------------------------------------------------------------------ progress
    def start_progress(self, total_steps: int, initial_step: int = 0) -> None:
        """A tqdm bar over steps (logger.progress_bar), or one log line per step when it is off."""
        self._total_steps = total_steps
        self._last_update = time.perf_counter()
        if self.cfg.progress_bar:
            self._bar = tqdm(total=total_steps, initial=initial_step, desc="GRPO", unit="step", dynamic_ncols=True)

    def update_progress(self, step: int, reward: float, timings: Optional[dict[str, float]] = None) -> None:
        """Show `step`, the mean reward and seconds per step (timings["total"], else the wall time since the
        previous update)."""
        now = time.perf_counter()
        seconds = (timings or {}).get("total")
        if seconds is None:
            seconds = now - self._last_update if self._last_update is not None else math.nan
        self._last_update = now
        text = f"reward {reward:.3f} | {seconds:.2f} s/step"
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix_str(text)
        else:
            log.info("step %d/%s | %s", step, self._total_steps if self._total_steps is not None else "?", text)

    # ------------------------------------------------------------------------------------------ end
    def save_plot(self, path: Optional[str] = None) -> str:
        """Write the reward / validation-accuracy PNG (default <log_dir>/reward.png); returns its path."""
        return plot_reward_curves(self.metrics_path, path or os.path.join(self.log_dir, PLOT_FILE))

    def close(self) -> None:
        """Close the progress bar and every back end (safe to call twice; save_plot still works after)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for backend in self.backends:
            backend.close()
