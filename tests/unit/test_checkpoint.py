"""Checkpoint directories: atomic finalize, crash safety at every stage, top-k retention, directory errors."""

import json
import logging
import os

import pytest

from nemo_grpo.config import CheckpointingConfig, ConfigError
from nemo_grpo.errors import UserInputError
from nemo_grpo.utils.checkpoint import CheckpointManager


def _manager(tmp_path, **overrides) -> CheckpointManager:
    cfg = CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"), **overrides)
    return CheckpointManager(cfg)


def _save(m: CheckpointManager, step: int, metrics=None, payload="weights", finalize=True) -> str:
    """What the trainer does: init, write the policy state into policy/, finalize."""
    tmp = m.init_tmp_checkpoint(step, {"step": step, "metrics": metrics or {}}, config_yaml="grpo:\n  seed: 1\n")
    os.makedirs(os.path.join(tmp, "policy"))
    with open(os.path.join(tmp, "policy", "shard_0.pt"), "w") as f:
        f.write(payload)
    return m.finalize_checkpoint(tmp) if finalize else tmp


def _payload(path: str) -> str:
    with open(os.path.join(path, "policy", "shard_0.pt")) as f:
        return f.read()


def _steps(m: CheckpointManager) -> list[int]:
    return sorted(m.list_checkpoints())


def test_finalize_renames_tmp_into_place(tmp_path):
    m = _manager(tmp_path)
    tmp = _save(m, 3, finalize=False)
    assert os.path.basename(tmp) == "tmp_step_3" and m.get_latest_checkpoint_path() is None
    final = m.finalize_checkpoint(tmp)
    assert final == str(tmp_path / "ckpt" / "step_3")
    assert not os.path.exists(tmp)
    assert sorted(os.listdir(final)) == ["config.yaml", "manifest.json", "policy", "training_info.json"]
    assert m.load_training_info(final) == {"step": 3, "metrics": {}, "checkpoint_format": 2}
    with open(os.path.join(final, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest == {name: os.path.getsize(os.path.join(final, name))
                        for name in ("config.yaml", "policy/shard_0.pt", "training_info.json")}
    assert _payload(final) == "weights"


def test_latest_is_highest_step_not_newest_written(tmp_path):
    m = _manager(tmp_path, keep_top_k=None)
    for step in (10, 2, 30, 4):
        _save(m, step)
    assert m.get_latest_checkpoint_path() == str(tmp_path / "ckpt" / "step_30")
    assert _steps(m) == [2, 4, 10, 30]  # keep_top_k None keeps all


def test_crash_before_finalize_keeps_previous_and_tmp_is_cleaned(tmp_path):
    m = _manager(tmp_path)
    _save(m, 1, payload="one")
    _save(m, 2, payload="half-written", finalize=False)  # the run dies while the policy is being saved
    m2 = _manager(tmp_path)  # the restarted run
    latest = m2.get_latest_checkpoint_path()
    assert latest == str(tmp_path / "ckpt" / "step_1") and _payload(latest) == "one"
    _save(m2, 5)  # the next save removes the leftover
    assert not os.path.exists(tmp_path / "ckpt" / "tmp_step_2")
    assert _steps(m2) == [1, 5]


def test_resaving_a_step_keeps_a_valid_checkpoint_at_every_stage(tmp_path, monkeypatch):
    m = _manager(tmp_path)
    first = _save(m, 7, payload="old")
    # 1) crash while writing the replacement: the old step_7 is untouched
    _save(m, 7, payload="new-partial", finalize=False)
    assert m.get_latest_checkpoint_path() == first and _payload(first) == "old"
    # 2) crash between moving the old step_7 aside and renaming the new one into place
    _save(m, 7, payload="new")
    real_rename = os.rename

    def dies_on_final_rename(src, dst):
        if os.path.basename(src) == "tmp_step_7":
            raise KeyboardInterrupt("killed")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", dies_on_final_rename)
    tmp = _save(m, 7, payload="newer", finalize=False)
    with pytest.raises(KeyboardInterrupt):
        m.finalize_checkpoint(tmp)
    monkeypatch.setattr(os, "rename", real_rename)
    assert not os.path.exists(first)  # the window: step_7 is moved aside ...
    latest = m.get_latest_checkpoint_path()  # ... and still found
    assert latest is not None and _payload(latest) == "new"
    m2 = _manager(tmp_path)  # restart: the moved-aside checkpoint is put back
    assert m2.get_latest_checkpoint_path() == first and _payload(first) == "new"
    # 3) a replacement that completes
    _save(m2, 7, payload="final")
    assert _payload(first) == "final" and os.listdir(tmp_path / "ckpt") == ["step_7"]


def test_keep_top_k_keeps_best_by_metric_plus_newest(tmp_path):
    m = _manager(tmp_path, keep_top_k=2, metric_name="val:accuracy", higher_is_better=True)
    for step, acc in [(1, 0.9), (2, 0.1), (3, 0.8), (4, 0.2), (5, 0.3)]:
        _save(m, step, {"val:accuracy": acc})
    assert _steps(m) == [1, 3, 5]  # best two + the newest (needed to resume)
    _save(m, 6, {"val:accuracy": 0.85})
    assert _steps(m) == [1, 6]  # the newest is also second best: nothing extra kept


def test_keep_top_k_lower_is_better(tmp_path):
    m = _manager(tmp_path, keep_top_k=2, metric_name="val:loss", higher_is_better=False)
    for step, loss in [(1, 0.9), (2, 0.1), (3, 0.8), (4, 0.2), (5, 0.3)]:
        _save(m, step, {"val:loss": loss})
    assert _steps(m) == [2, 4, 5]


def test_keep_top_k_without_metric_keeps_newest(tmp_path):
    m = _manager(tmp_path, keep_top_k=2, metric_name=None)
    for step in range(1, 6):
        _save(m, step, {"val:accuracy": 1.0 / step})
    assert _steps(m) == [4, 5]
    m = _manager(tmp_path / "b", keep_top_k=2, metric_name="val:accuracy")
    for step in range(1, 6):
        _save(m, step, {})  # metric never logged (no validation yet)
    assert _steps(m) == [4, 5]


def test_checkpoints_with_the_metric_outrank_those_without(tmp_path):
    m = _manager(tmp_path, keep_top_k=2, metric_name="val:accuracy")
    _save(m, 1, {"val:accuracy": 0.1})
    _save(m, 2, {})
    _save(m, 3, {"val:accuracy": 0.05})
    _save(m, 4, {})
    assert _steps(m) == [1, 3, 4]


def test_checkpoint_dir_that_is_a_file_is_a_clear_error(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"checkpointing\.checkpoint_dir.*ckpt.*not a directory"):
        _manager(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to a read-only directory")
def test_unwritable_checkpoint_dir_is_a_clear_error(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    path.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match=r"checkpointing\.checkpoint_dir.*ckpt.*not a writable directory"):
            _manager(tmp_path)
    finally:
        path.chmod(0o700)


def test_finalize_rejects_foreign_directories(tmp_path):
    m = _manager(tmp_path)
    stray = tmp_path / "ckpt" / "tmp_step_4"
    stray.mkdir()  # no training_info.json: not made by init_tmp_checkpoint
    with pytest.raises(FileNotFoundError, match="training_info.json"):
        m.finalize_checkpoint(str(stray))
    with pytest.raises(ValueError, match="not a temporary checkpoint"):
        m.finalize_checkpoint(str(tmp_path))
    assert m.get_latest_checkpoint_path() is None


# ----------------------------------------------------------------------------------------------- damaged checkpoints
def _truncate(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


DAMAGE = {  # how a finalized checkpoint gets damaged -> what the warning says about it
    "a truncated shard": (lambda p: _truncate(os.path.join(p, "policy", "shard_0.pt"), 3),
                          "policy/shard_0.pt: 3 bytes, the manifest says 7"),
    "a missing shard": (lambda p: os.remove(os.path.join(p, "policy", "shard_0.pt")), "policy/shard_0.pt is missing"),
    "no manifest": (lambda p: os.remove(os.path.join(p, "manifest.json")), "manifest.json is missing"),
    "training_info cut mid-write": (lambda p: _truncate(os.path.join(p, "training_info.json"), 10),
                                    "training_info.json is not valid JSON"),
    "no training_info": (lambda p: os.remove(os.path.join(p, "training_info.json")),
                         "training_info.json cannot be read (No such file or directory)"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_is_skipped_with_one_warning(tmp_path, caplog, damage):
    m = _manager(tmp_path, keep_top_k=None)
    for step in (2, 4):
        _save(m, step, payload="weights")
    break_it, what = DAMAGE[damage]
    break_it(str(tmp_path / "ckpt" / "step_4"))
    m2 = _manager(tmp_path, keep_top_k=None)  # the rerun
    with caplog.at_level(logging.WARNING, logger="nemo_grpo.utils.checkpoint"):
        assert m2.get_latest_checkpoint_path() == str(tmp_path / "ckpt" / "step_2")
        assert m2.get_latest_checkpoint_path() == str(tmp_path / "ckpt" / "step_2")  # build, then resume
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"checkpoint {tmp_path}/ckpt/step_4 ({what}") and \
        warnings[0].endswith(" is damaged: resuming from step_2")


def test_every_checkpoint_damaged_is_a_user_error_naming_dir_and_remedy(tmp_path):
    m = _manager(tmp_path, keep_top_k=None)
    for step in (1, 2):
        _save(m, step)
    _truncate(str(tmp_path / "ckpt" / "step_2" / "policy" / "shard_0.pt"), 0)
    _truncate(str(tmp_path / "ckpt" / "step_1" / "training_info.json"), 5)
    with pytest.raises(UserInputError) as e:
        _manager(tmp_path).get_latest_checkpoint_path()
    message = str(e.value)
    assert f"no checkpoint in {tmp_path}/ckpt can be resumed" in message and "checkpointing.resume=false" in message
    assert "step_2 (policy/shard_0.pt: 0 bytes, the manifest says 7)" in message
    assert "step_1 (training_info.json is not valid JSON" in message and "\n" not in message


def test_a_checkpoint_older_than_manifests_is_resumed_unchecked_if_its_info_parses(tmp_path, caplog):
    m = _manager(tmp_path, keep_top_k=None)
    for step in (1, 2):
        _save(m, step)
    for step in (1, 2):  # what an older version wrote: no manifest, no checkpoint_format
        path = tmp_path / "ckpt" / f"step_{step}"
        os.remove(path / "manifest.json")
        (path / "training_info.json").write_text(json.dumps({"step": step, "metrics": {}}))
    with caplog.at_level(logging.WARNING, logger="nemo_grpo.utils.checkpoint"):
        assert m.get_latest_checkpoint_path() == str(tmp_path / "ckpt" / "step_2")
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {tmp_path}/ckpt/step_2 has no manifest.json (written by an older version): resuming from it "
        "without checking its files"]
    (tmp_path / "ckpt" / "step_2" / "training_info.json").write_text('{"step": 2, "metr')
    assert m.get_latest_checkpoint_path() == str(tmp_path / "ckpt" / "step_1")


def test_a_file_the_manifest_does_not_list_is_ignored(tmp_path):
    m = _manager(tmp_path)
    path = _save(m, 3)
    (tmp_path / "ckpt" / "step_3" / "NOTES.txt").write_text("copied by hand")
    assert m.get_latest_checkpoint_path() == path


def test_retention_ranks_a_damaged_checkpoint_last_and_does_not_trip(tmp_path):
    m = _manager(tmp_path, keep_top_k=2, metric_name="val:accuracy")
    _save(m, 1, {"val:accuracy": 0.5})
    _save(m, 2, {"val:accuracy": 0.9})
    _truncate(str(tmp_path / "ckpt" / "step_2" / "training_info.json"), 7)  # the best one, now unreadable
    _save(m, 3, {"val:accuracy": 0.1})
    assert _steps(m) == [1, 3]  # step_2 went first; 1 is the best intact one, 3 the newest
    _save(m, 4, {"val:accuracy": 0.2})
    os.remove(tmp_path / "ckpt" / "step_4" / "policy" / "shard_0.pt")  # the newest, damaged
    _save(m, 5, {"val:accuracy": 0.3})
    assert _steps(m) == [1, 5]
