"""Multi-turn rollouts: the environment's turns continue the conversation and are masked out of the loss."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from nemo_grpo.algorithms.rollout import collate, run_rollouts
from nemo_grpo.config import ClusterConfig, GenerationConfig
from nemo_grpo.data.prompts import Datum
from nemo_grpo.envs import create_env
from nemo_grpo.envs.guessing_game import reply
from nemo_grpo.generation.torch_engine import TorchGeneration
from nemo_grpo.models.tiny import make_tokenizer


def test_reply_rules():
    assert reply("5", 5) == (1.0, True, " correct ")
    assert reply("3", 5)[2] == " higher " and reply("a7", 5)[2] == " lower " and reply("x", 5)[1] is False


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_three_turns_and_environment_tokens_masked(ray_cluster, tiny_model_dir, arch):
    """Three turns; the batch trains exactly on the generated tokens. A Mixture-of-Experts model's batch also
    carries the engine's routes: HF's top-k at every position of the whole conversation (each turn's call
    re-runs the context) but the last sampled token where no forward ran it, -1 there and on the padding."""
    tokenizer = make_tokenizer()
    path = tiny_model_dir(arch, seed=3)
    engine = TorchGeneration(GenerationConfig(max_new_tokens=3), path, ClusterConfig())
    env = create_env("guess", None)
    # a target no reply can hit (-1): every episode runs the full 3 turns
    datums = [Datum(message_log=[{"role": "user", "content": f"guess{i}:"}],
                    prompt_ids=tokenizer.encode(f"guess{i}:"), extra_env_info={"target": -1}, task_name="guess", idx=i)
              for i in range(4)]
    samples = run_rollouts(datums, engine, tokenizer, {"guess": env}, max_new_tokens=3, max_turns=3,
                           max_seq_len=64, seed=0)
    batch = collate(samples, tokenizer.pad_token_id)
    for i, s in enumerate(samples):
        assert s.turns == 3 and s.done
        roles = [m["role"] for m in s.message_log]
        assert roles == ["user", "assistant", "environment", "assistant", "environment", "assistant"]
        n = int(batch["input_lengths"][i])
        mask, ids = batch["token_mask"][i, :n], batch["input_ids"][i, :n].tolist()
        assert int(mask.sum()) == s.response_length  # exactly the generated tokens are trained on
        env_text = tokenizer.decode([t for t, m in zip(ids, mask) if m == 0][len(datums[i].prompt_ids):])
        assert env_text == "".join(m["content"] for m in s.message_log if m["role"] == "environment")
        assert torch.all(batch["generation_logprobs"][i, :n][mask == 0] == 0)
    engine.shutdown()
    assert ("routed_experts" in batch) == (arch == "qwen3_moe")
    if arch == "qwen3_moe":
        check_routes_are_hfs(batch, path)


def check_routes_are_hfs(batch: dict, path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    for i, n in enumerate(batch["input_lengths"].tolist()):
        with torch.no_grad():
            logits = model(batch["input_ids"][i:i + 1, :n], output_router_logits=True).router_logits
        hf = torch.stack([torch.topk(x, 2).indices for x in logits], dim=1)  # [n, L, k]
        routes = batch["routed_experts"][i]
        ran = n - int((routes[n - 1] == -1).all())  # the last token ran when the call went on for other rows
        assert ran >= n - 1 and torch.equal(routes[:ran].long().sort(-1).values, hf[:ran].sort(-1).values)
        assert bool((routes[ran:] == -1).all())
