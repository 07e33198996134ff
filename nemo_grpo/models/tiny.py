"""Tiny models and a character tokenizer built locally (no hub), saved as real Hugging Face directories.

Tests and the default recipe load them back through the same `from_pretrained` code a user's model takes.
head_dim is 32 so the vLLM CPU attention kernels accept them.
"""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz +-*/=?:.,()\\{}$")
SPECIAL = ["<pad>", "<eos>", "<unk>"]
PAD_ID, EOS_ID = 0, 1
# the chat template of the tiny tokenizer: contents concatenated, so "3+5=" is the whole prompt
PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
ARCHES = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig}
# qwen3_moe: every layer sparse, 8 experts of width 64, top-2 with the top-k weights renormalised (as
# Qwen3-30B-A3B: norm_topk_prob true, no shared expert)
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
                mlp_only_layers=[], norm_topk_prob=True, router_aux_loss_coef=0.001)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character of CHARS, plus <pad>, <eos>, <unk>."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    hf.chat_template = PLAIN_CHAT_TEMPLATE
    return hf


def tiny_config(arch: str = "qwen2", vocab_size: int = len(SPECIAL) + len(CHARS), **overrides):
    """A small config of a real architecture: hidden 128, 2 layers, 4 heads of dim 32 (qwen3_moe: TINY_MOE)."""
    if arch not in ARCHES:
        raise ValueError(f"unknown tiny architecture '{arch}'; known: {', '.join(ARCHES)}")
    kw = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=128,
              pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=EOS_ID, tie_word_embeddings=True,
              rms_norm_eps=1e-6)
    if arch == "llama":
        kw["attention_bias"] = False
    if arch == "qwen3_moe":
        kw.update(TINY_MOE)
    kw.update(overrides)
    return ARCHES[arch](**kw)


def save_tiny_model(path: str, arch: str = "qwen2", seed: int = 0, scalar_head: bool = False,
                    vocab_size: int | None = None, **overrides) -> str:
    """Build a randomly initialised tiny model + tokenizer and save both to `path`; returns `path`.
    vocab_size: None = the tokenizer's; larger (e.g. a benchmark's 128256) leaves ids the tokenizer never makes."""
    tokenizer = make_tokenizer()
    cfg = tiny_config(arch, vocab_size=vocab_size or len(tokenizer), **overrides)
    torch.manual_seed(seed)
    if scalar_head:
        cfg.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(cfg)
    else:
        model = AutoModelForCausalLM.from_config(cfg)
    os.makedirs(path, exist_ok=True)
    model.float().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_config(path: str):
    return AutoConfig.from_pretrained(path)
