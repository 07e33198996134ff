"""Bad input is one line on stderr, `error: ...`, naming the key, the file (and line) or the value, with exit
status 2 and no traceback: whether it is caught while loading the config or while building the run. Each case
calls the entry point in this process as `python -m nemo_grpo.train` would (`main(argv)`, its console set up
by configure_console; the `user_console` fixture puts the logging and warnings state back afterwards). All of
them fail before Ray or any model starts: the one line is also the proof that nothing else ran, and each
case checks that Ray is not running. tests/functional/test_bad_input_e2e.py runs a few as real processes."""

import logging
import os
import shutil

import pytest

from nemo_grpo.errors import ConfigError, DataError
from nemo_grpo.utils.cli import EXIT_USER_ERROR, configure_console, error_line, log_to_file, run_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JSONL = "data.train.dataset_name=ResponseDataset"


@pytest.fixture
def train(tmp_path, capsys, monkeypatch, user_console):
    """train(*overrides, config=None) -> the one error line of `python -m nemo_grpo.train ...`, run in this
    process with logs and checkpoints under tmp_path unless the overrides say otherwise."""
    from nemo_grpo.train import main

    monkeypatch.setenv("NEMO_GRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a regression must not join someone's cluster
    monkeypatch.chdir(ROOT)

    def run(*overrides, config=None) -> str:
        args = [f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt", *overrides]
        capsys.readouterr()  # what the test's own set-up printed (building a tiny model) is not the run's
        return one_error_line(main([*(["--config", config] if config else []), *args]), capsys)

    return run


def one_error_line(status: int, capsys) -> str:
    """The run failed with status 2, printed nothing on stdout and exactly one line on stderr (its message).
    It started no Ray cluster: tests/unit/conftest.py refuses init_ray, so a run that got that far fails here."""
    out, err = capsys.readouterr()
    assert status == EXIT_USER_ERROR, (status, err[-3000:])
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert out == ""
    return lines[0]


def write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


# ----------------------------------------------------------------------------------------------- data path
@pytest.mark.parametrize("case", ["no data_path", "missing file", "a directory"])
def test_data_path(train, tmp_path, case):
    overrides = {"no data_path": [JSONL],
                 "missing file": [JSONL, f"data.train.data_path={tmp_path}/nope.jsonl"],
                 "a directory": [JSONL, f"data.train.data_path={tmp_path}"]}[case]
    line = train(*overrides)
    assert "data.train.data_path" in line
    if case != "no data_path":
        assert str(tmp_path) in line


def test_validation_data_path_is_named_as_the_validation_key(train, tmp_path):
    line = train("data.validation.dataset_name=ResponseDataset", f"data.validation.data_path={tmp_path}/val.jsonl")
    assert "data.validation.data_path" in line and "val.jsonl" in line


def test_unknown_builtin_model_lists_the_known_ones(train):
    line = train("policy.model_name=builtin:nope")
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
    ("null_input", GOOD + b'{"input": null, "output": "4"}\n',
     ":2: key 'input' (data.train.input_key) must be a string, got null"),
])
def test_data_content_names_file_and_line(train, tmp_path, name, data, expected):
    path = write(tmp_path / f"{name}.jsonl", data)
    line = train(JSONL, f"data.train.data_path={path}")
    assert f"{path}{expected}" in line


def test_prompt_file_that_is_not_utf8_or_has_stray_braces(train, tmp_path):
    latin1 = write(tmp_path / "prompt_latin1.txt", b"Question:\n{} caf\xe9")
    line = train(f"data.train.prompt_file={latin1}")
    assert f"{latin1}:2: not UTF-8 text" in line and "data.train.prompt_file" in line
    braces = write(tmp_path / "prompt_braces.txt", b'Answer as {"answer": ...}: {}')
    line = train(f"data.train.prompt_file={braces}")
    assert "data.train.prompt_file" in line and "'{{'" in line


# ----------------------------------------------------------------------------------------------- output dirs
@pytest.mark.parametrize("key", ["logger.log_dir", "checkpointing.checkpoint_dir"])
@pytest.mark.parametrize("case", ["under a file", "is a file"])
def test_unusable_output_directory_names_key_and_path(train, tmp_path, key, case):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    target = blocker / "out" if case == "under a file" else blocker
    line = train(f"{key}={target}")
    assert f"'{key}'" in line and str(target) in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
@pytest.mark.parametrize("key", ["logger.log_dir", "checkpointing.checkpoint_dir"])
def test_read_only_output_directory(train, tmp_path, key):
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    line = train(f"{key}={read_only}")
    assert f"'{key}'" in line and str(read_only) in line and "not a writable directory" in line


# ----------------------------------------------------------------------------------------------- model, checkpoint
@pytest.fixture
def damaged_model(tiny_model_dir, tmp_path):
    """damaged_model(how, scalar_head=False) -> a copy of a tiny model without its config.json ("no config") or
    with its model.safetensors cut short ("truncated")."""

    def make(how: str, scalar_head: bool = False) -> str:
        path = shutil.copytree(tiny_model_dir("qwen2", scalar_head=scalar_head), tmp_path / f"model_{how}")
        if how == "no config":
            os.remove(path / "config.json")
        else:
            with open(path / "model.safetensors", "r+b") as f:
                f.truncate(1000)
        return str(path)

    return make


@pytest.mark.parametrize("how, expected", [("no config", " has no config.json"),
                                           ("truncated", ": model.safetensors: 1000 bytes, its header alone claims")])
def test_a_model_directory_that_is_not_a_model(train, damaged_model, how, expected):
    path = damaged_model(how)
    line = train(f"policy.model_name={path}")
    assert line.startswith(f"error: config key 'policy.model_name': model directory {path}{expected}")


def test_the_reward_model_entry_points_name_their_model_key(damaged_model, capsys, user_console):
    from nemo_grpo.eval_rm import main as eval_rm
    from nemo_grpo.train_rm import main as train_rm

    path = damaged_model("truncated", scalar_head=True)
    capsys.readouterr()
    line = one_error_line(train_rm([f"policy.model_name={path}", "data.train_data_path=builtin:addition"]), capsys)
    assert f"config key 'policy.model_name': model directory {path}: model.safetensors" in line
    line = one_error_line(eval_rm([f"reward_model.model_name={path}", "data_path=builtin:addition"]), capsys)
    assert f"config key 'reward_model.model_name': model directory {path}: model.safetensors" in line


def test_a_checkpoint_dir_whose_every_checkpoint_is_damaged(train, tmp_path):
    from nemo_grpo.config import CheckpointingConfig
    from nemo_grpo.utils.checkpoint import CheckpointManager

    manager = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt")))
    tmp = manager.init_tmp_checkpoint(2, {"step": 2, "metrics": {}})
    os.makedirs(os.path.join(tmp, "policy"))
    write(tmp_path / "ckpt" / "tmp_step_2" / "policy" / "__0_0.distcp", b"x" * 2048)
    final = manager.finalize_checkpoint(tmp)
    with open(os.path.join(final, "policy", "__0_0.distcp"), "r+b") as f:
        f.truncate(1024)
    line = train()
    assert line.startswith(f"error: config key 'checkpointing.checkpoint_dir': no checkpoint in {tmp_path}/ckpt "
                           f"can be resumed, each is damaged: {tmp_path}/ckpt/step_2 (policy/__0_0.distcp: 1024 "
                           "bytes, the manifest says 2048)")
    assert "checkpointing.resume=false" in line


# ----------------------------------------------------------------------------------------------- LLM judge
JUDGE = ["data.train.env_name=llm_judge"]
HTTP_JUDGE = ["env.llm_judge.base_url=http://127.0.0.1:9/v1", "env.llm_judge.model=judge"]  # port 9: nothing there


@pytest.mark.parametrize("case", ["no {response}", "unknown placeholder", "missing file", "not UTF-8", "unset",
                                  "all_pairs with G=1", "neither model_name nor base_url", "both",
                                  "score_labels and score_regex"])
def test_llm_judge_config(train, tmp_path, tiny_model_dir, case):
    template = tmp_path / "judge.txt"
    template.write_bytes({"no {response}": b"{prompt} = {reference}?", "unknown placeholder": b"{response} {answer}",
                          "not UTF-8": b"\xff{response}"}.get(case, b"score {response}: \\boxed{}"))
    path = {"missing file": f"{tmp_path}/nope.txt", "unset": None}.get(case, str(template))
    where = {"neither model_name nor base_url": [], "both": [f"env.llm_judge.model_name={tiny_model_dir()}",
                                                              *HTTP_JUDGE]}.get(case, HTTP_JUDGE)
    extra = {"all_pairs with G=1": ["env.llm_judge.mode=pairwise", "env.llm_judge.comparison_strategy=all_pairs",
                                    "grpo.num_generations_per_prompt=1", "policy.train_global_batch_size=16",
                                    "policy.train_micro_batch_size=8"],
             "score_labels and score_regex": ["env.llm_judge.score_regex=(\\d)",
                                              "env.llm_judge.score_labels.bad=0"]}.get(case, [])
    fpath = [] if path is None else [f"env.llm_judge.judge_prompt_template_fpath={path}"]
    line = train(*JUDGE, *fpath, *where, *extra)
    key = "error: config key 'env.llm_judge.judge_prompt_template_fpath': "
    assert line == {
        "no {response}": f"{key}'{template}' has no {{response}}; mode pointwise needs {{response}}",
        "unknown placeholder": f"{key}'{template}' has an unknown placeholder {{answer}}; mode pointwise takes "
                               "{response}, {prompt}, {reference} (write {{answer}} for the literal text)",
        "missing file": f"{key}cannot read '{path}': No such file or directory",
        "not UTF-8": f"{key}cannot read '{path}': 'utf-8' codec can't decode byte 0xff in position 0: invalid start "
                     "byte",
        "unset": f"{key}is required: a text file with the judge's prompt (pointwise mode)",
        "all_pairs with G=1": "error: config key 'env.llm_judge.comparison_strategy': all_pairs compares the samples "
                              "of a prompt's group, but grpo.num_generations_per_prompt is 1: set "
                              "grpo.num_generations_per_prompt >= 2, or env.llm_judge.mode=pointwise",
        "neither model_name nor base_url": "error: config key 'env.llm_judge.model_name': neither it nor "
                                           "env.llm_judge.base_url is set: set one (model_name: a local HF directory "
                                           "the judge runs from in the cluster; base_url: an OpenAI-compatible server)",
        "both": f"error: config key 'env.llm_judge.model_name': '{tiny_model_dir()}' and env.llm_judge.base_url "
                "'http://127.0.0.1:9/v1' are both set: set one (model_name: a local HF directory the judge runs from "
                "in the cluster; base_url: an OpenAI-compatible server)",
        "score_labels and score_regex": "error: config key 'env.llm_judge.score_labels': {'bad': 0.0} and "
                                        "env.llm_judge.score_regex '(\\\\d)' are both set: a reply's score is read "
                                        "by one of them, set one",
    }[case]


@pytest.mark.parametrize("asker", ["llm_judge data set", "math judge_fallback"])
def test_llm_judge_server_that_cannot_be_reached_is_named(train, tmp_path, asker):
    """Checked on the driver before the model loads and Ray starts (build_trainer), whichever environment asks the
    judge: one line naming base_url."""
    template = tmp_path / "judge.txt"
    template.write_text("is {response} {reference}?")
    fallback = ["env.math.judge_fallback=true", "env.llm_judge.mode=equivalence"]
    uses = JUDGE if asker == "llm_judge data set" else fallback
    line = train(*uses, f"env.llm_judge.judge_prompt_template_fpath={template}", *HTTP_JUDGE)
    assert line.startswith("error: config key 'env.llm_judge.base_url': cannot reach the judge at "
                           "http://127.0.0.1:9/v1: "), line


@pytest.mark.parametrize("case", ["no env.llm_judge", "pointwise judge", "agreement fraction 1.5"])
def test_math_judge_fallback_config(train, case):
    """env.math.judge_fallback needs env.llm_judge in equivalence mode; the agreement fraction is a fraction."""
    extra = {"no env.llm_judge": [], "pointwise judge": HTTP_JUDGE,
             "agreement fraction 1.5": ["env.math.judge_agreement_fraction=1.5"]}[case]
    line = train("env.math.judge_fallback=true", *extra)
    assert line == {
        "no env.llm_judge": "error: config key 'env.math.judge_fallback': is true but env.llm_judge is null: set "
                            "env.llm_judge (mode equivalence), the judge that decides the answers math-verify cannot "
                            "parse",
        "pointwise judge": "error: config key 'env.llm_judge.mode': is pointwise, but env.math.judge_fallback needs "
                           "equivalence (the judge says whether an answer equals the reference)",
        "agreement fraction 1.5": "error: config key 'env.math.judge_agreement_fraction': must be in [0, 1], got 1.5",
    }[case]


# ----------------------------------------------------------------------------------------------- the recipe
def test_recipe_that_is_not_utf8_names_file_and_line(train, tmp_path):
    recipe = write(tmp_path / "recipe.yaml", b"grpo:\n  max_num_steps: 3\n# caf\xe9\n")
    line = train(config=recipe)
    assert f"{recipe}:3" in line and "UTF-8" in line


def test_unknown_key_is_named(train):
    line = train("grpo.max_num_stepz=3")
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


def test_quiet_console_shows_our_loggers_and_errors_the_file_gets_everything(tmp_path, capsys, user_console):
    import torch  # noqa: F401  (torch's loggers print through stderr handlers of their own)

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
