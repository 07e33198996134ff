"""Is a directory a Hugging Face model? Checked from its files before any worker loads it, cheaply.

    check_model_dir("/models/llama", "policy.model_name")   # ConfigError naming the key, the directory and the flaw

Checked: config.json is there and is a JSON object; the weights are there (model.safetensors, the shards that
model.safetensors.index.json names, or pytorch_model.bin and its index); every safetensors file is as long as
its header says. A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (tensor name ->
dtype, shape, data_offsets [begin, end] into the data that follows), then the data, so its size must be
8 + N + the largest end: reading the header (kilobytes, also for a 70B model) finds a file cut short, without
reading the weights. The header is read here rather than through `safetensors.safe_open`, whose errors
("invalid header length", "MetadataIncompleteBuffer") name neither the file nor the sizes. Not checked: the
bytes of the weights themselves, and the inside of pytorch_model.bin files.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Optional

from nemo_grpo.errors import ConfigError

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_BIN, TORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def _read_json(path: str):
    """The JSON value in `path`; ValueError with the reason if it is not JSON."""
    with open(path, "rb") as f:
        return json.loads(f.read().decode("utf-8"))


def safetensors_problem(path: str) -> tuple[set[str], Optional[str]]:
    """(tensor names, None) for a safetensors file whose size matches its header, else (set(), what is
    wrong: "1024 bytes, its header says 52311"). Reads the header only."""
    size = os.path.getsize(path)
    if size < 8:
        return set(), f"{size} bytes, too short for a safetensors header"
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > size - 8:
            return set(), f"{size} bytes, its header alone claims {length} (a truncated file)"
        try:
            header = json.loads(f.read(length).decode("utf-8"))
        except ValueError as e:
            return set(), f"its header is not valid JSON ({e})"
    if not isinstance(header, dict):
        return set(), "its header is not a JSON object"
    tensors = {name: t for name, t in header.items() if name != "__metadata__"}
    try:
        end = max((int(t["data_offsets"][1]) for t in tensors.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        return set(), "its header has a tensor without data_offsets [begin, end]"
    if size != 8 + length + end:
        return set(), f"{size} bytes, its header says {8 + length + end} (a truncated or damaged file)"
    return set(tensors), None


def _shards(path: str, index_name: str) -> dict[str, list[str]]:
    """shard file -> the tensors the index `index_name` puts in it; ValueError if the index is unusable."""
    index = _read_json(os.path.join(path, index_name))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError("it has no weight_map of tensor name -> file")
    shards: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        shards.setdefault(str(shard), []).append(tensor)
    return shards


def weights_problem(path: str) -> Optional[str]:
    """What is wrong with the weight files of the model directory `path` (None: they look whole)."""
    for index_name in (SAFETENSORS_INDEX, TORCH_BIN_INDEX):
        if os.path.isfile(os.path.join(path, index_name)):
            try:
                shards = _shards(path, index_name)
            except (OSError, ValueError) as e:
                return f"{index_name} cannot be used ({e})"
            break
    else:
        single = [n for n in (SAFETENSORS, TORCH_BIN) if os.path.isfile(os.path.join(path, n))]
        if not single:
            return f"has no weights ({SAFETENSORS}, {SAFETENSORS_INDEX} or {TORCH_BIN})"
        shards, index_name = {single[0]: []}, None
    for shard, tensors in sorted(shards.items()):
        file = os.path.join(path, shard)
        if not os.path.isfile(file):
            return f"{shard} is missing (named by {index_name})"
        if not shard.endswith(".safetensors"):
            continue
        names, problem = safetensors_problem(file)
        if problem is not None:
            return f"{shard}: {problem}"
        absent = sorted(set(tensors) - names)
        if absent:
            return f"{shard} lacks {len(absent)} tensor(s) that {index_name} puts there, e.g. '{absent[0]}'"
    return None


def model_dir_problem(path: str) -> Optional[str]:
    """What makes the directory `path` not a loadable Hugging Face model, or None."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return "has no config.json: not a Hugging Face model directory"
    try:
        if not isinstance(_read_json(config), dict):
            return "config.json is not a JSON object"
    except (OSError, ValueError) as e:
        return f"config.json is not valid JSON ({e})"
    return weights_problem(path)


def check_model_dir(path: str, key: str) -> None:
    """ConfigError naming config `key`, the directory and what is wrong, unless `path` is a model directory."""
    if not os.path.isdir(path):
        raise ConfigError(f"config key '{key}': '{path}' is not a local directory")
    problem = model_dir_problem(path)
    if problem is not None:
        sep = " " if problem.startswith("has ") else ": "
        raise ConfigError(f"config key '{key}': model directory {path}{sep}{problem}")
