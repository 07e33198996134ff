"""The torch generation engine: HF-exact greedy decoding, sampled-token log-probs, refit in place, stops."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from weight_io import update_weights

from nemo_grpo.config import ClusterConfig, GenerationConfig
from nemo_grpo.generation.torch_engine import TorchGeneration, filter_logits

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=1, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def teacher_logprobs(model, prompt, tokens) -> torch.Tensor:
    """[len(tokens)] log-probs of `tokens` after `prompt` under `model`, by teacher forcing."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    return lp[len(prompt) - 1 : -1].gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_model_dir):
    eng = TorchGeneration(GenerationConfig(max_new_tokens=8), tiny_model_dir("qwen2", seed=3), ClusterConfig())
    yield eng
    eng.shutdown()


def test_greedy_matches_hf_and_logprobs_match_teacher_forcing(engine, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2", seed=3)).eval()
    for p, out in zip(PROMPTS, engine.generate(PROMPTS, greedy=True)):
        assert out.token_ids == hf_greedy(model, p, 8)[: len(out.token_ids)]
    sampled = engine.generate(PROMPTS, seed=7)
    assert [o.token_ids for o in sampled] == [o.token_ids for o in engine.generate(PROMPTS, seed=7)]
    for p, out in zip(PROMPTS, sampled):
        assert torch.allclose(teacher_logprobs(model, p, out.token_ids), torch.tensor(out.logprobs), atol=1e-5)


def test_refit_in_place_changes_generation(engine, tiny_model_dir):
    """Weights of another model, in two buckets: decoding is then exactly the new model's (greedy tokens as HF
    generates them, log-probs as teacher forcing under the new weights, not the old ones); the old weights back
    restore the old outputs. (Untrained tied-embedding models greedily repeat the prompt's last token, so the
    log-probs are what tells the two apart.)"""
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2", seed=3)).eval()
    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2", seed=4)).eval()
    before = engine.generate(PROMPTS, greedy=True)
    state = new.state_dict()
    names = list(state)
    update_weights(engine, iter([{k: state[k] for k in names[:5]}, {k: state[k] for k in names[5:]}]))
    after = engine.generate(PROMPTS, greedy=True)
    assert all(o.token_ids for o in after)
    assert [o.logprobs for o in after] != [o.logprobs for o in before]
    for p, o in zip(PROMPTS, after):
        assert o.token_ids == hf_greedy(new, p, 8)
        logprobs = torch.tensor(o.logprobs)
        assert torch.allclose(teacher_logprobs(new, p, o.token_ids), logprobs, atol=1e-5)
        assert not torch.allclose(teacher_logprobs(old, p, o.token_ids), logprobs, atol=1e-3)
    update_weights(engine, iter([old.state_dict()]))  # back, for the other tests
    assert [(o.token_ids, o.logprobs) for o in engine.generate(PROMPTS, greedy=True)] == \
        [(o.token_ids, o.logprobs) for o in before]
    with pytest.raises(Exception, match="no parameter"):
        update_weights(engine, iter([{"not.a.weight": torch.zeros(1)}]))


def test_stop_token_and_length_reasons(ray_cluster, tiny_model_dir):
    path = tiny_model_dir("qwen2", seed=3)
    free = TorchGeneration(GenerationConfig(max_new_tokens=3), path, ClusterConfig())
    first = free.generate([[5]], greedy=True)[0]
    assert first.finish_reason == "length" and len(first.token_ids) == 3
    stopping = TorchGeneration(GenerationConfig(max_new_tokens=3, stop_token_ids=[first.token_ids[1]]), path,
                               ClusterConfig())
    out = stopping.generate([[5]], greedy=True)[0]
    stop_at = first.token_ids.index(first.token_ids[1])
    assert out.finish_reason == "stop" and out.token_ids == first.token_ids[: stop_at + 1]
    free.shutdown()
    stopping.shutdown()


def test_moe_routes_are_the_routers_top_k(engine, tiny_model_dir):
    """A Mixture-of-Experts model: each output carries the experts every position of prompt + response was routed
    to (left-padded prompts of three lengths, rows that run out at different steps), HF's top-k of the same
    tokens in each layer, and -1 where no forward ran (the last sampled token); a dense model's carry none."""
    path = tiny_model_dir("qwen3_moe")
    eng = TorchGeneration(GenerationConfig(max_new_tokens=6, stop_token_ids=[20]), path, ClusterConfig())
    outs = eng.generate(PROMPTS, seed=3)
    eng.shutdown()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    for prompt, out in zip(PROMPTS, outs):
        seq = prompt + out.token_ids
        with torch.no_grad():
            logits = model(torch.tensor([seq]), output_router_logits=True).router_logits  # per layer [S, E]
        hf = torch.stack([torch.topk(x, 2).indices for x in logits], dim=1)  # [S, L, k]
        routes = out.routed_experts
        assert routes.dtype == torch.int16 and routes.shape == (len(seq), 2, 2)
        assert torch.equal(routes[:-1].long().sort(-1).values, hf[:-1].sort(-1).values)
        assert bool((routes[-1] == -1).all()) or out.finish_reason == "stop"
    assert len({len(o.token_ids) for o in outs}) > 1 or any(o.finish_reason == "stop" for o in outs)
    assert engine.generate(PROMPTS[:1], greedy=True)[0].routed_experts is None  # the dense model


def test_top_p_and_top_k_filter():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, None, 0.7))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7 <= 0.8
    assert torch.isfinite(filter_logits(logits, 1, 1.0)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(filter_logits(logits, None, 1.0)).all()
