"""Datasets, prompt templating and length filtering, and the resumable prompt loader."""

import json

import pytest

from nemo_grpo.config import DatasetConfig
from nemo_grpo.data.datasets import DataError, addition_problems, load_problems
from nemo_grpo.data.prompts import PromptLoader, build_prompts
from nemo_grpo.models.tiny import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def test_builtin_addition_is_complete():
    items = addition_problems()
    assert len(items) == 100 and {"problem": "7+8=", "answer": "15"} in items


def test_jsonl_with_custom_keys(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"question": f"{i}+1=", "solution": str(i + 1)} for i in range(5)]
    rows[3]["extra_env_info"] = {"tests": [{"input": "", "output": "4"}]}
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    cfg = DatasetConfig(dataset_name="ResponseDataset", data_path=str(path), input_key="question", output_key="solution")
    problems = load_problems(cfg)
    assert problems[2] == {"problem": "2+1=", "answer": "3", "extra_env_info": {}}
    assert problems[3]["extra_env_info"] == {"tests": [{"input": "", "output": "4"}]}  # carried to the env


def test_jsonl_errors_name_file_line_and_key(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input": "1+1=", "output": "2"}\n{"input": "2+2="}\n')
    cfg = DatasetConfig(dataset_name="ResponseDataset", data_path=str(path))
    with pytest.raises(DataError, match=r"bad.jsonl:2: missing key 'output'"):
        load_problems(cfg)
    path.write_text("{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: not valid JSON"):
        load_problems(cfg)
    with pytest.raises(DataError, match="not found"):
        load_problems(DatasetConfig(dataset_name="ResponseDataset", data_path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(DataError, match="unknown"):
        load_problems(DatasetConfig(dataset_name="gsm9k"))


def test_chat_template_prompt_file_and_length_filter(tmp_path, tokenizer):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("q:{}")
    problems = [{"problem": "1+2=", "answer": "3"}, {"problem": "123456789+1=", "answer": "x"}]
    cfg = DatasetConfig(prompt_file=str(prompt_file))
    datums, dropped = build_prompts(problems, tokenizer, cfg, max_input_seq_length=8)
    assert dropped == 1 and len(datums) == 1
    assert tokenizer.decode(datums[0].prompt_ids) == "q:1+2="
    assert datums[0].extra_env_info == {"ground_truth": "3"} and datums[0].task_name == "math"
    with pytest.raises(DataError, match="max_input_seq_length=2"):
        build_prompts(problems, tokenizer, cfg, max_input_seq_length=2)


def test_loader_resumes_exactly(tokenizer):
    datums, _ = build_prompts(addition_problems(), tokenizer, DatasetConfig(), 8)
    a = PromptLoader(datums, 16, shuffle=True, seed=3)
    for _ in range(9):  # crosses an epoch boundary (100 prompts)
        a.next_batch()
    b = PromptLoader(datums, 16, shuffle=True, seed=3)
    b.load_state_dict(a.state_dict())
    assert [d.idx for d in a.next_batch()] == [d.idx for d in b.next_batch()]
    epoch0 = PromptLoader(datums, 100, shuffle=True, seed=3).next_batch()
    assert sorted(d.idx for d in epoch0) == list(range(100))  # an epoch is a permutation


def test_jsonl_encoding_and_path_errors_name_file_line_and_key(tmp_path):
    def problems(path, **kw):
        return load_problems(DatasetConfig(dataset_name="ResponseDataset", data_path=str(path), **kw), "data.train")

    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"input": "1+1=", "output": "2"}\n{"input": "caf\xe9=", "output": "x"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 at column 15\)"):
        problems(path)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"input": "1+1=", "output": "2"}\n')  # UTF-8 with a byte-order mark
    assert problems(bom) == [{"problem": "1+1=", "answer": "2", "extra_env_info": {}}]
    with pytest.raises(DataError, match=r"config key 'data.train.data_path': .* is a directory"):
        problems(tmp_path)
    with pytest.raises(DataError, match=r"config key 'data.train.data_path': file not found: .*nope.txt"):
        problems(tmp_path / "nope.txt")  # an absolute path is a file, not a Hugging Face dataset name
    with pytest.raises(DataError, match=r"config key 'data.validation.data_path': is required"):
        load_problems(DatasetConfig(dataset_name="ResponseDataset"), "data.validation")


def test_prompt_file_errors_name_the_key(tmp_path, tokenizer):
    latin1 = tmp_path / "p.txt"
    latin1.write_bytes(b"line one\nQ: {} \xe9")
    with pytest.raises(DataError, match=r"p.txt:2: not UTF-8 text \(config key 'data.train.prompt_file'\)"):
        build_prompts(addition_problems(), tokenizer, DatasetConfig(prompt_file=str(latin1)), 8, "data.train")
    braces = tmp_path / "b.txt"
    braces.write_text('{"answer": ...} {}')
    with pytest.raises(DataError, match=r"config key 'data.train.prompt_file': .*b.txt is a Python format string"):
        build_prompts(addition_problems(), tokenizer, DatasetConfig(prompt_file=str(braces)), 8, "data.train")


def test_loader_counts_complete_epochs(tokenizer):
    datums, _ = build_prompts(addition_problems()[:10], tokenizer, DatasetConfig(), 8)
    loader = PromptLoader(datums, 4, shuffle=True, seed=0)
    done = []
    for _ in range(6):
        loader.next_batch()
        done.append(loader.epochs_done)
    assert done == [0, 0, 1, 1, 2, 2]  # 4, 8, 12 (an epoch of 10 ends inside batch 3), 16, 20 (exactly 2), 24
    resumed = PromptLoader(datums, 4, shuffle=True, seed=0)
    resumed.load_state_dict(loader.state_dict())
    assert resumed.epochs_done == 2


@pytest.mark.parametrize("value, shown", [("null", "null"), ("7", "7"), ('["1+1="]', '["1+1="]'),
                                          ('{"q": "1+1="}', '{"q": "1+1="}'), ("true", "true")])
def test_a_prompt_that_is_not_a_string_names_file_line_and_key(tmp_path, value, shown):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"input": "1+1=", "output": "2"}\n{"input": ' + value + ', "output": "4"}\n')
    cfg = DatasetConfig(dataset_name="ResponseDataset", data_path=str(path))
    with pytest.raises(DataError) as e:
        load_problems(cfg, "data.train")
    assert str(e.value) == f"{path}:2: key 'input' (data.train.input_key) must be a string, got {shown}"


def test_numeric_answers_are_accepted_a_null_answer_is_not(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"input": "1+1=", "output": 2}\n{"input": "1/2=", "output": 0.5}\n')
    cfg = DatasetConfig(dataset_name="ResponseDataset", data_path=str(path))
    assert [p["answer"] for p in load_problems(cfg)] == ["2", "0.5"]
    path.write_text('{"input": "1+1=", "output": 2}\n\n{"input": "2+2=", "output": null}\n')
    with pytest.raises(DataError, match=r"rows.jsonl:3: key 'output' \(data.train.output_key\) must be a string or "
                                        r"a number, got null"):
        load_problems(cfg, "data.train")
