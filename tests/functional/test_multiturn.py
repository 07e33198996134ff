"""Multi-turn rollouts: the environment's turns continue the conversation and are masked out of the loss."""

import torch

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


def test_three_turns_and_environment_tokens_masked(ray_cluster, tiny_model_dir):
    tokenizer = make_tokenizer()
    engine = TorchGeneration(GenerationConfig(max_new_tokens=3), tiny_model_dir("qwen2", seed=3), ClusterConfig())
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
