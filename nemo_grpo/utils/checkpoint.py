"""Checkpoint directories: written under a temporary name, renamed into place when complete, top-k retention.

Layout of checkpointing.checkpoint_dir:

    step_<N>/             a finalized checkpoint: training_info.json, config.yaml, and whatever the caller wrote
                          (the policy's sharded state in policy/)
    tmp_step_<N>/         being written (init_tmp_checkpoint -> caller saves into it -> finalize_checkpoint)
    old_step_<N>/         a finalized step_<N> moved aside while a new step_<N> replaces it
    trash_step_<N>/       being deleted by retention

Only step_<N> (and old_step_<N> while its step_<N> is missing) count as checkpoints, so a crash at any point
leaves every previously finalized checkpoint loadable and never makes a half-written directory the newest:

- crash while writing tmp_step_<N>: it is ignored, and removed by the next init_tmp_checkpoint;
- crash while replacing an existing step_<N>: the old one is still there as old_step_<N> (or as step_<N>) and
  is put back (or dropped once the new one is in place) when the next manager starts;
- crash while deleting: the directory was first renamed to trash_step_<N>, which nothing loads.

Renames stay within checkpoint_dir, so they are atomic on one filesystem (POSIX rename). One writer per
checkpoint_dir is assumed (the trainer's driver process); the policy's ranks write only inside policy/.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
from typing import Any, Optional

from nemo_grpo.config import CheckpointingConfig, ConfigError

log = logging.getLogger(__name__)

TRAINING_INFO = "training_info.json"
CONFIG_YAML = "config.yaml"
FINAL_PREFIX, TMP_PREFIX, OLD_PREFIX, TRASH_PREFIX = "step_", "tmp_step_", "old_step_", "trash_step_"
_NAME = re.compile(r"^(step_|tmp_step_|old_step_|trash_step_)(\d+)$")


def _parse(name: str) -> Optional[tuple[str, int]]:
    """'old_step_12' -> ('old_step_', 12); None for names this module does not own."""
    m = _NAME.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def _to_json(value: Any) -> Any:
    """json.dump fallback: tensor / numpy scalars become Python numbers."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _fsync_dir(path: str) -> None:
    """Make a rename inside `path` durable (best effort: not every filesystem supports it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CheckpointManager:
    """Temporary-then-rename checkpoints under cfg.checkpoint_dir with top-k retention by a metric.

    Usage (the trainer's save):
        tmp = manager.init_tmp_checkpoint(step, training_info, config_yaml)
        policy.save_checkpoint(os.path.join(tmp, "policy"))
        path = manager.finalize_checkpoint(tmp)   # -> <checkpoint_dir>/step_<step>
    """

    def __init__(self, cfg: CheckpointingConfig):
        self.cfg = cfg
        self.root = os.path.abspath(cfg.checkpoint_dir)
        if cfg.enabled:
            self._check_root()
            self._recover()

    # ------------------------------------------------------------------------------------------ public
    def init_tmp_checkpoint(self, step: int, training_info: dict, config_yaml: Optional[str] = None) -> str:
        """Create <checkpoint_dir>/tmp_step_<step>, write training_info.json (+ config.yaml) into it, return it.

        Temporary directories left by a crashed save are removed first. The caller writes the rest (the
        policy state) into the returned directory, then calls finalize_checkpoint on it.
        """
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        self._check_root()
        self._recover()
        for name in os.listdir(self.root):
            parsed = _parse(name)
            if parsed and parsed[0] in (TMP_PREFIX, TRASH_PREFIX):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        tmp = os.path.join(self.root, f"{TMP_PREFIX}{step}")
        os.makedirs(tmp)
        with open(os.path.join(tmp, TRAINING_INFO), "w") as f:
            json.dump(training_info, f, indent=2, default=_to_json)
            f.flush()
            os.fsync(f.fileno())
        if config_yaml is not None:
            with open(os.path.join(tmp, CONFIG_YAML), "w") as f:
                f.write(config_yaml)
        return tmp

    def finalize_checkpoint(self, tmp_path: str) -> str:
        """Rename tmp_step_<N> to step_<N> (replacing an existing step_<N> without a moment in which neither
        is a checkpoint), then apply keep_top_k retention. Returns the final path."""
        tmp_path = os.path.abspath(tmp_path)
        parsed = _parse(os.path.basename(tmp_path))
        if os.path.dirname(tmp_path) != self.root or parsed is None or parsed[0] != TMP_PREFIX:
            raise ValueError(f"{tmp_path} is not a temporary checkpoint made by init_tmp_checkpoint in {self.root}")
        if not os.path.isfile(os.path.join(tmp_path, TRAINING_INFO)):
            raise FileNotFoundError(f"{tmp_path} has no {TRAINING_INFO}: it was not made by init_tmp_checkpoint "
                                    f"or was already finalized")
        step = parsed[1]
        final = os.path.join(self.root, f"{FINAL_PREFIX}{step}")
        old = os.path.join(self.root, f"{OLD_PREFIX}{step}")
        if os.path.exists(final):
            if os.path.exists(old):  # a stale copy from an earlier crash; `final` is the valid one
                self._delete(old)
            os.rename(final, old)  # from here until the next rename, `old` is step N's checkpoint
        try:
            os.rename(tmp_path, final)
        except OSError:
            if os.path.exists(old) and not os.path.exists(final):
                os.rename(old, final)
            raise
        _fsync_dir(self.root)
        if os.path.exists(old):
            self._delete(old)
        self._apply_retention()
        log.info("checkpoint saved: %s", final)
        return final

    def get_latest_checkpoint_path(self) -> Optional[str]:
        """The finalized checkpoint with the highest step, or None if there is none (temporary dirs ignored)."""
        found = self._finalized()
        return found[max(found)] if found else None

    def list_checkpoints(self) -> dict[int, str]:
        """step -> path of every finalized checkpoint, ascending by step."""
        found = self._finalized()
        return {step: found[step] for step in sorted(found)}

    @staticmethod
    def load_training_info(path: str) -> dict:
        """The training_info.json of the checkpoint directory `path`."""
        info_path = os.path.join(path, TRAINING_INFO)
        if not os.path.isfile(info_path):
            raise FileNotFoundError(f"{path} is not a checkpoint: {TRAINING_INFO} is missing")
        with open(info_path) as f:
            return json.load(f)

    @staticmethod
    def load_config(path: str) -> dict:
        """The config.yaml the run saved in checkpoint `path` ({} when it saved none)."""
        import yaml

        config_path = os.path.join(path, CONFIG_YAML)
        if not os.path.isfile(config_path):
            return {}
        with open(config_path) as f:
            return yaml.safe_load(f) or {}

    # ------------------------------------------------------------------------------------------ internals
    def _check_root(self) -> None:
        """Create checkpoint_dir if needed; a clear error if it is not a writable directory."""
        key = "checkpointing.checkpoint_dir"
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ConfigError(f"config key '{key}': {self.root} exists but is not a directory")
        try:
            os.makedirs(self.root, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=self.root)
            os.close(fd)
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"config key '{key}': {self.root} is not a writable directory "
                              f"({e.strerror or e})") from None

    def _scan(self) -> dict[str, dict[int, str]]:
        """prefix -> {step: path} of every directory this module owns."""
        out: dict[str, dict[int, str]] = {p: {} for p in (FINAL_PREFIX, TMP_PREFIX, OLD_PREFIX, TRASH_PREFIX)}
        if not os.path.isdir(self.root):
            return out
        for name in os.listdir(self.root):
            parsed = _parse(name)
            path = os.path.join(self.root, name)
            if parsed and os.path.isdir(path):
                out[parsed[0]][parsed[1]] = path
        return out

    def _finalized(self) -> dict[int, str]:
        """step -> path of complete checkpoints: step_<N>, or old_step_<N> where a replacement was cut short."""
        dirs = self._scan()
        found = {s: p for s, p in dirs[OLD_PREFIX].items() if s not in dirs[FINAL_PREFIX]}
        found.update(dirs[FINAL_PREFIX])
        return {s: p for s, p in found.items() if os.path.isfile(os.path.join(p, TRAINING_INFO))}

    def _recover(self) -> None:
        """Finish or undo a replacement of step_<N> that a crash interrupted."""
        dirs = self._scan()
        for step, old in dirs[OLD_PREFIX].items():
            if step in dirs[FINAL_PREFIX]:
                self._delete(old)
            else:
                os.rename(old, os.path.join(self.root, f"{FINAL_PREFIX}{step}"))
                log.warning("restored checkpoint step_%d after an interrupted save", step)

    def _delete(self, path: str) -> None:
        """Rename out of the checkpoint namespace first, so a crash mid-delete leaves nothing loadable."""
        parsed = _parse(os.path.basename(path))
        trash = os.path.join(self.root, f"{TRASH_PREFIX}{parsed[1] if parsed else 0}")
        if os.path.exists(trash):
            shutil.rmtree(trash)
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _metric(self, path: str) -> Optional[float]:
        name = self.cfg.metric_name
        if name is None:
            return None
        value = self.load_training_info(path).get("metrics", {}).get(name)
        if value is None or not isinstance(value, (int, float)) or math.isnan(value):
            return None
        return float(value)

    def _apply_retention(self) -> None:
        """Keep the keep_top_k best by metrics[metric_name] plus the newest; delete the rest.

        Checkpoints without the metric (or with metric_name null) rank below every checkpoint that has it,
        newer before older, so with no metric at all this keeps the newest keep_top_k.
        """
        k = self.cfg.keep_top_k
        found = self._finalized()
        if k is None or len(found) <= k:
            return
        sign = 1.0 if self.cfg.higher_is_better else -1.0

        def rank(step: int) -> tuple:
            value = self._metric(found[step])
            return (value is not None, sign * value if value is not None else 0.0, step)

        keep = set(sorted(found, key=rank, reverse=True)[:k]) | {max(found)}
        for step in sorted(found):
            if step not in keep:
                self._delete(found[step])
                log.info("removed checkpoint step_%d (keep_top_k=%d)", step, k)
