"""The vLLM generation engine against Hugging Face: greedy tokens, sampled-token log-probs, seeds, refit, stops.

One engine for the whole module (each start costs 10-20 s); tests that change sampling settings swap
`engine.cfg` (the front sends it with every call) and put it back.
"""

import dataclasses
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nemo_grpo.config import ClusterConfig, GenerationConfig, VllmConfig
from nemo_grpo.generation.torch_engine import filter_logits
from nemo_grpo.generation import vllm_available
from nemo_grpo.generation.vllm_engine import CPU_PREFILL_TOKENS, VllmGeneration, request_seed, sampling_kwargs
from weight_io import update_weights

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")

MAX_NEW = 8
FP32 = VllmConfig(precision="float32")  # "auto" would be bf16 on a CPU with native bf16; HF is the fp32 reference
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40, 41]]


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_model_dir):
    eng = VllmGeneration(GenerationConfig(max_new_tokens=MAX_NEW, vllm_cfg=FP32), tiny_model_dir("qwen2", seed=3), ClusterConfig())
    yield eng
    eng.shutdown()
    eng.shutdown()  # safe twice


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    """(model with seed 3 = the engine's, model with seed 4, tokenizer)."""
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2", seed=3), dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2", seed=4), dtype=torch.float32).eval()
    return old, new, AutoTokenizer.from_pretrained(tiny_model_dir("qwen2", seed=3))


@contextmanager
def sampling(engine, **changes):
    saved = engine.cfg
    engine.cfg = dataclasses.replace(saved, **changes)
    try:
        yield
    finally:
        engine.cfg = saved


def hf_greedy(model, tokenizer, prompt, n=MAX_NEW):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return out[0, len(prompt):].tolist()


def teacher_logits(model, prompt, tokens):
    """[len(tokens), V] logits that predicted each of `tokens` after `prompt`."""
    with torch.no_grad():
        return model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()


def sampled_logprobs(logp, tokens):
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_greedy_matches_hf_token_for_token(engine, hf):
    old, _, tok = hf
    outs = engine.generate(PROMPTS, greedy=True)
    for p, out in zip(PROMPTS, outs):
        expected = hf_greedy(old, tok, p)
        assert out.token_ids == expected
        assert out.finish_reason == ("stop" if expected[-1] == tok.eos_token_id else "length")
        assert len(out.logprobs) == len(out.token_ids)


@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.7, None), (0.7, 5)])
def test_sampled_logprobs_match_hf_teacher_forcing(engine, hf, temperature, top_k):
    """vLLM reports the log-prob under the distribution it sampled from: logits / T, top-k masked."""
    old = hf[0]
    with sampling(engine, temperature=temperature, top_k=top_k):
        outs = engine.generate(PROMPTS, seed=11)
    untempered_gap = 0.0
    for p, out in zip(PROMPTS, outs):
        logits = teacher_logits(old, p, out.token_ids)
        processed = torch.log_softmax(filter_logits(logits / temperature, top_k, 1.0), -1)
        torch.testing.assert_close(torch.tensor(out.logprobs), sampled_logprobs(processed, out.token_ids),
                                   atol=1e-4, rtol=0)
        raw = sampled_logprobs(torch.log_softmax(logits, -1), out.token_ids)
        untempered_gap = max(untempered_gap, (raw - torch.tensor(out.logprobs)).abs().max().item())
    if temperature != 1.0:
        assert untempered_gap > 1e-2  # the check above tells processed from raw log-probs apart


def test_same_seed_same_samples(engine):
    first = engine.generate(PROMPTS, seed=7)
    assert [o.token_ids for o in first] == [o.token_ids for o in engine.generate(PROMPTS, seed=7)]
    assert [o.logprobs for o in first] == [o.logprobs for o in engine.generate(PROMPTS, seed=7)]
    assert [o.token_ids for o in first] != [o.token_ids for o in engine.generate(PROMPTS, seed=8)]
    twins = engine.generate([PROMPTS[0], PROMPTS[0]], seed=7)  # per-request seeds: same prompt, new draw
    assert twins[0].token_ids != twins[1].token_ids


def test_seeded_call_larger_than_one_prefill_step(engine):
    """A seeded call whose prompts exceed one engine step's prefill budget (CPU_PREFILL_TOKENS). vLLM rewinds a
    seeded request's generator after a partial prefill, which a CPU generator cannot do: with chunked prefill on,
    such a call failed ("CPU Generator does not use offset"), e.g. an eval of 200 prompts x 4 samples."""
    prompts = [[(7 * i + t) % 30 + 5 for t in range(100)] for i in range(CPU_PREFILL_TOKENS // 100 + 20)]
    outs = engine.generate(prompts, seed=11, max_new_tokens=2)
    assert len(outs) == len(prompts) and all(1 <= len(o.token_ids) <= 2 for o in outs)


def test_refit_in_place_takes_effect_across_split_layers(engine, hf):
    """Buckets of 3 tensors split q/k/v and gate/up (fused in vLLM) across buckets; the result is still exact."""
    old, new, tok = hf
    new_state, old_state = new.state_dict(), old.state_dict()
    names = list(new_state)
    try:
        update_weights(engine, ({k: new_state[k] for k in names[i : i + 3]} for i in range(0, len(names), 3)))
        assert [o.token_ids for o in engine.generate(PROMPTS, greedy=True)] == \
            [hf_greedy(new, tok, p) for p in PROMPTS]
        sampled = engine.generate(PROMPTS, seed=3)
        for p, out in zip(PROMPTS, sampled):
            teacher = sampled_logprobs(torch.log_softmax(teacher_logits(new, p, out.token_ids), -1), out.token_ids)
            torch.testing.assert_close(torch.tensor(out.logprobs), teacher, atol=1e-4, rtol=0)
    finally:
        update_weights(engine, iter([{k: old_state[k] for k in names[:4]}, {k: old_state[k] for k in names[4:]}]))
    assert [o.token_ids for o in engine.generate(PROMPTS, greedy=True)] == [hf_greedy(old, tok, p) for p in PROMPTS]


def test_moe_refit_of_fused_experts_generates_like_hf(ray_cluster, tiny_model_dir):
    """Qwen3-MoE: the engine, started from one tiny MoE, refit with another's HF state_dict (transformers 5's
    fused experts, split into vLLM's per-expert tensors), then samples with that model's log-probs. Refit
    twice: the second is the weight update after which vLLM's CPU kernel needs its experts packed again."""
    paths = [tiny_model_dir("qwen3_moe", seed=s) for s in (0, 1)]
    models = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in paths]
    eng = VllmGeneration(GenerationConfig(max_new_tokens=MAX_NEW, vllm_cfg=FP32), paths[0], ClusterConfig())
    try:
        for model in (models[1], models[0]):
            update_weights(eng, [model.state_dict()])
            for p, out in zip(PROMPTS, eng.generate(PROMPTS, seed=5)):
                teacher = sampled_logprobs(torch.log_softmax(teacher_logits(model, p, out.token_ids), -1),
                                           out.token_ids)
                torch.testing.assert_close(torch.tensor(out.logprobs), teacher, atol=1e-4, rtol=0)
    finally:
        eng.shutdown()


def test_refit_rejects_unknown_names_and_keeps_serving(engine, hf):
    old, _, tok = hf
    with pytest.raises(Exception, match="no parameter"):
        update_weights(engine, iter([{"not.a.weight": torch.zeros(1)}]))
    assert [o.token_ids for o in engine.generate(PROMPTS, greedy=True)] == [hf_greedy(old, tok, p) for p in PROMPTS]


def test_finish_reasons_for_length_stop_token_and_stop_string(engine, hf):
    tok = hf[2]
    free = engine.generate([[5]], greedy=True, max_new_tokens=4)[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 4 and tok.eos_token_id not in free.token_ids
    target = free.token_ids[2]
    cut = free.token_ids.index(target) + 1
    with sampling(engine, stop_token_ids=[target]):
        out = engine.generate([[5]], greedy=True, max_new_tokens=4)[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:cut]
    stop_string = tok.decode([target])
    both = engine.generate([[5], [5]], greedy=True, max_new_tokens=4, stop_strings=[[stop_string], None])
    assert both[0].finish_reason == "stop" and both[0].token_ids == free.token_ids[:cut]
    assert both[1].finish_reason == "length" and both[1].token_ids == free.token_ids  # per prompt only


def test_sampling_kwargs_and_request_seeds():
    cfg = GenerationConfig(temperature=0.7, top_p=0.9, top_k=None, stop_strings=["\n"], stop_token_ids=[9])
    kw = sampling_kwargs(cfg, greedy=False, max_new_tokens=None, extra_stops=["</a>"])
    assert kw["temperature"] == 0.7 and kw["top_p"] == 0.9 and "top_k" not in kw
    assert kw["max_tokens"] == cfg.max_new_tokens and kw["stop"] == ["\n", "</a>"] and kw["stop_token_ids"] == [9]
    assert kw["logprobs"] == 0 and kw["include_stop_str_in_output"]
    greedy = sampling_kwargs(dataclasses.replace(cfg, top_k=4), greedy=True, max_new_tokens=2, extra_stops=None)
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 4 and greedy["max_tokens"] == 2
    seeds = [request_seed(1, i) for i in range(100)] + [request_seed(2, i) for i in range(100)]
    assert len(set(seeds)) == 200 and all(0 <= s < 2**63 for s in seeds) and request_seed(1, 0) == seeds[0]


def test_tensor_parallel_engine_generates_and_refits_like_hf(ray_cluster, hf, tiny_model_dir):
    """vllm_cfg.tensor_parallel_size=2 (two vLLM worker processes on the CPU): greedy tokens and sampled-token
    log-probs equal HF's before and after a bucketed refit (each TP worker keeps its shard of every bucket)."""
    old, new, tok = hf
    cfg = GenerationConfig(max_new_tokens=MAX_NEW, vllm_cfg=VllmConfig(tensor_parallel_size=2, precision="float32"))
    eng = VllmGeneration(cfg, tiny_model_dir("qwen2", seed=3), ClusterConfig())
    try:
        assert [o.token_ids for o in eng.generate(PROMPTS, greedy=True)] == [hf_greedy(old, tok, p) for p in PROMPTS]
        state = new.state_dict()
        names = list(state)
        update_weights(eng, ({k: state[k] for k in names[i : i + 3]} for i in range(0, len(names), 3)))
        assert [o.token_ids for o in eng.generate(PROMPTS, greedy=True)] == [hf_greedy(new, tok, p) for p in PROMPTS]
        for p, out in zip(PROMPTS, eng.generate(PROMPTS, seed=3)):
            teacher = sampled_logprobs(torch.log_softmax(teacher_logits(new, p, out.token_ids), -1), out.token_ids)
            torch.testing.assert_close(torch.tensor(out.logprobs), teacher, atol=1e-4, rtol=0)
    finally:
        eng.shutdown()
