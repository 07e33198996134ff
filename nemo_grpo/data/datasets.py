"""Datasets: a built-in one for the default recipe, JSONL files, and Hugging Face datasets.

Every loader returns a list of raw problems `{"problem": str, "answer": str}`; `prompts.py` turns them
into tokenized prompts.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

from nemo_grpo.config import DatasetConfig
from nemo_grpo.errors import DataError  # noqa: F401  (re-exported)


def addition_problems() -> list[dict[str, str]]:
    """All 100 single-digit additions "a+b=" with their sums: the default recipe's task."""
    return [{"problem": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]


OPERATIONS = {"plus": "+", "minus": "-", "times": "*"}


def arithmetic_code_problems() -> list[dict]:
    """300 tiny coding tasks in the character tokenizer's alphabet: "code:3 times 4=" asks for a program that
    prints 12 (a reference solution is "print(3*4)"); the code environment runs it against that one case."""
    out = []
    for word, op in OPERATIONS.items():
        for a in range(10):
            for b in range(10):
                value = str(eval(f"{a}{op}{b}"))  # noqa: S307 (digits and an operator of ours)
                out.append({"problem": f"code:{a} {word} {b}=", "answer": value, "solution": f"print({a}{op}{b})",
                            "extra_env_info": {"tests": [{"input": "", "output": value}]}})
    return out


BUILTIN_DATASETS = {"addition": addition_problems, "arithmetic_code": arithmetic_code_problems}


def jsonl_rows(path: str) -> Iterator[tuple[str, dict]]:
    """("path:line", object) for each non-empty line of a JSONL file; clear errors for a missing file, bad
    JSON, a line that is not an object, or no rows at all."""
    if not os.path.isfile(path):
        raise DataError(f"dataset file not found: {path}")
    count = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            count += 1
            yield f"{path}:{lineno}", row
    if not count:
        raise DataError(f"{path}: no rows")


def read_jsonl(path: str, input_key: str, output_key: str) -> list[dict[str, str]]:
    """One JSON object per line; `input_key` holds the problem and `output_key` the reference answer."""
    items = []
    for where, row in jsonl_rows(path):
        for key, what in ((input_key, "input_key"), (output_key, "output_key")):
            if key not in row:
                raise DataError(f"{where}: missing key '{key}' (data.*.{what}); keys present: {sorted(row)}")
        extra = row.get("extra_env_info", {})
        if not isinstance(extra, dict):
            raise DataError(f"{where}: 'extra_env_info' must be an object (e.g. {{\"tests\": [...]}})")
        items.append({"problem": str(row[input_key]), "answer": str(row[output_key]), "extra_env_info": extra})
    return items


def read_hf_dataset(name: str, subset: str | None, split: str, input_key: str, output_key: str):
    try:
        import datasets
    except ImportError:
        raise DataError(f"data.*.data_path '{name}' names a Hugging Face dataset, which needs the datasets "
                        "package: pip install 'nemo-grpo[datasets]'") from None
    rows = datasets.load_dataset(name, subset, split=split)
    missing = [k for k in (input_key, output_key) if k not in rows.column_names]
    if missing:
        raise DataError(f"dataset '{name}' has no column(s) {missing}; columns: {rows.column_names}")
    return [{"problem": str(r[input_key]), "answer": str(r[output_key])} for r in rows]


def load_problems(cfg: DatasetConfig) -> list[dict[str, str]]:
    """Raw problems for one dataset config: built-in name, a .jsonl path, or a HF dataset name."""
    if cfg.dataset_name in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[cfg.dataset_name]()
    if cfg.dataset_name != "ResponseDataset":
        raise DataError(f"data.*.dataset_name '{cfg.dataset_name}' is unknown; known: "
                        f"{', '.join(sorted(BUILTIN_DATASETS))}, ResponseDataset (with data_path)")
    if not cfg.data_path:
        raise DataError("data.*.data_path is required with dataset_name ResponseDataset")
    if cfg.data_path.endswith((".jsonl", ".json")) or os.path.exists(cfg.data_path):
        return read_jsonl(cfg.data_path, cfg.input_key, cfg.output_key)
    return read_hf_dataset(cfg.data_path, cfg.subset, cfg.split, cfg.input_key, cfg.output_key)
