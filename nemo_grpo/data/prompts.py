"""Prompts: chat templating, tokenization, length filtering, and a resumable prompt loader."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from nemo_grpo.config import DatasetConfig
from nemo_grpo.data.datasets import DataError

log = logging.getLogger(__name__)


@dataclass
class Datum:
    """One prompt (NeMo RL's DatumSpec): its conversation so far, token ids, env info and task."""

    message_log: list[dict[str, str]]
    prompt_ids: list[int]
    extra_env_info: dict[str, Any]
    task_name: str
    idx: int
    loss_multiplier: float = 1.0
    stop_strings: Optional[list[str]] = field(default=None)


def _read(path: Optional[str], key: str) -> Optional[str]:
    """The text of a prompt file (None for no file); errors name the config `key` and the file."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (config key '{key}'); save the file as UTF-8") from None
    except OSError as e:
        raise DataError(f"config key '{key}': cannot read {path} ({e.strerror or e})") from None


def _fill(template: str, problem: str, path: str, key: str) -> str:
    """The prompt file's text with the problem in place of its `{}`."""
    try:
        return template.format(problem)
    except (IndexError, KeyError, ValueError) as e:
        raise DataError(f"config key '{key}': {path} is a Python format string with one '{{}}' for the problem; "
                        f"write other braces as '{{{{' and '}}}}' ({type(e).__name__}: {e})") from None


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template, with the generation prompt appended."""
    if not getattr(tokenizer, "chat_template", None):
        text = "".join(m["content"] for m in messages)
    else:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def read_prompt_files(cfg: DatasetConfig, section: str = "data.*") -> tuple[Optional[str], Optional[str]]:
    """(prompt template, system prompt) of a dataset config, None where no file is set. The template must be a
    format string with one `{}`: one sample problem is filled in, so a stray brace fails here, naming the key."""
    key = f"{section}.prompt_file"
    template = _read(cfg.prompt_file, key)
    system = _read(cfg.system_prompt_file, f"{section}.system_prompt_file")
    if template is not None:
        if "{}" not in template:
            raise DataError(f"config key '{key}': {cfg.prompt_file} must contain '{{}}' where the problem goes")
        _fill(template, "", cfg.prompt_file, key)
    return template, system


def build_prompts(problems: list[dict[str, str]], tokenizer, cfg: DatasetConfig,
                  max_input_seq_length: int, section: str = "data.*") -> tuple[list[Datum], int]:
    """Raw problems -> tokenized Datums; prompts longer than max_input_seq_length are dropped.

    Returns (datums, number dropped). The problem text goes through `prompt_file` (a format string with
    one `{}`) when given; `system_prompt_file` adds a system message. `section` ("data.train") names the
    config keys in errors.
    """
    template, system = read_prompt_files(cfg, section)
    datums, dropped = [], 0
    for idx, item in enumerate(problems):
        content = (_fill(template, item["problem"], cfg.prompt_file, f"{section}.prompt_file")
                   if template is not None else item["problem"])
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
        ids = render_prompt(tokenizer, messages)
        if len(ids) > max_input_seq_length:
            dropped += 1
            continue
        datums.append(Datum(message_log=messages, prompt_ids=ids, task_name=cfg.env_name, idx=idx,
                            extra_env_info={"ground_truth": item["answer"],
                                            **item.get("extra_env_info", {})}))
    if dropped:
        log.warning("dropped %d of %d prompts longer than data.max_input_seq_length=%d tokens",
                    dropped, len(problems), max_input_seq_length)
    if not datums:
        raise DataError(f"config key 'data.max_input_seq_length': no prompt of {section} fits "
                        f"data.max_input_seq_length={max_input_seq_length} ({len(problems)} problems, all longer)")
    return datums, dropped


class PromptLoader:
    """Endless batches of prompts, reshuffled each epoch from (seed, epoch); its state is two integers.

    state_dict() / load_state_dict() make a resumed run see exactly the batches it would have seen.
    """

    def __init__(self, datums: list[Datum], batch_size: int, shuffle: bool = True, seed: int = 0):
        if batch_size > len(datums):
            log.warning("batch of %d prompts is larger than the dataset (%d): prompts repeat within a batch",
                        batch_size, len(datums))
        self.datums, self.batch_size, self.shuffle, self.seed = datums, batch_size, shuffle, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.datums)))
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.datums), generator=g).tolist()

    def next_batch(self, size: Optional[int] = None) -> list[Datum]:
        batch = []
        for _ in range(size or self.batch_size):
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            batch.append(self.datums[self._order[self.position]])
            self.position += 1
        return batch

    @property
    def epochs_done(self) -> int:
        """Complete passes over the prompts so far (a pass ends with the last prompt of its order)."""
        return self.epochs_done_at(self.state_dict())

    def epochs_done_at(self, state: dict[str, int]) -> int:
        """Complete passes over the prompts at `state` (a state_dict; every pass has the same length)."""
        return int(state["epoch"]) + int(int(state["position"]) >= len(self.datums))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
