"""LoRA, what both back ends share: the targets, the scale, the merge, the switch, the PEFT adapter directory.

A targeted linear layer y = x W^T computes y = x W^T + scale * (dropout(x) A^T) B^T with A [r, in], B [out, r],
scale = alpha / r; W is frozen, A and B train (A: peft's Kaiming-uniform init, B: zeros, so training starts
from the base model). Targets are Hugging Face leaf names (q_proj, ..., down_proj) on both back ends: the
DTensor back end puts peft's adapters on them, Megatron's TP-aware adapters sit on its fused projections with
one adapter per HF projection (q, k, v on linear_qkv; gate, up on linear_fc1), so both compute peft's model.

Adapter state (`adapter_state`) uses peft's saved keys: `base_model.model.<HF module>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r]; `save_adapter_dir` writes them with an adapter_config.json that
`peft.PeftModel.from_pretrained(base, path)` loads.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Iterator

import torch
from safetensors.torch import save_file

from nemo_grpo.config import LoraConfig
from nemo_grpo.errors import require
from nemo_grpo.weights.transfer import TensorSpec

# the linear layers of attention and MLP in the supported decoders (Llama, Qwen2, Qwen3): the default targets
LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."
PEFT_ADAPTER = "default"  # the adapter's name in a model peft injected adapters into
# the engine's layers, vLLM's fused linears by the HF projections they hold: an adapter on one projection changes
# its whole layer (a merged refit sends it again; vLLM puts its LoRA layers on it)
ENGINE_LAYERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                 "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
REFITS = ("adapters", "merged")  # policy.lora.refit


def target_modules(lora_cfg, prefix: str = "policy") -> list[str]:
    """policy.lora's target HF leaf names (default: every linear layer of attention and MLP) minus the excluded
    ones, in LINEAR_LAYERS order; a name that matches no linear layer is a ConfigError that lists them."""
    for key in ("target_modules", "exclude_modules"):
        unknown = [n for n in getattr(lora_cfg, key) if n not in LINEAR_LAYERS]
        require(not unknown, f"{prefix}.lora.{key}", f"{', '.join(map(repr, unknown))} matches no linear layer of "
                f"the model; its linear layers are: {', '.join(LINEAR_LAYERS)}")
    chosen = set(lora_cfg.target_modules or LINEAR_LAYERS) - set(lora_cfg.exclude_modules)
    require(bool(chosen), f"{prefix}.lora.exclude_modules", "excludes every target: no layer would train")
    return [n for n in LINEAR_LAYERS if n in chosen]


def validate_lora(lora_cfg, scalar_head: bool = False, prefix: str = "policy") -> None:
    """policy.lora's own values (ConfigError naming the key)."""
    if not lora_cfg.enabled:
        return
    key = f"{prefix}.lora."
    require(lora_cfg.rank > 0, key + "rank", f"must be > 0, got {lora_cfg.rank}")
    require(lora_cfg.alpha > 0, key + "alpha", f"must be > 0, got {lora_cfg.alpha}")
    require(0.0 <= lora_cfg.dropout < 1.0, key + "dropout", f"must be in [0, 1), got {lora_cfg.dropout}")
    require(not scalar_head, key + "enabled", "LoRA is for causal-LM policies; a reward model (scalar head) "
            "trains all its weights")
    require(lora_cfg.refit in REFITS, key + "refit", f"{lora_cfg.refit!r} is not one of {', '.join(REFITS)}")
    target_modules(lora_cfg, prefix)


def refits_adapters(lora_cfg) -> bool:
    """Whether refits send the adapters (policy.lora on, policy.lora.refit adapters): the generation engine then
    starts from the base weights with LoRA enabled and runs every request through the installed adapter."""
    return lora_cfg is not None and lora_cfg.enabled and lora_cfg.refit == "adapters"


def adapted_modules(names: list[str], targets: list[str]) -> list[str]:
    """The HF modules of `names` (HF tensor names) that carry an adapter: each '<module>.<leaf>.weight' whose
    leaf is a target (peft's suffix match), routed experts aside; in the order of `names`."""
    return [n.removesuffix(".weight") for n in names
            if n.endswith(".weight") and ".experts." not in n and n.rsplit(".", 2)[-2] in targets]


def adapter_specs(specs: list[TensorSpec], lora_cfg) -> list[TensorSpec]:
    """The adapters of a model whose HF tensors are `specs`, as an adapter refit plans them: per targeted linear
    weight [out, in], A [r, in] then B [out, r] under peft's saved keys, in fp32 (as both back ends keep them)."""
    shapes, r = {s.name: s.shape for s in specs}, lora_cfg.rank
    out = []
    for module in adapted_modules(list(shapes), target_modules(lora_cfg)):
        rows, cols = shapes[f"{module}.weight"]
        out += [TensorSpec(peft_key(module, "lora_A"), (r, cols), torch.float32),
                TensorSpec(peft_key(module, "lora_B"), (rows, r), torch.float32)]
    return out


def adapter_names(names: list[str], lora_cfg) -> set[str]:
    """peft's saved keys of the adapters of a model whose HF tensors are `names` (what an engine that takes
    adapter refits accepts)."""
    modules = adapted_modules(names, target_modules(lora_cfg))
    return {peft_key(m, which) for m in modules for which in ("lora_A", "lora_B")}


def check_resumable(saved_policy: dict, lora_cfg, checkpoint: str) -> None:
    """A checkpoint holds what its run trained (adapters of one rank and set of targets, or every weight):
    resuming it under another policy.lora is a ConfigError naming the key and both values. saved_policy: the
    policy section of the checkpoint's config.yaml."""
    saved, default = saved_policy.get("lora") or {}, LoraConfig()
    keys = ("enabled", "rank", "target_modules", "exclude_modules") if lora_cfg.enabled and saved.get("enabled") \
        else ("enabled",)
    for key in keys:
        was, now = saved.get(key, getattr(default, key)), getattr(lora_cfg, key)
        require(was == now, f"policy.lora.{key}", f"{now!r}, but the checkpoint {checkpoint} was trained with "
                f"{was!r}: resume with the same policy.lora, or start a run in a new checkpointing.checkpoint_dir")


def scale(lora_cfg) -> float:
    return lora_cfg.alpha / lora_cfg.rank


def merged(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, lora_scale: float) -> torch.Tensor:
    """W [out, in] + scale * B [out, r] @ A [r, in], computed in fp32, in W's dtype."""
    delta = lora_b.float() @ lora_a.float()
    return (weight.float() + lora_scale * delta).to(weight.dtype)


def trained_names(names: list[str], targets: list[str]) -> set[str]:
    """The HF tensors (weights and biases) of the engine layers that hold a target: what a refit sends again."""
    leaves = {leaf for layer in engine_layers(targets) for leaf in ENGINE_LAYERS[layer]}
    return {n for n in names if n.rsplit(".", 2)[-2] in leaves}


def engine_layers(targets: list[str]) -> list[str]:
    """The engine layers (ENGINE_LAYERS' names) that hold at least one of the HF projections `targets`."""
    return [name for name, parts in ENGINE_LAYERS.items() if set(parts) & set(targets)]


def initial_a(hf_module: str, shape: tuple, seed: int) -> torch.Tensor:
    """A [r, in] of the adapter on `hf_module` ('model.layers.3.self_attn.q_proj'), initialised like peft's
    (nn.Linear's Kaiming-uniform, a=sqrt(5)) from a generator seeded by (seed, layer, projection): the same on
    both back ends at every layout."""
    layer, leaf = int(hf_module.split(".")[2]), hf_module.rsplit(".", 1)[-1]
    a = torch.empty(shape)
    generator = torch.Generator().manual_seed(seed * 7919 + layer * 16 + LINEAR_LAYERS.index(leaf))
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return a


def peft_key(hf_module: str, which: str) -> str:
    """peft's saved key of an adapter: hf_module 'model.layers.0.self_attn.q_proj', which 'lora_A' | 'lora_B'."""
    return f"{PEFT_PREFIX}{hf_module}.{which}.weight"


def peft_config(lora_cfg, base_model_path: str = None):
    """The peft.LoraConfig of policy.lora (bias none, peft's default init)."""
    # here, not at the top: peft takes ~5 s to import, and validation imports this module to check a config
    import peft

    return peft.LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                           target_modules=target_modules(lora_cfg), bias="none", task_type="CAUSAL_LM",
                           base_model_name_or_path=base_model_path)


def inject_adapters(model: torch.nn.Module, lora_cfg) -> None:
    """peft's LoRA layers on policy.lora's targets, in place (`peft.inject_adapter_in_model`: the model keeps its
    class and HF names; a targeted `...q_proj` becomes a LoRA layer holding `base_layer` and the adapters
    `lora_A.default` [r, in], `lora_B.default` [out, r], peft's init: B zero); everything else frozen."""
    from peft import inject_adapter_in_model  # here, not at the top: ~5 s to import, and only LoRA runs need it

    inject_adapter_in_model(peft_config(lora_cfg), model, adapter_name=PEFT_ADAPTER)
    freeze_base(model)


def is_adapter(key: str) -> bool:
    """Whether a state-dict key of a model peft injected adapters into is an adapter's (A or B)."""
    return ".lora_A." in key or ".lora_B." in key


def saved_key(key: str) -> str:
    """An injected adapter's state-dict key ('<module>.lora_A.default.weight') -> peft's saved key."""
    module, which = key.split(f".{PEFT_ADAPTER}.")[0].rsplit(".", 1)
    return peft_key(module, which)


def save_adapter_dir(path: str, state: dict[str, torch.Tensor], lora_cfg, base_model_path: str) -> None:
    """A PEFT adapter directory: adapter_config.json + adapter_model.safetensors (`state`: peft keys)."""
    os.makedirs(path, exist_ok=True)
    peft_config(lora_cfg, base_model_path).save_pretrained(path)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "adapter_model.safetensors"),
              metadata={"format": "pt"})


def adapter_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that carry adapters (peft's LoRA layers, Megatron's): they have lora_A and enable_adapters."""
    return [m for m in model.modules() if hasattr(m, "lora_A") and callable(getattr(m, "enable_adapters", None))]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model: every adapter off inside the block (the reference policy of a LoRA run), on after it."""
    layers = adapter_layers(model)
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def freeze_base(model: torch.nn.Module) -> None:
    """requires_grad only on adapter weights (names with lora_A / lora_B)."""
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
