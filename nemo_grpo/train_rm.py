"""Bradley-Terry reward-model training on either back end.

    python -m nemo_grpo.train_rm --config configs/rm_tiny_cpu.yaml [section.key=value ...]

Data: JSONL preference pairs (nemo_grpo/data/preferences.py: "chosen"/"rejected" as chat messages, or strings
with a "prompt"). The starting model is a local HF directory: a *ForSequenceClassification checkpoint, or a
causal LM whose score head is then initialized (seeded) and saved under `rm.output_dir/init` first, so that
every back end starts from the same weights. Loss -log sigmoid(r_chosen - r_rejected); validation accuracy
every `rm.val_period` steps; checkpoints as in GRPO (resumable); at the end the model is saved as an HF
directory `rm.output_dir/hf` that `env.reward_model.model_name` takes as it is.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from nemo_grpo.config import (CheckpointingConfig, ClusterConfig, ConfigError, LoggerConfig, PolicyConfig, _choice,
                              _need, load_config, to_dict, to_yaml, validate_megatron_layout)

log = logging.getLogger(__name__)
BUILTIN = "builtin:"


@dataclass
class RMDataConfig:
    train_data_path: str = ""  # JSONL of preference pairs, or builtin:addition (generated, seed 0)
    val_data_path: Optional[str] = None  # (builtin:addition: other wrong answers, seed 1)
    max_seq_length: int = 256  # longer conversations keep their last tokens


@dataclass
class RMLoopConfig:
    max_num_steps: int = 100  # optimizer steps of policy.train_global_batch_size rows (= half as many pairs)
    val_period: int = 10  # 0: validate only at the end
    seed: int = 42
    output_dir: str = "results/rm"  # init/ (a causal LM's seeded score head) and hf/ (the trained model)


@dataclass
class RMTrainConfig:
    policy: PolicyConfig = field(default_factory=lambda: PolicyConfig(max_grad_norm=1.0))
    rm: RMLoopConfig = field(default_factory=RMLoopConfig)
    data: RMDataConfig = field(default_factory=RMDataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpointing: CheckpointingConfig = field(default_factory=lambda: CheckpointingConfig(
        checkpoint_dir="results/rm/checkpoints"))
    logger: LoggerConfig = field(default_factory=lambda: LoggerConfig(log_dir="logs/rm", plot=False))


def check(cfg: RMTrainConfig) -> None:
    """Keys, files and batch shapes (whole pairs in every micro-batch and data-parallel shard)."""
    p = cfg.policy
    _need(p.model_name.startswith(BUILTIN) or os.path.isdir(p.model_name), "policy.model_name",
          f"'{p.model_name}' is not a local directory (or builtin:tiny-addition)")
    for key in ("train_data_path", "val_data_path"):
        path = getattr(cfg.data, key)
        _need((path is None and key == "val_data_path") or (path or "").startswith(BUILTIN) or os.path.isfile(path),
              f"data.{key}", f"file not found: '{path}'")
    _choice(p.backend, "policy.backend", ["dtensor", "megatron"])
    world = cfg.cluster.gpus_per_node * cfg.cluster.num_nodes
    if p.backend == "megatron":
        validate_megatron_layout(p, world)
        dp = world // (p.megatron_cfg.tensor_model_parallel_size * p.megatron_cfg.pipeline_model_parallel_size)
    else:
        tp = p.dtensor_cfg.tensor_parallel_size
        _need(tp > 0 and world % tp == 0, "policy.dtensor_cfg.tensor_parallel_size", f"{tp} does not divide {world}")
        dp = world // tp
    gbs, mbs = p.train_global_batch_size, p.train_micro_batch_size
    _need(gbs % (2 * dp) == 0, "policy.train_global_batch_size",
          f"{gbs} rows must split into whole (chosen, rejected) pairs on each of {dp} data-parallel ranks")
    _need(mbs % 2 == 0 and (gbs // dp) % mbs == 0, "policy.train_micro_batch_size",
          f"{mbs} must be even and divide the per-rank rows {gbs} / {dp} = {gbs // dp}")
    _need(cfg.rm.max_num_steps > 0, "rm.max_num_steps", "must be > 0")
    _need(cfg.data.max_seq_length > 1, "data.max_seq_length", "must be > 1")


def prepare_model(model_path: str, out_dir: str, seed: int) -> str:
    """A *ForSequenceClassification directory (num_labels 1): model_path itself, or model_path's LM with a
    seeded new score head saved under out_dir/init."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(model_path)
    if any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
        return model_path
    target = os.path.join(out_dir, "init")
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


class RewardModelTrainer:
    """The loop: batches of pairs through Policy.train (BradleyTerryLoss), validation, checkpoints."""

    def __init__(self, cfg: RMTrainConfig):
        from transformers import AutoTokenizer

        from nemo_grpo.data.preferences import pad_id_of
        from nemo_grpo.distributed.cluster import init_ray
        from nemo_grpo.policy import Policy
        from nemo_grpo.utils.checkpoint import CheckpointManager
        from nemo_grpo.utils.logger import Logger

        from nemo_grpo.models.builtin import resolve_model_path

        self.cfg = cfg
        path = prepare_model(resolve_model_path(cfg.policy.model_name), cfg.rm.output_dir, cfg.rm.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.pad_id = pad_id_of(self.tokenizer)
        self.train_pairs = self._tokenized(cfg.data.train_data_path, seed=0)
        self.val_pairs = self._tokenized(cfg.data.val_data_path, seed=1) if cfg.data.val_data_path else []
        self.pairs_per_step = cfg.policy.train_global_batch_size // 2
        self.checkpointer, self.logger = CheckpointManager(cfg.checkpointing), Logger(cfg.logger, to_dict(cfg))
        init_ray()
        self.policy = Policy(cfg.policy, cfg.cluster, path, scalar_head=True, seed=cfg.rm.seed, name="reward_model")
        self.step = 0

    def _tokenized(self, path: str, seed: int) -> list[tuple[list[int], list[int]]]:
        from nemo_grpo.data.preferences import read_preference_pairs, render_conversation

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
        from nemo_grpo.algorithms.reward_model import pair_accuracy
        from nemo_grpo.data.preferences import right_padded

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
        from nemo_grpo.algorithms.reward_model import BradleyTerryLoss
        from nemo_grpo.data.preferences import pair_batch

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


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_grpo.train_rm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML recipe (e.g. configs/rm_tiny_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rm.max_num_steps=10")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg: Any = load_config(args.config, args.overrides, schema=RMTrainConfig, check=check)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    trainer = RewardModelTrainer(cfg)
    try:
        val = trainer.run()
    finally:
        trainer.close()
    print(f"reward model saved to {os.path.join(cfg.rm.output_dir, 'hf')}; validation {val}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
