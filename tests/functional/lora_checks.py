"""LoRA checks shared by both back ends' tests: every policy is compared with peft on the single-process HF model.

The reference is built from the policy's own initial adapters (A random, B zero), so both start alike; one train
call of two optimizer steps moves B in the first step and A in the second.
"""

import peft
import torch
from policy_checks import (TokenPGLoss, assert_step_metrics, export_state, hf_logprobs, load_hf, policy_config,
                           train_reference_model)

from nemo_grpo.config import PolicyConfig
from nemo_grpo.models import lora
from nemo_grpo.policy import Policy

LORA = {"lora.enabled": True, "lora.rank": 4, "lora.alpha": 8.0}


def lora_policy_config(path: str, backend: str = "dtensor", **overrides) -> PolicyConfig:
    """policy_config with LoRA of rank 4 (scale 2) on every linear layer. A's first gradients come in the second
    step (B starts at 0) and are tiny where B is: Adam's first step of an element is lr * sign(g) whatever |g|,
    so rounding would flip whole steps; eps 1e-3 makes steps of tiny gradients tiny, as SGD's are."""
    cfg = policy_config(path, backend, **{**LORA, **overrides})
    cfg.optimizer.lr, cfg.optimizer.eps, cfg.max_grad_norm = 5e-2, 1e-3, 0.02
    return cfg


def peft_model(path: str, adapters: dict, lora_cfg):
    """peft's LoRA model on the HF base model at `path`, with `adapters` (peft's saved keys) loaded."""
    model = peft.get_peft_model(load_hf(path), lora.peft_config(lora_cfg))
    result = peft.set_peft_model_state_dict(model, adapters)
    assert not result.unexpected_keys, result.unexpected_keys
    return model


def adapter_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:4]
    return max((a[k] - b[k]).abs().max().item() for k in a)


def check_lora_step(policy: Policy, path: str, batch: dict, adapter_tol: float = 1e-5,
                    logprob_tol: float = 1e-5) -> dict:
    """One train call of a LoRA policy (built with init_reference=True) against peft's model from the same initial
    adapters: adapters, metrics and log-probs agree; the reference policy stays the base model; the merged export
    is W + scale * B @ A. Returns the errors it measured."""
    start = policy.adapter_state()
    assert start and all(not v.any() for k, v in start.items() if ".lora_B." in k)  # B starts at zero
    base_state = export_state(policy)
    with torch.no_grad():
        base_logprobs = hf_logprobs(load_hf(path).eval(), batch)
    metrics = policy.train(batch, TokenPGLoss())
    reference = peft_model(path, start, policy.cfg.lora)
    _, losses, norms, lrs = train_reference_model(reference, batch, policy.cfg)
    got, want = policy.adapter_state(), peft.get_peft_model_state_dict(reference)
    assert adapter_diff(got, start) > 1e-3  # the step moved the adapters, A as well as B:
    assert max((got[k] - start[k]).abs().max().item() for k in got if ".lora_A." in k) > 1e-4
    errors = {"adapters": adapter_diff(got, want)}
    assert errors["adapters"] <= adapter_tol, errors
    assert_step_metrics(metrics, losses, norms, lrs, batch, policy.cfg)
    with torch.no_grad():
        peft_logprobs = hf_logprobs(reference.eval(), batch)
    errors["logprobs"] = (policy.get_logprobs(batch) - peft_logprobs).abs().max().item()
    errors["reference"] = (policy.get_reference_logprobs(batch) - base_logprobs).abs().max().item()
    errors["merged"] = merged_export_error(policy, base_state, got)
    assert errors["logprobs"] <= logprob_tol and errors["reference"] <= 1e-5 and errors["merged"] <= 1e-6, errors
    print(f"LoRA step vs peft: {errors}")
    return errors


def merged_export_error(policy: Policy, base_state: dict, adapters: dict) -> float:
    """Max error of the policy's HF export against base W + scale * B @ A for every targeted weight (and the
    untouched rest equal to the base)."""
    scale, merged = lora.scale(policy.cfg.lora), dict(base_state)
    for key, a in adapters.items():
        if ".lora_A." in key:
            module = key[len(lora.PEFT_PREFIX):-len(".lora_A.weight")]
            b = adapters[key.replace(".lora_A.", ".lora_B.")]
            merged[f"{module}.weight"] = lora.merged(base_state[f"{module}.weight"], a, b, scale)
    got = export_state(policy)
    assert set(got) == set(merged)
    return max((got[k] - merged[k]).abs().max().item() for k in got)


def sampled_vs_teacher(prompts: list, outs: list, model, temperature: float) -> float:
    """Max |engine log-prob - HF teacher forcing of `model` at `temperature`| over the tokens an engine sampled
    (`outs`) from `prompts`."""
    worst = 0.0
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            logits = model(input_ids=torch.tensor([prompt + out.token_ids])).logits[0].float()
            logp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, -1)  # [len(out), V]
            want = logp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
            worst = max(worst, (want - torch.tensor(out.logprobs)).abs().max().item())
    return worst
