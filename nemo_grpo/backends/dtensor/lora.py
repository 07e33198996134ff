"""peft's LoRA on the DTensor back end's Hugging Face model (policy.lora; what is shared is models/lora.py).

models/lora.py `inject_adapters` puts peft's LoRA layers into the HF model in place (a targeted `...q_proj`
becomes a LoRA layer holding `base_layer` and the adapters `lora_A.default` [r, in], `lora_B.default` [out, r])
and freezes everything else, before TP and FSDP2 wrap it (parallelize.py splits B like a column-parallel base
weight and A like a row-parallel one).

State-dict keys -> HF names: `<module>.base_layer.weight` is `<module>.weight`, exported merged (W + scale * B @ A);
the adapters' keys are peft's saved keys without the adapter name (models/lora.py `saved_key`).
"""

from __future__ import annotations

from typing import Optional

import torch

from nemo_grpo.models import lora

ADAPTER = lora.PEFT_ADAPTER  # peft's adapter name
BASE_WEIGHT = ".base_layer.weight"


def initial_adapter(key: str, shape: tuple, seed: int) -> torch.Tensor:
    """An adapter's initial value [shape] (key '<module>.lora_A.default.weight' | '...lora_B...'): A as on
    Megatron (models/lora.py initial_a, seeded by module), B zero."""
    module, which = key.split(f".{ADAPTER}.")[0].rsplit(".", 1)
    return lora.initial_a(module, shape, seed) if which == "lora_A" else torch.zeros(shape)


def hf_name(key: str) -> Optional[str]:
    """A state-dict key -> the HF state_dict name it exports as (None for adapter weights)."""
    if lora.is_adapter(key):
        return None
    return key.replace(".base_layer.", ".")


def adapter_keys(key: str) -> Optional[tuple[str, str]]:
    """The state-dict keys of (A, B) of a LoRA layer's base weight `key`; None for any other key."""
    if not key.endswith(BASE_WEIGHT):
        return None
    module = key[:-len(BASE_WEIGHT)]
    return f"{module}.lora_A.{ADAPTER}.weight", f"{module}.lora_B.{ADAPTER}.weight"
