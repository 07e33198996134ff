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


def _decoded_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of a UTF-8 file (a leading byte-order mark is dropped); a line that is
    not UTF-8 is an error naming the file, the line and the byte."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                f"{e.start + 1}); save the file as UTF-8") from None
            yield lineno, text


def jsonl_rows(path: str, key: str = "data_path") -> Iterator[tuple[str, dict]]:
    """("path:line", object) for each non-empty line of a JSONL file; errors naming the config `key` for a
    missing file, and the file and line for text that is not UTF-8, bad JSON, a line that is not an object,
    or no rows at all."""
    if os.path.isdir(path):
        raise DataError(f"config key '{key}': {path} is a directory, not a JSONL file")
    if not os.path.isfile(path):
        raise DataError(f"config key '{key}': file not found: {path}")
    count = 0
    try:
        for lineno, line in _decoded_lines(path):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            count += 1
            yield f"{path}:{lineno}", row
    except OSError as e:
        raise DataError(f"config key '{key}': cannot read {path} ({e.strerror or e})") from None
    if not count:
        raise DataError(f"{path}: no rows (config key '{key}' names an empty file)")


def _check_types(row: dict, where: str, input_key: str, output_key: str, section: str) -> None:
    """The problem is a string; the answer a string or a number (math answers are numbers, `"output": 2`).
    Anything else (null, a boolean, a list, an object) would train on its Python text ("None")."""
    prompt, answer = row[input_key], row[output_key]
    if not isinstance(prompt, str):
        raise DataError(f"{where}: key '{input_key}' ({section}.input_key) must be a string, got "
                        f"{json.dumps(prompt)[:40]}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(f"{where}: key '{output_key}' ({section}.output_key) must be a string or a number, got "
                        f"{json.dumps(answer)[:40]}")


def read_jsonl(path: str, input_key: str, output_key: str, section: str = "data.*") -> list[dict[str, str]]:
    """One JSON object per line; `input_key` holds the problem (a string) and `output_key` the reference answer
    (a string or a number). `section` ("data.train") names the config keys in errors."""
    items = []
    for where, row in jsonl_rows(path, f"{section}.data_path"):
        for key, what in ((input_key, "input_key"), (output_key, "output_key")):
            if key not in row:
                raise DataError(f"{where}: missing key '{key}' ({section}.{what}); keys present: {sorted(row)}")
        _check_types(row, where, input_key, output_key, section)
        extra = row.get("extra_env_info", {})
        if not isinstance(extra, dict):
            raise DataError(f"{where}: 'extra_env_info' must be an object (e.g. {{\"tests\": [...]}})")
        items.append({"problem": str(row[input_key]), "answer": str(row[output_key]), "extra_env_info": extra})
    return items


def read_hf_dataset(name: str, subset: str | None, split: str, input_key: str, output_key: str,
                    section: str = "data.*"):
    """Rows of a Hugging Face dataset (the `datasets` package); a dataset that cannot be loaded (unknown name,
    subset or split, no network with HF_HUB_OFFLINE) is an error naming `section`.data_path."""
    key = f"{section}.data_path"
    try:
        import datasets  # optional: nemo-grpo[datasets]; the error below names it where it is not installed
    except ImportError:
        raise DataError(f"config key '{key}': '{name}' is not a local file, so it names a Hugging Face dataset, "
                        "which needs the datasets package: pip install 'nemo-grpo[datasets]'") from None
    try:
        rows = datasets.load_dataset(name, subset, split=split)
    except Exception as e:  # the package's errors for a name, subset or split it cannot serve
        first = (str(e).strip().splitlines() or [""])[0]
        raise DataError(f"config key '{key}': cannot load Hugging Face dataset '{name}' (subset {subset}, "
                        f"split {split}): {type(e).__name__}: {first}") from None
    missing = [k for k in (input_key, output_key) if k not in rows.column_names]
    if missing:
        raise DataError(f"config key '{key}': dataset '{name}' has no column(s) {missing} "
                        f"({section}.input_key / output_key); columns: {rows.column_names}")
    return [{"problem": str(r[input_key]), "answer": str(r[output_key])} for r in rows]


def _is_file_path(path: str) -> bool:
    """A data_path meant as a local file: it exists, ends in .jsonl / .json, or is written as a path
    (absolute, ./, ../, ~) rather than a Hugging Face name such as "openai/gsm8k"."""
    return (os.path.exists(path) or path.endswith((".jsonl", ".json")) or os.path.isabs(path)
            or path.startswith(("./", "../", "~")))


def load_problems(cfg: DatasetConfig, section: str = "data.*") -> list[dict[str, str]]:
    """Raw problems for one dataset config: built-in name, a .jsonl path, or a HF dataset name. `section`
    ("data.train", "data.validation") names the config keys in errors."""
    if cfg.dataset_name in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[cfg.dataset_name]()
    if cfg.dataset_name != "ResponseDataset":
        raise DataError(f"config key '{section}.dataset_name': '{cfg.dataset_name}' is unknown; known: "
                        f"{', '.join(sorted(BUILTIN_DATASETS))}, ResponseDataset (with data_path)")
    if not cfg.data_path:
        raise DataError(f"config key '{section}.data_path': is required with dataset_name ResponseDataset "
                        "(a JSONL file or a Hugging Face dataset name)")
    path = os.path.expanduser(cfg.data_path)
    if _is_file_path(cfg.data_path):
        return read_jsonl(path, cfg.input_key, cfg.output_key, section)
    return read_hf_dataset(cfg.data_path, cfg.subset, cfg.split, cfg.input_key, cfg.output_key, section)
