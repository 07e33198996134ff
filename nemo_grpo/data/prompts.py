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


def _read(path: Optional[str]) -> Optional[str]:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template, with the generation prompt appended."""
    if not getattr(tokenizer, "chat_template", None):
        text = "".join(m["content"] for m in messages)
    else:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def build_prompts(problems: list[dict[str, str]], tokenizer, cfg: DatasetConfig,
                  max_input_seq_length: int) -> tuple[list[Datum], int]:
    """Raw problems -> tokenized Datums; prompts longer than max_input_seq_length are dropped.

    Returns (datums, number dropped). The problem text goes through `prompt_file` (a format string with
    one `{}`) when given; `system_prompt_file` adds a system message.
    """
    template, system = _read(cfg.prompt_file), _read(cfg.system_prompt_file)
    if template is not None and "{}" not in template:
        raise DataError(f"data prompt_file {cfg.prompt_file} must contain '{{}}' where the problem goes")
    datums, dropped = [], 0
    for idx, item in enumerate(problems):
        content = template.format(item["problem"]) if template is not None else item["problem"]
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
        raise DataError(f"no prompt fits data.max_input_seq_length={max_input_seq_length} "
                        f"({len(problems)} problems, all longer)")
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

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
