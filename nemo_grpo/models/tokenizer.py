"""Loading a model directory's tokenizer so that it encodes as its tokenizer.json says.

transformers 5 lets the tokenizer class registered for a model type (Qwen2Tokenizer for a qwen2 model,
LlamaTokenizer for llama) rebuild the pipeline of a tokenizer.json it loads: its own normalizer, pre-tokenizer
and decoder replace the file's (huggingface/transformers#44462, #48206). A tokenizer that is not that model's
own then encodes wrongly and silently. The built-in character tokenizer of the tiny qwen2 models dropped every
space ("code:3 times 4=" came out as "code:3times4="), so the policy was trained on prompts it had never seen
in its warm start. `load_tokenizer` keeps AutoTokenizer's answer where it agrees with the file, and otherwise
loads the file's own pipeline (TokenizersBackend), and says so in the log.
"""

from __future__ import annotations

import json
import logging
import os

from transformers import AutoTokenizer, TokenizersBackend

log = logging.getLogger(__name__)

PIPELINE = ("normalizer", "pre_tokenizer", "decoder")  # what a model type's tokenizer class may rebuild


def load_tokenizer(path: str):
    """The tokenizer of local directory (or hub name) `path`: AutoTokenizer's, or, where that one's pipeline
    differs from the directory's tokenizer.json, the file's own."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        return tokenizer
    with open(file, encoding="utf-8") as f:
        declared = json.load(f)
    loaded = json.loads(tokenizer.backend_tokenizer.to_str()) if hasattr(tokenizer, "backend_tokenizer") else {}
    changed = [k for k in PIPELINE if declared.get(k) != loaded.get(k)]
    if not changed:
        return tokenizer
    log.info("%s: %s rebuilt the %s of tokenizer.json; using the file's own tokenizer (TokenizersBackend)",
             path, type(tokenizer).__name__, ", ".join(changed))
    return TokenizersBackend.from_pretrained(path)
