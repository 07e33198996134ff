"""Bradley-Terry reward models: the pairwise loss, the training loop and evaluation on preference pairs.

Batches hold pairs as consecutive rows (chosen_0, rejected_0, chosen_1, rejected_1, ...): see
nemo_grpo/data/preferences.py::pair_batch. Micro-batches and data-parallel shards must therefore hold an
even number of rows (whole pairs); validation.validate_rm_train checks the batch sizes before anything starts.

Training (`RewardModelTrainer`, python -m nemo_grpo.train_rm): the starting model is a local HF directory, a
*ForSequenceClassification checkpoint, or a causal LM whose score head is then initialized (seeded) and saved
under `rm.output_dir/init` first, so that every back end starts from the same weights. Loss
-log sigmoid(r_chosen - r_rejected); validation accuracy every `rm.val_period` steps; checkpoints as in GRPO
(resumable); at the end the model is saved as an HF directory `rm.output_dir/hf` that
`env.reward_model.model_name` takes as it is.
Evaluation (`evaluate`, python -m nemo_grpo.eval_rm): accuracy per subset, through the same `Policy.score` the
reward-model environment uses.
"""

from __future__ import annotations

import logging
import os
import random
from collections import defaultdict

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForSequenceClassification

from nemo_grpo.config import ClusterConfig, to_dict, to_yaml
from nemo_grpo.data.preferences import pad_id_of, pair_batch, read_preference_pairs, render_conversation, right_padded
from nemo_grpo.distributed.cluster import init_ray
from nemo_grpo.envs.reward_model_env import reward_model_tokenizer
from nemo_grpo.models.builtin import resolve_model_path
from nemo_grpo.models.tokenizer import load_tokenizer
from nemo_grpo.policy import Policy
from nemo_grpo.utils.checkpoint import CheckpointManager
from nemo_grpo.utils.logger import Logger

log = logging.getLogger(__name__)


class BradleyTerryLoss:
    """scores [b] (rows chosen, rejected, ...) -> sum over the micro-batch's pairs of -log sigmoid(r_c - r_r),
    divided by the global pair count: an additive contribution, as every loss here (backends/actor.py)."""

    def __call__(self, scores: torch.Tensor, mb: dict, global_valid_seqs: torch.Tensor, global_valid_toks):
        if scores.dim() != 1 or scores.shape[0] % 2:
            raise ValueError(f"Bradley-Terry loss: expected scores [b] of whole (chosen, rejected) pairs, got "
                             f"shape {tuple(scores.shape)}; micro-batches must hold an even number of rows")
        margin = scores[0::2] - scores[1::2]  # [b / 2]
        pair_mask = mb["sample_mask"][0::2].to(scores.dtype)
        pairs = global_valid_seqs / 2
        loss = (-F.logsigmoid(margin) * pair_mask).sum() / pairs
        return loss, {"accuracy": ((margin > 0).to(scores.dtype) * pair_mask).sum() / pairs,
                      "margin": (margin.detach() * pair_mask).sum() / pairs}


def pair_accuracy(scores: torch.Tensor) -> torch.Tensor:
    """scores [2P] (rows chosen, rejected, ...) -> [P] 1.0 where the chosen response scores higher."""
    return (scores[0::2] > scores[1::2]).float()


def prepare_model(model_path: str, out_dir: str, seed: int) -> str:
    """A *ForSequenceClassification directory (num_labels 1): model_path itself, or model_path's LM with a
    seeded new score head saved under out_dir/init."""
    config = AutoConfig.from_pretrained(model_path)
    if any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
        return model_path
    target = os.path.join(out_dir, "init")
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1, dtype=torch.float32)
    tokenizer = load_tokenizer(model_path)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


class RewardModelTrainer:
    """The loop: batches of pairs through Policy.train (BradleyTerryLoss), validation, checkpoints."""

    def __init__(self, cfg):
        """cfg: RMTrainConfig (nemo_grpo/config.py), validated."""
        self.cfg = cfg
        path = prepare_model(resolve_model_path(cfg.policy.model_name), cfg.rm.output_dir, cfg.rm.seed)
        self.tokenizer = load_tokenizer(path)
        self.pad_id = pad_id_of(self.tokenizer)
        self.train_pairs = self._tokenized(cfg.data.train_data_path, seed=0)
        self.val_pairs = self._tokenized(cfg.data.val_data_path, seed=1) if cfg.data.val_data_path else []
        self.pairs_per_step = cfg.policy.train_global_batch_size // 2
        self.checkpointer, self.logger = CheckpointManager(cfg.checkpointing), Logger(cfg.logger, to_dict(cfg))
        init_ray()
        self.policy = Policy(cfg.policy, cfg.cluster, path, scalar_head=True, seed=cfg.rm.seed, name="reward_model",
                             config_key="policy")
        self.step = 0

    def _tokenized(self, path: str, seed: int) -> list[tuple[list[int], list[int]]]:
        n = self.cfg.data.max_seq_length
        return [(render_conversation(self.tokenizer, p["chosen"], n)[0],
                 render_conversation(self.tokenizer, p["rejected"], n)[0]) for p in read_preference_pairs(path, seed)]

    def _pairs_of_step(self, step: int) -> list[tuple[list[int], list[int]]]:
        """The pairs of optimizer step `step` (0-based): epochs of a seeded shuffle, a function of the step."""
        n, k = len(self.train_pairs), self.pairs_per_step
        out = []
        for i in range(step * k, (step + 1) * k):
            epoch, pos = divmod(i, n)
            order = list(range(n))
            random.Random(self.cfg.rm.seed + epoch).shuffle(order)
            out.append(self.train_pairs[order[pos]])
        return out

    def validate(self) -> dict[str, float]:
        if not self.val_pairs:
            return {}
        scores = self.policy.score(right_padded([ids for pair in self.val_pairs for ids in pair], self.pad_id))
        metrics = {"accuracy": float(pair_accuracy(scores).mean()), "num_pairs": float(len(self.val_pairs))}
        self.logger.log_metrics(metrics, self.step, prefix="val")
        return metrics

    def save(self, val: dict[str, float]) -> None:
        info = {"step": self.step, "metrics": {f"val:{k}": v for k, v in val.items()}}
        tmp = self.checkpointer.init_tmp_checkpoint(self.step, info, to_yaml(self.cfg))
        self.policy.save_checkpoint(os.path.join(tmp, "policy"))
        self.checkpointer.finalize_checkpoint(tmp)

    def maybe_resume(self) -> None:
        ck = self.cfg.checkpointing
        path = self.checkpointer.get_latest_checkpoint_path() if ck.enabled and ck.resume else None
        if path is not None:
            self.policy.load_checkpoint(os.path.join(path, "policy"))
            self.step = self.checkpointer.load_training_info(path)["step"]
            log.info("resumed from %s at step %d", path, self.step)

    def run(self) -> dict[str, float]:
        cfg, val = self.cfg, {}
        self.maybe_resume()
        while self.step < cfg.rm.max_num_steps:
            metrics = self.policy.train(pair_batch(self._pairs_of_step(self.step), self.pad_id), BradleyTerryLoss())
            self.step += 1
            self.logger.log_metrics(metrics, self.step, prefix="train")
            log.info("step %d/%d | loss %.4f | accuracy %.3f", self.step, cfg.rm.max_num_steps, metrics["loss"],
                     metrics["accuracy"])
            last = self.step == cfg.rm.max_num_steps
            if (cfg.rm.val_period and self.step % cfg.rm.val_period == 0) or last:
                val = self.validate()
            if cfg.checkpointing.enabled and (self.step % cfg.checkpointing.save_period == 0 or last):
                self.save(val)
        self.policy.save_pretrained(os.path.join(cfg.rm.output_dir, "hf"))
        return val

    def close(self) -> None:
        self.logger.close()
        self.policy.shutdown()


def evaluate(env_cfg, pairs: list[dict], num_workers: int = 1) -> dict[str, tuple[float, int]]:
    """env.reward_model-style config + preference pairs -> {subset: (accuracy, pairs)}, plus "all"."""
    tokenizer, pad = reward_model_tokenizer(env_cfg)
    rows = [render_conversation(tokenizer, p[side], env_cfg.max_model_len)[0] for p in pairs
            for side in ("chosen", "rejected")]
    cluster = ClusterConfig(gpus_per_node=num_workers, num_nodes=1)
    with Policy(env_cfg.policy_config(), cluster, env_cfg.model_name, scalar_head=True,
                name="reward_model", config_key="env.reward_model") as policy:
        scores = policy.score(right_padded(rows, pad))  # [2P]: chosen, rejected, ...
    right: dict[str, list[float]] = defaultdict(list)
    for pair, won in zip(pairs, pair_accuracy(scores).tolist()):
        right[pair["subset"]].append(float(won))
        right["all"].append(float(won))
    return {subset: (sum(v) / len(v), len(v)) for subset, v in sorted(right.items())}
