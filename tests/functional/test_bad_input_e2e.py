"""Bad input seen as a user sees it: `python -m nemo_grpo.train` in a process of its own exits with status 2,
prints nothing on stdout and one `error: ...` line on stderr (no traceback at import or at exit). One case, a
damaged checkpoint, as a user meets it; tests/unit/test_bad_input.py runs every case (this one included) through
the same entry point in-process, where each costs no interpreter start."""

import os
import subprocess
import sys

from nemo_grpo.config import CheckpointingConfig
from nemo_grpo.utils.checkpoint import CheckpointManager
from nemo_grpo.utils.cli import EXIT_USER_ERROR

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def error_line_of_train(tmp_path, *overrides) -> str:
    """Run `python -m nemo_grpo.train` (logs and checkpoints under tmp_path unless the overrides say otherwise);
    assert status 2, an empty stdout and one error line on stderr; return that line."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", NEMO_GRPO_CACHE=str(tmp_path / "cache"))
    env.pop("RAY_ADDRESS", None)
    args = [f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt", *overrides]
    proc = subprocess.run([sys.executable, "-m", "nemo_grpo.train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == EXIT_USER_ERROR, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert proc.stdout == ""
    return lines[0]


def test_a_checkpoint_dir_whose_only_checkpoint_is_truncated(tmp_path):
    manager = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt")))
    tmp = manager.init_tmp_checkpoint(4, {"step": 4, "metrics": {}})
    os.makedirs(os.path.join(tmp, "policy"))
    with open(os.path.join(tmp, "policy", "__0_0.distcp"), "wb") as f:
        f.write(b"\0" * 52311)
    final = manager.finalize_checkpoint(tmp)
    with open(os.path.join(final, "policy", "__0_0.distcp"), "r+b") as f:
        f.truncate(1024)
    line = error_line_of_train(tmp_path)
    assert f"{tmp_path}/ckpt/step_4 (policy/__0_0.distcp: 1024 bytes, the manifest says 52311)" in line
    assert "checkpointing.resume=false" in line
