"""Bad input is one line on stderr, `error: ...`, naming the key, the file (and line) or the value, with exit
status 2 and no traceback: whether it is caught while loading the config or while building the run. Each case
runs `python -m nemo_grpo.train` as a user does; all of them fail before Ray or any model starts, so the one
line is also the proof that nothing else ran (starting Ray logs a line of its own)."""

import logging
import os
import subprocess
import sys

import pytest

from nemo_grpo.errors import ConfigError, DataError
from nemo_grpo.utils.cli import EXIT_USER_ERROR, configure_console, error_line, log_to_file, run_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JSONL = "data.train.dataset_name=ResponseDataset"


def train(tmp_path, *overrides, config=None) -> subprocess.CompletedProcess:
    """`python -m nemo_grpo.train`, logs and checkpoints under tmp_path unless the overrides say otherwise."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", NEMO_GRPO_CACHE=str(tmp_path / "cache"))
    env.pop("RAY_ADDRESS", None)
    args = [f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt", *overrides]
    return subprocess.run([sys.executable, "-m", "nemo_grpo.train", *(["--config", config] if config else []),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The run failed with status 2, printed nothing on stdout and exactly one line on stderr: its message."""
    assert proc.returncode == EXIT_USER_ERROR, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert proc.stdout == ""
    return lines[0]


def write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


# ----------------------------------------------------------------------------------------------- data path
@pytest.mark.parametrize("case", ["no data_path", "missing file", "a directory"])
def test_data_path(tmp_path, case):
    overrides = {"no data_path": [JSONL],
                 "missing file": [JSONL, f"data.train.data_path={tmp_path}/nope.jsonl"],
                 "a directory": [JSONL, f"data.train.data_path={tmp_path}"]}[case]
    line = one_error_line(train(tmp_path, *overrides))
    assert "data.train.data_path" in line
    if case != "no data_path":
        assert str(tmp_path) in line


def test_validation_data_path_is_named_as_the_validation_key(tmp_path):
    line = one_error_line(train(tmp_path, "data.validation.dataset_name=ResponseDataset",
                                f"data.validation.data_path={tmp_path}/val.jsonl"))
    assert "data.validation.data_path" in line and "val.jsonl" in line


def test_unknown_builtin_model_lists_the_known_ones(tmp_path):
    line = one_error_line(train(tmp_path, "policy.model_name=builtin:nope"))
    assert line == ("error: config key 'policy.model_name': unknown built-in model 'nope'; known: "
                    "builtin:tiny-addition, builtin:tiny-code, builtin:smollm2-135m-instruct")


# ----------------------------------------------------------------------------------------------- data content
GOOD = b'{"input": "1+1=", "output": "2"}\n'


@pytest.mark.parametrize("name, data, expected", [
    ("empty", b"", ": no rows"),
    ("bad_json", GOOD + b"\n" + b'{"input": "2+2=", output: 4}\n', ":3: not valid JSON"),  # line 2 is blank
    ("not_an_object", GOOD + b"[1, 2]\n", ":2: expected a JSON object, got list"),
    ("missing_input_key", GOOD + b'{"question": "2+2=", "output": "4"}\n',
     ":2: missing key 'input' (data.train.input_key)"),
    ("latin1", GOOD + b'{"input": "caf\xe9", "output": "x"}\n', ":2: not UTF-8 text (byte 0xe9"),
])
def test_data_content_names_file_and_line(tmp_path, name, data, expected):
    path = write(tmp_path / f"{name}.jsonl", data)
    line = one_error_line(train(tmp_path, JSONL, f"data.train.data_path={path}"))
    assert f"{path}{expected}" in line


def test_prompt_file_that_is_not_utf8_or_has_stray_braces(tmp_path):
    latin1 = write(tmp_path / "prompt_latin1.txt", b"Question:\n{} caf\xe9")
    line = one_error_line(train(tmp_path, f"data.train.prompt_file={latin1}"))
    assert f"{latin1}:2: not UTF-8 text" in line and "data.train.prompt_file" in line
    braces = write(tmp_path / "prompt_braces.txt", b'Answer as {"answer": ...}: {}')
    line = one_error_line(train(tmp_path, f"data.train.prompt_file={braces}"))
    assert "data.train.prompt_file" in line and "'{{'" in line


# ----------------------------------------------------------------------------------------------- output dirs
@pytest.mark.parametrize("key", ["logger.log_dir", "checkpointing.checkpoint_dir"])
@pytest.mark.parametrize("case", ["under a file", "is a file"])
def test_unusable_output_directory_names_key_and_path(tmp_path, key, case):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    target = blocker / "out" if case == "under a file" else blocker
    line = one_error_line(train(tmp_path, f"{key}={target}"))
    assert f"'{key}'" in line and str(target) in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
@pytest.mark.parametrize("key", ["logger.log_dir", "checkpointing.checkpoint_dir"])
def test_read_only_output_directory(tmp_path, key):
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    line = one_error_line(train(tmp_path, f"{key}={read_only}"))
    assert f"'{key}'" in line and str(read_only) in line and "not a writable directory" in line


# ----------------------------------------------------------------------------------------------- the recipe
def test_recipe_that_is_not_utf8_names_file_and_line(tmp_path):
    recipe = write(tmp_path / "recipe.yaml", b"grpo:\n  max_num_steps: 3\n# caf\xe9\n")
    line = one_error_line(train(tmp_path, config=recipe))
    assert f"{recipe}:3" in line and "UTF-8" in line


def test_unknown_key_is_named(tmp_path):
    line = one_error_line(train(tmp_path, "grpo.max_num_stepz=3"))
    assert "grpo.max_num_stepz" in line


# ----------------------------------------------------------------------------------------------- the helper
def test_run_main_turns_user_errors_into_one_line_and_status_2(capsys):
    def body(message):
        raise DataError(message)

    assert run_main(body, "x.jsonl:3: not valid JSON\n  (detail on a second line)") == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err == "error: x.jsonl:3: not valid JSON (detail on a second line)\n"
    assert run_main(lambda: None) == 0 and run_main(lambda: 3) == 3
    with pytest.raises(RuntimeError):  # a bug keeps its traceback
        run_main(lambda: (_ for _ in ()).throw(RuntimeError("bug")))


def test_error_line_uses_the_cause_of_a_wrapped_remote_error():
    class RemoteError(ConfigError):  # what Ray raises in the driver: the cause's class, a traceback as text
        def __init__(self, cause):
            super().__init__("Traceback (most recent call last):\n  File ...\n" + str(cause))
            self.cause = cause

    assert error_line(RemoteError(ConfigError("config key 'env.code.num_workers': must be > 0"))) == \
        "error: config key 'env.code.num_workers': must be > 0"


def test_quiet_console_shows_our_loggers_and_errors_the_file_gets_everything(tmp_path, capsys):
    import torch  # noqa: F401  (torch's loggers print through stderr handlers of their own)

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    loggers = {name: (list(lg.handlers), lg.propagate) for name, lg in logging.root.manager.loggerDict.items()
               if isinstance(lg, logging.Logger)}
    try:
        configure_console(verbose=False)
        path = log_to_file(str(tmp_path), verbose=False)
        logging.getLogger("nemo_grpo.test").info("our progress")
        logging.getLogger("vllm.worker").warning("a third-party warning")
        logging.getLogger("torch.distributed").warning("a torch warning")
        logging.getLogger("torch").error("a torch error")
        err = capsys.readouterr().err
        assert "our progress" in err and err.count("a torch error") == 1
        assert "a third-party warning" not in err and "a torch warning" not in err
        with open(path) as f:
            text = f.read()
        for message in ("our progress", "a third-party warning", "a torch warning", "a torch error"):
            assert message in text
    finally:
        for handler in root.handlers:
            if handler not in saved[0]:
                handler.close()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        for name, (handlers, propagate) in loggers.items():
            logging.getLogger(name).handlers[:] = handlers
            logging.getLogger(name).propagate = propagate
        logging.captureWarnings(False)
