"""Evaluation of a model on a data set: eval.num_tests_per_prompt samples per prompt, scored by the prompt's
environment, summarised by algorithms/metrics.py (the metrics GRPO's validation reports too).

    evaluator = Evaluator(cfg, tokenizer=tok, engine=engine, envs={"math": env}, datums=datums, model_path=path)
    metrics = evaluator.run()      # {"pass@1", "pass@k", "cons@k", "accuracy", "mean_response_length", ...}
    evaluator.write()              # <eval.save_path>/samples.jsonl and summary.json
    print(evaluator.table())
    evaluator.close()              # the engine and the environments
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import ray
from tqdm import tqdm

from nemo_grpo.algorithms import rollout
from nemo_grpo.algorithms.metrics import sample_metrics
from nemo_grpo.algorithms.rollout import Sample
from nemo_grpo.config import EvalMasterConfig

SAMPLES_FILE, SUMMARY_FILE = "samples.jsonl", "summary.json"
SHOWN = ("pass@1", "pass@{k}", "cons@{k}", "accuracy", "mean_response_length", "fraction_truncated",
         "num_prompts", "num_samples")  # the table's rows, in order


def headline_key(metric: str, k: int) -> str:
    """eval.metric ("pass@k" | "cons@k") with its k: "pass@4"."""
    return metric.replace("@k", f"@{k}")


def sample_record(s: Sample, prompt_index: int, sample_index: int) -> dict[str, Any]:
    """One line of samples.jsonl."""
    return {"prompt_index": prompt_index, "sample_index": sample_index, "prompt": rollout.prompt_text(s),
            "response": rollout.response_text(s), "reward": s.reward, "answer": s.answer,
            "ground_truth": s.datum.extra_env_info.get("ground_truth"), "response_length": s.response_length,
            "truncated": s.truncated}


class Evaluator:
    """Generates and scores every prompt's samples (`run`), writes them and the summary (`write`)."""

    def __init__(self, cfg: EvalMasterConfig, *, tokenizer, engine, envs: dict, datums: list, model_path: str):
        self.cfg, self.tokenizer, self.engine, self.envs = cfg, tokenizer, engine, envs
        self.datums, self.model_path = datums, model_path
        self.samples: list[Sample] = []
        self.metrics: dict[str, float] = {}

    def run(self) -> dict[str, float]:
        """Samples of every prompt, eval.num_prompts_per_step prompts per generation call (each call its own
        seed: eval.seed + its index); temperature 0 decodes greedily. Returns the metrics."""
        e, p = self.cfg.eval, self.cfg.policy
        n, step = e.num_tests_per_prompt, e.num_prompts_per_step
        self.samples = []
        with tqdm(total=len(self.datums), desc="eval", unit="prompt", file=sys.stderr,
                  disable=not e.progress_bar) as bar:
            for b, start in enumerate(range(0, len(self.datums), step)):
                batch = self.datums[start:start + step]
                self.samples += rollout.run_rollouts(
                    [d for d in batch for _ in range(n)], self.engine, self.tokenizer, self.envs,
                    max_new_tokens=p.generation.max_new_tokens, max_turns=e.max_rollout_turns,
                    max_seq_len=p.max_total_sequence_length, seed=e.seed + b, greedy=p.generation.temperature == 0)
                bar.update(len(batch))
        self.metrics = sample_metrics(self.samples, n, e.k_value)
        return self.metrics

    def summary(self) -> dict[str, Any]:
        """What summary.json holds: the headline score, every metric, and the settings that produced them."""
        e, g, d = self.cfg.eval, self.cfg.policy.generation, self.cfg.data
        key = headline_key(e.metric, e.k_value)
        return {"metric": key, "score": self.metrics[key], "metrics": self.metrics,
                "model_name": self.cfg.policy.model_name, "model_path": self.model_path,
                "dataset_name": d.dataset_name, "data_path": d.data_path, "env_name": d.env_name,
                "num_tests_per_prompt": e.num_tests_per_prompt, "k_value": e.k_value, "seed": e.seed,
                "generation": {"backend": g.backend, "max_new_tokens": g.max_new_tokens,
                               "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k}}

    def write(self) -> tuple[str, str]:
        """<eval.save_path>/samples.jsonl (one line per sample) and summary.json; returns their paths."""
        n, root = self.cfg.eval.num_tests_per_prompt, self.cfg.eval.save_path
        os.makedirs(root, exist_ok=True)
        samples_path, summary_path = os.path.join(root, SAMPLES_FILE), os.path.join(root, SUMMARY_FILE)
        with open(samples_path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(sample_record(s, i // n, i % n), ensure_ascii=False) + "\n"
                         for i, s in enumerate(self.samples))
        with open(summary_path, "w", encoding="utf-8") as f:
            json.dump(self.summary(), f, indent=2)
        return samples_path, summary_path

    def table(self) -> str:
        """The console summary: settings, one row per metric, the headline marked."""
        e, g = self.cfg.eval, self.cfg.policy.generation
        head = headline_key(e.metric, e.k_value)
        data = self.cfg.data.data_path or self.cfg.data.dataset_name
        settings = (f"model {self.cfg.policy.model_name} | data {data} ({self.cfg.data.env_name}) | {g.backend} "
                    f"engine, temperature {g.temperature}, top_p {g.top_p}, max_new_tokens {g.max_new_tokens}, "
                    f"seed {e.seed}")
        lines = [settings, f"{'metric':<22}{'value':>10}"]
        for name in dict.fromkeys(k.format(k=e.k_value) for k in SHOWN):  # pass@1 once when k = 1
            value = self.metrics[name]
            shown = f"{value:10.0f}" if name.startswith("num_") else f"{value:10.4f}"
            lines.append(f"{name:<22}{shown}" + ("   <- eval.metric" if name == head else ""))
        return "\n".join(lines)

    def close(self) -> None:
        """Shut down the environments and the engine."""
        for env in self.envs.values():
            ray.get(env.shutdown.remote())
        self.engine.shutdown()
