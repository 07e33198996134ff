"""Checkpoint directories: written under a temporary name, renamed into place when complete, top-k retention.

Layout of checkpointing.checkpoint_dir:

    step_<N>/             a finalized checkpoint: training_info.json, config.yaml, whatever the caller wrote
                          (the policy's sharded state in policy/), and manifest.json (every other file's size)
    tmp_step_<N>/         being written (init_tmp_checkpoint -> caller saves into it -> finalize_checkpoint)
    old_step_<N>/         a finalized step_<N> moved aside while a new step_<N> replaces it
    trash_step_<N>/       being deleted by retention

Only step_<N> (and old_step_<N> while its step_<N> is missing) count as checkpoints, so a crash at any point
leaves every previously finalized checkpoint loadable and never makes a half-written directory the newest:

- crash while writing tmp_step_<N>: it is ignored, and removed by the next init_tmp_checkpoint;
- crash while replacing an existing step_<N>: the old one is still there as old_step_<N> (or as step_<N>) and
  is put back (or dropped once the new one is in place) when the next manager starts;
- crash while deleting: the directory was first renamed to trash_step_<N>, which nothing loads.

A finalized checkpoint can still be damaged afterwards (a disk filled or a copy cut short): resuming
(get_latest_checkpoint_path) checks the newest one against its manifest first (file sizes only, no read of the
weights) and falls back to the newest one that checks out; see checkpoint_problem.

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

import yaml

from nemo_grpo.config import CheckpointingConfig, ConfigError
from nemo_grpo.errors import UserInputError

log = logging.getLogger(__name__)

TRAINING_INFO = "training_info.json"
CONFIG_YAML = "config.yaml"
POLICY_DIR = "policy"  # the policy's sharded state (Policy.save_checkpoint) inside step_<N>
MANIFEST = "manifest.json"  # relative path -> bytes of every other file, written by finalize_checkpoint
FORMAT_KEY = "checkpoint_format"  # in training_info.json: 2 = this checkpoint was finalized with a manifest
FORMAT = 2
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


def _fsync_write_json(path: str, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, default=_to_json)
        f.flush()
        os.fsync(f.fileno())


def _file_sizes(path: str) -> dict[str, int]:
    """relative path ('policy/__0_0.distcp') -> bytes of every file under `path` except the manifest."""
    sizes = {}
    for folder, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), path).replace(os.sep, "/")
            if rel != MANIFEST:
                sizes[rel] = os.path.getsize(os.path.join(folder, name))
    return sizes


def _info_problem(path: str) -> tuple[Optional[dict], Optional[str]]:
    """(training_info, None), or (None, what is wrong with it)."""
    try:
        with open(os.path.join(path, TRAINING_INFO)) as f:
            info = json.load(f)
    except OSError as e:
        return None, f"{TRAINING_INFO} cannot be read ({e.strerror or e})"
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        return None, f"{TRAINING_INFO} is not valid JSON ({e})"
    if not isinstance(info, dict) or not isinstance(info.get("step"), int):
        return None, f"{TRAINING_INFO} is not an object with an integer 'step'"
    return info, None


def checkpoint_problem(path: str) -> Optional[str]:
    """What is wrong with the finalized checkpoint `path` ("policy/__0_0.distcp: 1024 bytes, the manifest says
    52311"), or None if it checks out. Checked: training_info.json parses (an object with an integer step),
    manifest.json is there and parses, and every file it lists exists with the size it lists (sizes only: a
    70B checkpoint is checked by a few thousand stat calls, its weights are not read). Files the manifest does
    not list are ignored.

    A checkpoint written before manifests existed (its training_info.json has no checkpoint_format) is
    accepted unchecked when its training_info.json parses: it was renamed into place only once complete, so
    refusing it would turn every upgrade mid-run into a lost run; a newer one without its manifest is damaged.
    """
    info, problem = _info_problem(path)
    if problem is not None:
        return problem
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        return f"{MANIFEST} is missing" if FORMAT_KEY in info else None
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            sizes = json.load(f)
    except (OSError, ValueError) as e:
        return f"{MANIFEST} cannot be read ({e})"
    if not isinstance(sizes, dict) or not all(isinstance(n, int) for n in sizes.values()):
        return f"{MANIFEST} is not an object of file sizes"
    for rel, size in sorted(sizes.items()):
        full = os.path.join(path, *rel.split("/"))
        if not os.path.isfile(full):
            return f"{rel} is missing"
        actual = os.path.getsize(full)
        if actual != size:
            return f"{rel}: {actual} bytes, the manifest says {size}"
    return None


def _listed(damaged: list[tuple[str, str]]) -> str:
    """'results/x/step_4 (policy/a.distcp is missing), results/x/step_2 (...)'"""
    return ", ".join(f"{path} ({problem})" for path, problem in damaged)


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
        self._reported: set[str] = set()  # the warnings get_latest_checkpoint_path has given
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
        _fsync_write_json(os.path.join(tmp, TRAINING_INFO), {**training_info, FORMAT_KEY: FORMAT})
        if config_yaml is not None:
            with open(os.path.join(tmp, CONFIG_YAML), "w") as f:
                f.write(config_yaml)
        return tmp

    def finalize_checkpoint(self, tmp_path: str) -> str:
        """Write its manifest (every file's size), rename tmp_step_<N> to step_<N> (replacing an existing
        step_<N> without a moment in which neither is a checkpoint), then apply keep_top_k retention. Returns
        the final path."""
        tmp_path = os.path.abspath(tmp_path)
        parsed = _parse(os.path.basename(tmp_path))
        if os.path.dirname(tmp_path) != self.root or parsed is None or parsed[0] != TMP_PREFIX:
            raise ValueError(f"{tmp_path} is not a temporary checkpoint made by init_tmp_checkpoint in {self.root}")
        if not os.path.isfile(os.path.join(tmp_path, TRAINING_INFO)):
            raise FileNotFoundError(f"{tmp_path} has no {TRAINING_INFO}: it was not made by init_tmp_checkpoint "
                                    f"or was already finalized")
        _fsync_write_json(os.path.join(tmp_path, MANIFEST), _file_sizes(tmp_path))
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
        """The finalized checkpoint with the highest step that checks out (checkpoint_problem), or None if there
        is none (temporary dirs ignored). Newer damaged ones are skipped with one warning naming each and what
        is wrong; if every checkpoint is damaged, a UserInputError names the directory and the remedy."""
        found = self._finalized()
        damaged = []  # ("results/x/step_4", what is wrong), newest first
        for step in sorted(found, reverse=True):
            problem = checkpoint_problem(found[step])
            if problem is None:
                self._report(damaged, found[step])
                return found[step]
            damaged.append((self._shown(found[step]), problem))
        if damaged:
            raise UserInputError(
                f"config key 'checkpointing.checkpoint_dir': no checkpoint in {self.cfg.checkpoint_dir} can be "
                f"resumed, each is damaged: {_listed(damaged)}; set checkpointing.resume=false to start over, "
                "or move the damaged checkpoints away")
        return None

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

    def _shown(self, path: str) -> str:
        """A checkpoint's path as the user named its directory ("results/x/step_4")."""
        return os.path.join(self.cfg.checkpoint_dir, os.path.basename(path))

    def _report(self, damaged: list[tuple[str, str]], resumed: str) -> None:
        """One warning for the damaged checkpoints skipped on the way to `resumed`, and one for a checkpoint
        older than manifests (its files go unchecked); each said once per manager."""
        messages = []
        if damaged:
            which = "checkpoint" if len(damaged) == 1 else "checkpoints"
            verb = "is" if len(damaged) == 1 else "are"
            messages.append(f"{which} {_listed(damaged)} {verb} damaged: resuming from {os.path.basename(resumed)}")
        if not os.path.isfile(os.path.join(resumed, MANIFEST)):
            messages.append(f"checkpoint {self._shown(resumed)} has no {MANIFEST} (written by an older version): "
                            "resuming from it without checking its files")
        for message in messages:
            if message not in self._reported:
                self._reported.add(message)
                log.warning("%s", message)

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
        """step -> path of finalized checkpoints: step_<N>, or old_step_<N> where a replacement was cut short.
        A damaged one is listed too (only a finalized directory has these names): checkpoint_problem tells."""
        dirs = self._scan()
        found = {s: p for s, p in dirs[OLD_PREFIX].items() if s not in dirs[FINAL_PREFIX]}
        found.update(dirs[FINAL_PREFIX])
        return found

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
        """Keep the keep_top_k best by metrics[metric_name] plus the newest intact one; delete the rest.

        Checkpoints without the metric (or with metric_name null) rank below every checkpoint that has it,
        newer before older, so with no metric at all this keeps the newest keep_top_k. Damaged checkpoints
        (checkpoint_problem) rank below all of them and are never kept as the newest.
        """
        k = self.cfg.keep_top_k
        found = self._finalized()
        if k is None or len(found) <= k:
            return
        sign = 1.0 if self.cfg.higher_is_better else -1.0
        intact = {step for step, path in found.items() if checkpoint_problem(path) is None}

        def rank(step: int) -> tuple:
            value = self._metric(found[step]) if step in intact else None
            return (step in intact, value is not None, sign * value if value is not None else 0.0, step)

        keep = set(sorted(found, key=rank, reverse=True)[:k]) | ({max(intact)} if intact else set())
        for step in sorted(found):
            if step not in keep:
                self._delete(found[step])
                log.info("removed checkpoint step_%d (keep_top_k=%d)", step, k)
