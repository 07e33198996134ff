"""Bradley-Terry reward-model training on both back ends: it learns a synthetic preference (responses that
contain a marker win) and the back ends take the same steps from the same weights."""

import random

import pytest
import torch
from policy_checks import CLUSTER, policy_config

from nemo_grpo.algorithms.reward_model import BradleyTerryLoss, pair_accuracy
from nemo_grpo.data.preferences import pair_batch, render_conversation, right_padded
from nemo_grpo.models.tokenizer import load_tokenizer
from nemo_grpo.policy import Policy

MARKER, LETTERS = "$", "abcdefghijklmnopqrstuvwxyz"
STEPS, PAIRS_PER_STEP = 30, 8


def marker_pairs(n: int, seed: int) -> list[dict]:
    """Prompt of 3 letters; the chosen response is the rejected one with a letter replaced by the marker."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        prompt = "".join(rng.choices(LETTERS, k=3))
        rejected = "".join(rng.choices(LETTERS, k=5))
        i = rng.randrange(5)
        chosen = rejected[:i] + MARKER + rejected[i + 1:]
        pairs.append({"chosen": [{"role": "user", "content": prompt}, {"role": "assistant", "content": chosen}],
                      "rejected": [{"role": "user", "content": prompt},
                                   {"role": "assistant", "content": rejected}]})
    return pairs


def tokenize(pairs: list[dict], tokenizer) -> list[tuple[list[int], list[int]]]:
    return [(render_conversation(tokenizer, p["chosen"], 64)[0], render_conversation(tokenizer, p["rejected"], 64)[0])
            for p in pairs]


def train_and_validate(path: str, backend: str, overrides: dict) -> tuple[list[float], list[float], float]:
    """(loss per step, pre-clip gradient norm per step, validation pair accuracy)."""
    tokenizer = load_tokenizer(path)
    train = tokenize(marker_pairs(STEPS * PAIRS_PER_STEP, seed=0), tokenizer)
    val = tokenize(marker_pairs(32, seed=1), tokenizer)
    cfg = policy_config(path, backend=backend, train_global_batch_size=2 * PAIRS_PER_STEP,
                        train_micro_batch_size=4, logprob_batch_size=16, max_grad_norm=1.0, **overrides)
    cfg.optimizer.lr, cfg.optimizer.warmup_steps = 3e-3, 0
    losses, norms = [], []
    with Policy(cfg, CLUSTER, path, scalar_head=True) as rm:
        for step in range(STEPS):
            chunk = train[step * PAIRS_PER_STEP:(step + 1) * PAIRS_PER_STEP]
            metrics = rm.train(pair_batch(chunk, tokenizer.pad_token_id), BradleyTerryLoss())
            losses.append(metrics["loss"])
            norms.append(metrics["grad_norm"])
        scores = rm.score(right_padded([ids for pair in val for ids in pair], tokenizer.pad_token_id))
    return losses, norms, float(pair_accuracy(scores).mean())


@pytest.fixture(scope="module")
def bt_runs(ray_cluster, tiny_model_dir):
    path = tiny_model_dir("qwen2", scalar_head=True)
    return {"dtensor": train_and_validate(path, "dtensor", {}),
            "megatron": train_and_validate(path, "megatron", {"megatron_cfg.tensor_model_parallel_size": 2})}


@pytest.mark.parametrize("backend", ["dtensor", "megatron"])
def test_bradley_terry_learns_the_preference(bt_runs, backend):
    losses, _, accuracy = bt_runs[backend]
    assert accuracy >= 0.9, accuracy
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, losses


def test_back_ends_take_the_same_first_step(bt_runs):
    """DTensor FSDP2 dp=2 vs Megatron TP=2 from the same weights on the same batch: the first step's loss and
    pre-clip gradient norm, both pure functions of those weights, agree to float32 rounding. The two sum in
    different orders (TP-sharded matmuls and all-reduces vs FSDP's reduce-scatter), a relative error of a few
    ulps per reduction over a 2-layer model: ~1e-7 measured, bounded here by 1e-5 relative. Later steps are
    not compared: Adam's first update is g / (|g| + eps), so gradient elements near eps turn rounding into a
    +-lr difference, which then grows step by step on any CPU (1e-4 by step 11 on one, by step 10 on another);
    both back ends' learning is asserted on its own above."""
    (dt_loss, dt_norm, _), (mc_loss, mc_norm, _) = bt_runs["dtensor"], bt_runs["megatron"]
    assert mc_loss[0] == pytest.approx(dt_loss[0], rel=1e-5, abs=1e-7)
    assert mc_norm[0] == pytest.approx(dt_norm[0], rel=1e-5, abs=1e-7)


def test_loss_matches_hand_computation():
    scores = torch.tensor([2.0, 0.5, -1.0, 1.0])  # pairs: margins 1.5 and -2.0
    mb = {"sample_mask": torch.ones(4)}
    loss, metrics = BradleyTerryLoss()(scores, mb, torch.tensor(4.0), torch.tensor(0.0))
    expected = (-torch.nn.functional.logsigmoid(torch.tensor(1.5)) - torch.nn.functional.logsigmoid(
        torch.tensor(-2.0))) / 2
    assert loss.item() == pytest.approx(expected.item())
    assert metrics["accuracy"].item() == pytest.approx(0.5) and metrics["margin"].item() == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="even number of rows"):
        BradleyTerryLoss()(scores[:3], {"sample_mask": torch.ones(3)}, torch.tensor(3.0), torch.tensor(0.0))


# ---------------------------------------------------------------------------------------------- the environment
def live_placement_groups() -> int:
    import ray

    return sum(1 for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED")


@pytest.mark.parametrize("backend,overrides", [("dtensor", {}), ("megatron", {"tensor_model_parallel_size": 2})])
def test_environment_scores_like_the_hf_classifier(ray_cluster, tiny_model_dir, backend, overrides):
    """Rewards equal AutoModelForSequenceClassification on the re-rendered, truncated conversations; metrics;
    shutdown frees the workers and so does dropping the actor."""
    import ray
    from transformers import AutoModelForSequenceClassification

    from nemo_grpo.config import RewardModelEnvConfig
    from nemo_grpo.envs import create_env

    path = tiny_model_dir("qwen2", scalar_head=True)
    cfg = RewardModelEnvConfig(model_name=path, batch_size=2, max_model_len=12, backend=backend)
    cfg.resources.gpus_per_node = 2 if overrides else 1
    for key, value in overrides.items():
        setattr(cfg.megatron_cfg, key, value)
    logs = [[{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}],
            [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "a long answer here"}],
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]]
    before = live_placement_groups()
    env = create_env("reward_model", cfg)
    ret = ray.get(env.step.remote(logs, [{}] * 3))
    _, metrics = ray.get(env.global_post_process_and_metrics.remote({"rewards": ret.rewards}))
    texts = ["1+2=3", "abca long answer here", "x"]  # the plain template concatenates the messages
    tokenizer = load_tokenizer(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # the long one keeps its last 12 tokens
        ref = torch.stack([model(input_ids=torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"][-12:]])
                                 ).logits[0, 0] for t in texts])
    assert (ret.rewards - ref).abs().max().item() <= 1e-5
    assert ret.terminateds.all()
    assert metrics["reward_model_env/num_samples"] == 3 and metrics["reward_model_env/num_truncated"] == 1
    assert metrics["reward_model_env/mean_reward"] == pytest.approx(float(ref.mean()), abs=1e-5)
    assert metrics["reward_model_env/max_reward"] == pytest.approx(float(ref.max()), abs=1e-5)
    assert live_placement_groups() == before + 1
    ray.get(env.shutdown.remote())
    assert live_placement_groups() == before
    env2 = create_env("reward_model", cfg)  # forgotten shutdown: dropping the actor frees the workers too
    ray.get(env2.__ray_ready__.remote())
    assert live_placement_groups() == before + 1
    del env2
    for _ in range(100):
        if live_placement_groups() == before:
            break
        __import__("time").sleep(0.2)
    assert live_placement_groups() == before


# ---------------------------------------------------------------------------------------------- evaluation
def test_evaluation_per_subset_is_identical_on_both_back_ends(ray_cluster, tiny_model_dir, tmp_path, capsys):
    """eval_rm's per-subset accuracies: the same on DTensor and Megatron TP=2, and as HF's classifier ranks."""
    import json

    from transformers import AutoModelForSequenceClassification

    from nemo_grpo.config import RewardModelEnvConfig
    from nemo_grpo.data.preferences import read_preference_pairs
    from nemo_grpo.algorithms.reward_model import evaluate
    from nemo_grpo.eval_rm import main

    path = tiny_model_dir("qwen2", scalar_head=True)
    data = tmp_path / "pairs.jsonl"
    with open(data, "w") as f:
        for i, p in enumerate(marker_pairs(24, seed=5)):
            f.write(json.dumps({"prompt": p["chosen"][0]["content"], "chosen": p["chosen"][1]["content"],
                                "rejected": p["rejected"][1]["content"], "subset": f"subset{i % 3}"}) + "\n")
    pairs = read_preference_pairs(str(data))
    tokenizer = load_tokenizer(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()

    def hf_score(messages):
        ids = render_conversation(tokenizer, messages, 64)[0]
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])

    with torch.no_grad():
        wins = [hf_score(p["chosen"]) > hf_score(p["rejected"]) for p in pairs]
    expected = {f"subset{k}": sum(wins[k::3]) / 8 for k in range(3)}
    dtensor = evaluate(RewardModelEnvConfig(model_name=path, batch_size=8, backend="dtensor"), pairs)
    mcfg = RewardModelEnvConfig(model_name=path, batch_size=8, backend="megatron")
    mcfg.megatron_cfg.tensor_model_parallel_size = 2
    megatron = evaluate(mcfg, pairs, num_workers=2)
    assert dtensor == megatron
    assert {k: v[0] for k, v in dtensor.items() if k != "all"} == pytest.approx(expected)
    assert dtensor["all"] == (pytest.approx(sum(wins) / 24), 24)
    assert main([f"reward_model.model_name={path}", f"data_path={data}"]) == 0
    out = capsys.readouterr().out
    assert "subset1" in out and f"{expected['subset1']:9.4f}" in out
