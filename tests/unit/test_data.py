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
