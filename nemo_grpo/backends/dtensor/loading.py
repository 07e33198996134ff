"""Build the DTensor back end's Hugging Face model sharded from the start: no rank ever holds the whole model.

    model = meta_model(path, scalar_head=False, attn=None)   # every parameter on the meta device (no memory)
    ... LoRA adapters, apply_tensor_parallel, apply_fsdp (parallelize.py), all on meta ...
    reads = materialize(model, device, path, lora_seed=0)     # this rank's shards, filled from the safetensors

`materialize` allocates only the local shards (`to_empty`), then fills each parameter's shard by reading just
its region from the checkpoint (models/reader.py `read_slice`: a DTensor's local shape and global offset give
the region). Peak: the rank's shards plus one region being read (MoE experts stored one by one: one expert's
tensor at a time). What the checkpoint does not hold is computed: rotary `inv_freq` / `original_inv_freq`
(non-persistent buffers, recomputed by a fresh rotary module with the model's config: RoPE scaling as HF's),
LoRA adapters (A seeded as models/lora.py initial_a, B zero). Tied embeddings stay one parameter (lm_head is
embed_tokens). Returns the reader's counts (elements read in all, largest single read) for tests.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

from nemo_grpo.backends.dtensor import lora as peft_lora
from nemo_grpo.backends.dtensor import parallelize as par
from nemo_grpo.models import lora
from nemo_grpo.models.reader import hf_tensor_reader


def meta_model(path: str, scalar_head: bool, attn) -> nn.Module:
    """The HF model of directory `path` on the meta device, fp32, as from_pretrained sets it up: a causal LM,
    or a sequence classifier with num_labels=1 (the `score` head [1, H]); eval mode, generation config read."""
    extra = {"num_labels": 1} if scalar_head else {}
    config = AutoConfig.from_pretrained(path, **extra)
    auto = AutoModelForSequenceClassification if scalar_head else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, dtype=torch.float32, attn_implementation=attn)
    model.config.architectures = [type(model).__name__]
    if model.can_generate() and os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, path: str, lora_seed: int = 0) -> dict:
    """Allocate `model`'s (sharded) parameters on `device` and fill them from the checkpoint in `path`; rotary
    buffers recomputed. -> the reader's counts {"numel": elements read, "largest": the largest single read}."""
    tied = _aliases(model)
    model.to_empty(device=device)
    if _aliases(model) != tied:
        raise RuntimeError(f"materializing {type(model).__name__} untied {sorted(tied - _aliases(model))}")
    get = hf_tensor_reader(path)
    for name, p in model.named_parameters():
        local, region = par.local_region(p)
        if all(s.stop > s.start for s in region):
            local.copy_(_read(get, name, region, tuple(p.shape), lora_seed))
    _recompute_rotary(model)
    return dict(get.reads)


def _read(get, name: str, region: tuple, shape: tuple, lora_seed: int) -> torch.Tensor:
    """The `region` (slices) of parameter `name` [shape]: from the checkpoint, or a LoRA adapter's initial value."""
    if lora.is_adapter(name):
        return peft_lora.initial_adapter(name, shape, lora_seed)[region]
    return get.read_slice(peft_lora.hf_name(name), region)


def _aliases(model: nn.Module) -> set[tuple[str, str]]:
    """(alias, first name) of every parameter that appears under two names (tied lm_head / embed_tokens)."""
    first, out = {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.add((name, first[id(p)]))
        first.setdefault(id(p), name)
    return out


def _recompute_rotary(model: nn.Module) -> None:
    """Every rotary embedding's buffers (inv_freq [head_dim / 2], original_inv_freq) and attention_scaling from a
    fresh module of its class built on the CPU with its config (the rope type's init function: llama3, yarn...).
    Any other buffer is an error: to_empty left it uninitialised and the checkpoint does not hold it."""
    done = set()
    for module in model.modules():
        if not isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            continue
        fresh = type(module)(module.config)
        for name, buffer in fresh.named_buffers(recurse=False):
            getattr(module, name).copy_(buffer)
            done.add(id(getattr(module, name)))
        module.attention_scaling = fresh.attention_scaling
    unset = [name for name, b in model.named_buffers() if id(b) not in done]
    if unset:
        raise RuntimeError(f"{type(model).__name__}: no initial value for the buffers {unset[:5]} (loading.py)")
