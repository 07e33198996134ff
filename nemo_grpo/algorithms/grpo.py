"""The GRPO loop: rollouts -> rewards -> group advantages -> old/reference log-probs -> train -> refit.

`nemo_grpo.build.build_trainer(cfg)` builds every component (Ray actors included); `run()` trains to
grpo.max_num_steps (or until the prompts have been seen grpo.max_num_epochs times), validating every val_period
steps and checkpointing every save_period steps; a run started with checkpoints in checkpointing.checkpoint_dir
continues from the newest exactly (prompt order, sampling seeds, weights, optimizer and RNG state). `summary()`
is the one line a finished run ends with.

While `run()` runs, SIGUSR1 (utils/stop_signal.py: Slurm's warning before a time limit) ends it at the next step
boundary with a checkpoint of that step, and on a multi-node Ray cluster a lost node ends the process
(distributed/node_watch.py, exit 3) instead of leaving it to hang in the surviving ranks' collectives.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import ray
import torch
from ray.exceptions import RayActorError

from nemo_grpo.algorithms.advantages import dynamic_sampling_keep, estimate_advantages, scale_rewards, shape_rewards
from nemo_grpo.algorithms.async_rollouts import GenerationFailed, RolloutCollector, Rollouts
from nemo_grpo.algorithms.kl import generation_mismatch_metrics, sequence_kl
from nemo_grpo.algorithms.losses import make_loss
from nemo_grpo.algorithms.metrics import sample_metrics
from nemo_grpo.algorithms.on_policy import off_policy_reason
from nemo_grpo.algorithms.rollout import Sample, collate, prompt_text, response_text, run_rollouts
from nemo_grpo.backends.registry import backend_spec
from nemo_grpo.batch import StepBatch
from nemo_grpo.config import MasterConfig, to_yaml
from nemo_grpo.distributed.node_watch import start_node_watch
from nemo_grpo.distributed.resource_plan import release
from nemo_grpo.models import lora
from nemo_grpo.utils.checkpoint import POLICY_DIR
from nemo_grpo.utils.stop_signal import StopSignal
from nemo_grpo.utils.timer import Timer
from nemo_grpo.weights.refit import make_refitter

log = logging.getLogger(__name__)

def env_metric_views(samples: list[Sample], num_generations_per_prompt: int) -> dict[str, dict[str, Any]]:
    """task name -> what that task's environment computes its metrics on (EnvironmentInterface): its own samples
    only, in order (whole groups: the G samples of a prompt share its task), with their raw rewards."""
    by_task: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_task[s.datum.task_name].append(s)
    return {task: {"rewards": torch.tensor([s.reward for s in rows]), "text": [s.text for s in rows],
                   "response_lengths": torch.tensor([s.response_length for s in rows]),
                   "prompt_lengths": torch.tensor([len(s.datum.prompt_ids) for s in rows]),
                   "truncated": torch.tensor([s.truncated for s in rows]),
                   "num_generations_per_prompt": num_generations_per_prompt}
            for task, rows in by_task.items()}


def format_samples(samples: list[Sample], n: int) -> str:
    """The first n samples as text for a person: prompt, response (every turn after the prompt) and reward."""
    blocks = []
    for i, s in enumerate(samples[:n]):
        blocks.append(f"sample {i + 1} | reward {s.reward:.3f}\n  prompt:   {prompt_text(s)!r}\n"
                      f"  response: {response_text(s)!r}")
    return "\n".join(blocks)


def _short(path: str) -> str:
    """`path` relative to the working directory when it lies under it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


@dataclass
class RunActors:
    """A GRPO run's Ray actors: the policy, the generation engine, the environments by task name, and the
    placement groups they run in (the resource plan's). The trainer closes them when it closes."""
    policy: Any
    engine: Any
    envs: dict[str, Any]
    placement_groups: dict = field(default_factory=dict)

    def close(self) -> None:
        """Shut down the environments, the engine and the policy; free the placement groups."""
        for env in {id(e): e for e in self.envs.values()}.values():
            ray.get(env.shutdown.remote())
        for actor in (self.engine, self.policy):
            if actor is not None:  # None: a start that failed before it
                actor.shutdown()
        release(self.placement_groups)


@dataclass
class GRPOState:
    step: int = 0  # optimizer rounds completed
    consumed_prompts: int = 0
    loader: dict = field(default_factory=lambda: {"epoch": 0, "position": 0})
    val_metrics: dict = field(default_factory=dict)


class GRPOTrainer:
    def __init__(self, cfg: MasterConfig, *, tokenizer, actors: RunActors, loader, val_datums, logger, checkpointer):
        self.cfg, self.tokenizer, self.actors = cfg, tokenizer, actors
        self.policy, self.engine, self.task_to_env = actors.policy, actors.engine, actors.envs
        self.loader, self.val_datums = loader, val_datums
        self.logger, self.checkpointer = logger, checkpointer
        self.loss_fn = make_loss(cfg.loss_fn.name, cfg.loss_fn, cfg.policy.max_total_sequence_length)
        self.refitter = make_refitter(self.policy, self.engine, cfg.policy.generation)
        # the training forward's log-probs are the old ones: no separate pass (algorithms/on_policy.py)
        reason = off_policy_reason(cfg, backend_spec(cfg.policy.backend).router_replay(cfg.policy))
        self.on_policy = reason is None
        log.info("old log-probs: %s", "the training forward's (exactly on-policy steps)" if self.on_policy
                 else f"a separate pass ({reason})")
        self.state = GRPOState()
        self.timer = Timer()
        self.collector: Optional[RolloutCollector] = None  # async GRPO's, while run() runs
        self.history: list[dict[str, float]] = []  # per-step metrics of this process's steps
        self.val_history: list[tuple[int, float]] = []  # (step, val accuracy) of this process's validations
        self.resumed_at: Optional[int] = None  # the step a resumed run started from
        self.last_checkpoint: Optional[str] = None  # the newest checkpoint written (or resumed from)
        self.checkpoint_step: Optional[int] = None  # the step of last_checkpoint
        self.stopped_on: Optional[str] = None  # the stop signal's name ("SIGUSR1") when one ended run() early
        self.plot_path: Optional[str] = None  # the reward plot, once close() drew it

    # ------------------------------------------------------------------------------------------ rollouts
    def _rollout(self, datums, seed: int, greedy: bool = False, timer: Optional[Timer] = None) -> list[Sample]:
        """Callers run it inside `_generation_phase` (once around all the rollouts of a step or a validation);
        `timer` gets the generation and environment sections."""
        c = self.cfg
        return run_rollouts(datums, self.engine, self.tokenizer, self.task_to_env,
                            max_new_tokens=c.policy.generation.max_new_tokens, max_turns=c.grpo.max_rollout_turns,
                            max_seq_len=c.policy.max_total_sequence_length, seed=seed, greedy=greedy, timer=timer)

    @contextlib.contextmanager
    def _generation_phase(self):
        """Colocated generation shares the policy's devices: the policy moves off them (GPU: model and
        optimizer to host memory) and the engine wakes up for the rollouts; after, the engine sleeps (GPU:
        vLLM sleep level 1) and the policy comes back. No-ops on a CPU."""
        colocated = self.cfg.policy.generation.colocated.enabled
        if colocated:
            self.policy.offload()
            self.engine.prepare_for_generation()
        try:
            yield
        finally:
            if colocated:
                self.engine.finish_generation()
                self.policy.onload()

    def _scaled_rewards(self, samples: list[Sample]) -> torch.Tensor:
        """Rewards [N] scaled (grpo.reward_scaling), not yet shaped: what dynamic sampling filters on."""
        return scale_rewards(torch.tensor([s.reward for s in samples]), self.cfg.grpo.reward_scaling)

    def _rewards(self, samples: list[Sample], scaled: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The samples' scaled rewards [N] (grpo.reward_scaling) shaped (grpo.reward_shaping), and the scaled
        reward components {name: [N]} when the environment returns several."""
        g, gen = self.cfg.grpo, self.cfg.policy.generation
        rewards = shape_rewards(scaled, torch.tensor([s.response_length for s in samples]),
                                torch.tensor([s.truncated for s in samples]), g.reward_shaping,
                                max_response_length=gen.max_new_tokens * g.max_rollout_turns)
        names = sorted({k for s in samples for k in s.reward_components})
        components = {k: scale_rewards(torch.tensor([s.reward_components.get(k, 0.0) for s in samples]),
                                       g.reward_scaling) for k in names}
        return rewards, components

    def collect(self, step: int, timer: Optional[Timer] = None) -> Rollouts:
        """Samples, rewards [N] and reward components for one step; with dynamic sampling, only groups whose
        rewards differ before shaping (as DAPO and NeMo RL: a group of equally wrong answers of different
        lengths is dropped, though the overlong penalty tells them apart; shaping still reaches the advantages),
        drawn over up to dynamic_sampling_max_gen_batches generation batches. Touches no
        trainer state but the prompt loader (the async collector runs it in its own thread)."""
        g = self.cfg.grpo
        timer = timer or Timer()
        G, wanted = g.num_generations_per_prompt, g.num_prompts_per_step
        kept: list[Sample] = []
        kept_scaled: list[torch.Tensor] = []  # their rewards scaled (grpo.reward_scaling): once a sample
        raw_rewards, batches, drawn = [], 0, 0
        while len(kept) < wanted * G:
            if batches == (g.dynamic_sampling_max_gen_batches if g.use_dynamic_sampling else 1):
                raise RuntimeError(
                    f"dynamic sampling found {len(kept) // G} of {wanted} prompts with differing rewards after "
                    f"{batches} generation batches: raise grpo.dynamic_sampling_max_gen_batches or "
                    f"grpo.batch_multiplier")
            n_prompts = int(wanted * g.batch_multiplier) if g.use_dynamic_sampling else wanted
            prompts = self.loader.next_batch(n_prompts)
            drawn += len(prompts)
            samples = self._rollout([d for d in prompts for _ in range(G)], seed=self._seed(step, batches),
                                    timer=timer)
            raw_rewards += [s.reward for s in samples]
            scaled = self._scaled_rewards(samples)  # [n]
            if g.use_dynamic_sampling:  # on the scaled rewards, before shaping
                rows = dynamic_sampling_keep(scaled, G).repeat_interleave(G).nonzero()[:, 0]
                samples, scaled = [samples[i] for i in rows.tolist()], scaled[rows]
            room = wanted * G - len(kept)
            kept, kept_scaled = kept + samples[:room], kept_scaled + [scaled[:room]]
            batches += 1
        rewards, components = self._rewards(kept, torch.cat(kept_scaled))
        stats = {"reward": sum(raw_rewards) / len(raw_rewards), "gen_batches": float(batches),
                 "fraction_groups_kept": len(kept) / len(raw_rewards)}
        return Rollouts(kept, rewards, components, stats, loader_state=self.loader.state_dict(), prompts_drawn=drawn,
                        timings=timer.get_timing_metrics(), env_metrics=self._request_env_metrics(kept))

    def _seed(self, step: int, batch: int) -> int:
        return (self.cfg.grpo.seed * 1_000_003 + step * 101 + batch) % (2**31)

    # ------------------------------------------------------------------------------------------ one step
    def _train_batch(self, samples: list[Sample]) -> tuple[StepBatch, dict[str, Any]]:
        """The step's StepBatch (sample_mask 0 on truncated samples under grpo.overlong_filtering), and the
        collated batch it was made of (its response lengths and truncation flags, for the metrics)."""
        batch = collate(samples, self.tokenizer.pad_token_id or 0)
        truncated = batch["truncated"].float()
        sample_mask = 1.0 - truncated if self.cfg.grpo.overlong_filtering else torch.ones(len(samples))
        step = StepBatch(batch["input_ids"], batch["input_lengths"], batch["token_mask"], sample_mask,
                         generation_logprobs=batch["generation_logprobs"],
                         routed_experts=batch.get("routed_experts"))
        return step, batch

    def _advantages(self, step: StepBatch, logprobs: dict[str, torch.Tensor], rewards: torch.Tensor,
                    components: dict) -> tuple[torch.Tensor, dict]:
        """Advantages [N] by grpo.adv_estimator (each sample's, for every one of its tokens); with
        loss_fn.use_kl_in_reward, each reward first loses beta x its sequence's KL(pi_old || pi_ref) estimate
        (logprobs: the step's "prev_logprobs" and "reference_policy_logprobs" [N, T]). Also the metrics of
        that."""
        c, metrics, mask = self.cfg, {}, step.loss_mask
        if c.loss_fn.use_kl_in_reward:
            kl = sequence_kl(logprobs["prev_logprobs"], logprobs["reference_policy_logprobs"], mask,
                             c.loss_fn.reference_policy_kl_type, c.loss_fn.kl_input_clamp_value)  # [N]
            rewards = rewards - c.loss_fn.reference_policy_kl_penalty * kl
            metrics["kl_in_reward"] = kl.mean().item()
        adv = estimate_advantages(rewards, c.grpo.num_generations_per_prompt, c.grpo, components or None,
                                  token_counts=mask.sum(-1))
        metrics["reward_after_scaling"] = rewards.mean().item()
        metrics["advantage_abs_mean"] = adv.abs().mean().item()
        return adv, metrics

    def train_step(self) -> dict[str, float]:
        cfg, step = self.cfg, self.state.step + 1
        self.timer.reset()
        with self.timer.time("total"):
            rollouts, async_metrics = self._next_rollouts(step)
            batch, collated = self._train_batch(rollouts.samples)
            passes = self.policy.logprob_passes
            with self.policy.shipped(batch) as rows:  # the step's rows on the workers, once for its calls
                with self.timer.time("logprobs"):
                    logprobs = self._old_and_reference_logprobs(rows)
                advantages, adv_metrics = self._advantages(batch, logprobs, rollouts.rewards, rollouts.components)
                with self.timer.time("training"):
                    train_metrics = self.policy.train(rows, self.loss_fn, columns={"advantages": advantages},
                                                      on_policy=self.on_policy)
                if self.on_policy:  # the training forward's, kept by the workers
                    logprobs["prev_logprobs"] = self.policy.kept(rows, "prev_logprobs")
                mismatch = generation_mismatch_metrics(logprobs["prev_logprobs"], batch.generation_logprobs,
                                                       batch.loss_mask)
            mismatch["logprob_passes"] = float(self.policy.logprob_passes - passes)
            with self.timer.time("refit"):
                refit = self._refit_engine(step)
            if self.collector is not None and cfg.grpo.async_grpo.in_flight_weight_updates:
                async_metrics["async/refits_mid_generation"] = float(self.engine.refits_mid_generation())
        metrics = {**train_metrics, "refit_gib_per_s": refit["bytes"] / max(refit["seconds"], 1e-9) / 2**30,
                   **mismatch, **rollouts.stats, **adv_metrics, **self._env_metrics(rollouts), **async_metrics,
                   "mean_response_length": collated["response_lengths"].float().mean().item(),
                   "fraction_truncated": collated["truncated"].float().mean().item()}
        self.state.step = step
        self.state.loader = rollouts.loader_state
        self.state.consumed_prompts += rollouts.prompts_drawn
        return metrics

    def _old_and_reference_logprobs(self, rows) -> dict[str, torch.Tensor]:
        """The shipped step's "prev_logprobs" [N, T] of the current weights (not when the step is exactly
        on-policy: train's forward gives them) and, with the KL penalty on, "reference_policy_logprobs" [N, T];
        the workers keep both in their shards for the loss. The training forward replays (the back end's routing
        replay mode) or, without replay, measures its routing against (backends/router.py's agreement metrics)
        the routes [N, T, L, k] this pass records (old_policy), else the engine's (the StepBatch's
        routed_experts, from an engine that records them)."""
        spec = backend_spec(self.cfg.policy.backend)
        replay = spec.router_replay(self.cfg.policy)
        if replay == "engine" and rows.step.routed_experts is None:
            raise RuntimeError(f"{spec.router_replay_key()}=engine: the generation engine returned no "
                               f"routes ({type(self.engine).__name__}); use the torch engine")
        out = {}
        if replay == "old_policy":  # never on-policy (algorithms/on_policy.py)
            out = {"prev_logprobs": self.policy.get_logprobs(rows, return_routes=True, keep="prev_logprobs")[0]}
        elif not self.on_policy:
            out = {"prev_logprobs": self.policy.get_logprobs(rows, keep="prev_logprobs")}
        if self.cfg.loss_fn.reference_policy_kl_penalty > 0:
            out["reference_policy_logprobs"] = self.policy.get_reference_logprobs(
                rows, keep="reference_policy_logprobs")
        return out

    def _next_rollouts(self, step: int) -> tuple[Rollouts, dict[str, float]]:
        """Step `step`'s rollouts: generated now (synchronous GRPO), or taken from the async collector, dropping
        any older than grpo.async_grpo.max_trajectory_age_steps; the async/ metrics with them."""
        if self.collector is None:
            with self._generation_phase():  # every generation batch of the step: one hand-over
                return self.collect(step, self.timer), {}
        dropped = 0
        while True:
            with self.timer.time("generation_wait"):
                rollouts = self.collector.next()
            age = step - 1 - rollouts.weight_version
            if age <= self.cfg.grpo.async_grpo.max_trajectory_age_steps:
                break
            dropped += 1
            log.warning("dropped the rollouts of weight version %d at step %d: %d steps old", rollouts.weight_version,
                        step, age)
        for name, seconds in rollouts.timings.items():  # generated while the policy trained
            self.timer.record(name, seconds)
        return rollouts, {"async/trajectory_age_mean": float(age), "async/trajectory_age_max": float(age),
                          "async/dropped_stale": float(dropped)}

    def _refit_engine(self, step: int) -> dict[str, float]:
        """Refit after step `step`; under async GRPO between two generation batches (with in-flight weight
        updates at once: the engine takes it between two forward steps), then the collector may run on. A dead
        engine is a GenerationFailed that says the run stops."""
        between_batches = self.collector is not None and not self.cfg.grpo.async_grpo.in_flight_weight_updates
        lock = self.collector.engine_lock if between_batches else contextlib.nullcontext()
        with lock:
            if self.collector is not None:
                self.collector.raise_if_failed()  # no refit into an engine that died generating
            try:
                stats = self.refit()
            except RayActorError as e:
                raise GenerationFailed(f"the refit after step {step} found the generation engine dead", e) from e
        if self.collector is not None:
            self.collector.weights_updated(step)
        return stats

    def _request_env_metrics(self, samples: list[Sample]) -> list:
        """Ask each task's environment for its metrics on its own samples (env_metric_views), right after the
        rollout that visited it; the answers (ObjectRefs) are read when the step's metrics are."""
        views = env_metric_views(samples, self.cfg.grpo.num_generations_per_prompt)
        return [self.task_to_env[task].global_post_process_and_metrics.remote(view) for task, view in views.items()]

    def _env_metrics(self, rollouts: Rollouts) -> dict[str, float]:
        """The environments' metrics on the step's samples, as requested by the rollout."""
        return {k: v for _, m in self._gather(rollouts.env_metrics) for k, v in m.items()}

    @staticmethod
    def _gather(refs: list) -> list:
        """The values of the environments' Ray object refs (the unit tests, without Ray, put identity here)."""
        return ray.get(refs)

    def refit(self) -> dict[str, float]:
        """Policy weights -> generation engine, in place, bucket by bucket (through host shared memory when
        colocated, else over a collective group): {"seconds", "bytes", "buckets"}. The refitter first gives a
        sleeping engine its weights' memory back."""
        return self.refitter.refit()

    # ------------------------------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Greedy decoding of up to grpo.max_val_samples validation prompts, scored by the metrics of
        `python -m nemo_grpo.eval` (algorithms/metrics.py): val/accuracy = mean reward, val/pass@1, ..."""
        g = self.cfg.grpo
        datums = self.val_datums[: g.max_val_samples]
        if not datums:  # grpo.max_val_samples=0
            return {}
        samples: list[Sample] = []
        with self._generation_phase():
            for start in range(0, len(datums), g.val_batch_size):
                samples += self._rollout(datums[start : start + g.val_batch_size], seed=g.seed, greedy=True)
        metrics = sample_metrics(samples, n=1)  # one greedy sample per prompt: accuracy, pass@1, cons@1, lengths
        self.state.val_metrics = metrics
        self.val_history.append((self.state.step, metrics["accuracy"]))
        self.logger.log_metrics(metrics, self.state.step, prefix="val")
        self._print_samples(samples)
        return metrics

    def _print_samples(self, samples: list[Sample]) -> None:
        """logger.num_val_samples_to_print generations as text: to the logger's log_text (which logs them to
        the console too), else to the console."""
        n = min(self.cfg.logger.num_val_samples_to_print, len(samples))
        if n == 0:
            return
        text = format_samples(samples, n)
        if hasattr(self.logger, "log_text"):
            self.logger.log_text("val/samples", text, self.state.step)
        else:
            log.info("validation samples at step %d:\n%s", self.state.step, text)

    # ------------------------------------------------------------------------------------------ checkpoints
    def save(self) -> str:
        info = {"step": self.state.step, "consumed_prompts": self.state.consumed_prompts,
                "loader": self.state.loader, "metrics": {f"val:{k}": v for k, v in self.state.val_metrics.items()}}
        tmp = self.checkpointer.init_tmp_checkpoint(self.state.step, info, to_yaml(self.cfg))
        self.policy.save_checkpoint(os.path.join(tmp, POLICY_DIR))
        self.last_checkpoint = self.checkpointer.finalize_checkpoint(tmp)
        self.checkpoint_step = self.state.step
        if self.collector is not None:
            log.info("checkpoint at step %d: rollouts in flight (%d step(s) done, and any under way) are not saved; "
                     "a run resumed from it draws their prompts again and generates them with its weights",
                     self.state.step,
                     self.collector.in_flight)
        return self.last_checkpoint

    def maybe_resume(self) -> Optional[str]:
        """Continue from the newest checkpoint when checkpointing.resume allows; returns its path."""
        ck = self.cfg.checkpointing
        path = self.checkpointer.get_latest_checkpoint_path() if ck.enabled and ck.resume else None
        if path is None:
            return None
        info = self.checkpointer.load_training_info(path)
        lora.check_resumable(self.checkpointer.load_config(path).get("policy", {}), self.cfg.policy.lora, path)
        self.policy.load_checkpoint(os.path.join(path, POLICY_DIR))
        self.state = GRPOState(step=info["step"], consumed_prompts=info["consumed_prompts"], loader=info["loader"],
                               val_metrics={k[len("val:"):]: v for k, v in info.get("metrics", {}).items()})
        self.loader.load_state_dict(info["loader"])
        self.refit()
        self.resumed_at, self.last_checkpoint, self.checkpoint_step = self.state.step, path, self.state.step
        log.info("resumed from %s at step %d", path, self.state.step)
        return path

    # ------------------------------------------------------------------------------------------ the loop
    def _epochs_done(self) -> bool:
        """The trained steps have passed over the training prompts grpo.max_num_epochs times (the loader itself
        may be ahead, by the rollouts in flight of async GRPO)."""
        return self.loader.epochs_done_at(self.state.loader) >= self.cfg.grpo.max_num_epochs

    def run(self) -> list[dict[str, float]]:
        """Train to grpo.max_num_steps (or max_num_epochs), or to the step boundary after a stop signal;
        returns this process's per-step metrics."""
        g = self.cfg.grpo
        watch = start_node_watch(self._progress)  # None on a single node
        try:
            with StopSignal() as stop:
                self._start()
                while self.state.step < g.max_num_steps and not self._epochs_done():
                    if stop.received is not None:
                        self._stop_on_signal(stop)
                        break
                    self._run_step()
        except BaseException:
            if watch is not None:  # an error from a lost node ends the process with the node's line, exit 3
                watch.settle()
            raise
        finally:
            if watch is not None:
                watch.stop()
            if self.collector is not None:
                self.collector.stop()
                self.collector = None
        if self.stopped_on is None and self.state.step < g.max_num_steps:
            log.info("stopped at step %d of %d: the training prompts were seen %d times (grpo.max_num_epochs)",
                     self.state.step, g.max_num_steps, self.loader.epochs_done_at(self.state.loader))
        return self.history

    def _start(self) -> None:
        """Resume, validate at step 0, start the progress display and (async GRPO) the rollout collector."""
        g = self.cfg.grpo
        self.maybe_resume()
        if g.val_at_start and self.state.step == 0 and self.val_datums:
            self.validate()
        self.logger.start_progress(g.max_num_steps, self.state.step)
        if g.async_grpo.enabled:
            self.collector = RolloutCollector(self.collect, self.state.step + 1, g.async_grpo.max_trajectory_age_steps,
                                              version=self.state.step, last_step=g.max_num_steps)
            self.collector.start()

    def _progress(self) -> tuple[int, Optional[str]]:
        """(the step under way, the newest complete checkpoint or None): what the node watch reports."""
        return self.state.step + 1, _short(self.last_checkpoint) if self.last_checkpoint else None

    def _stop_on_signal(self, stop: StopSignal) -> None:
        """At the step boundary after a stop signal: a checkpoint of the step (unless it has one already) and
        one log line; run() then returns."""
        step, ck = self.state.step, self.cfg.checkpointing
        self.stopped_on = stop.name
        head = f"received {stop.name} ({stop.meaning})"
        tail = f"stopping before step {step + 1} of {self.cfg.grpo.max_num_steps}"
        if not ck.enabled:
            log.warning("%s: no checkpoint could be saved (checkpointing.enabled=false); %s", head, tail)
        elif step == 0:
            log.info("%s: no step done, nothing to checkpoint; %s", head, tail)
        else:
            path = self.last_checkpoint if self.checkpoint_step == step else self.save()
            log.info("%s: checkpoint at step %d saved to %s; %s", head, step, _short(path), tail)

    def _run_step(self) -> None:
        """One step with its logging, validation and checkpoint."""
        cfg, g = self.cfg, self.cfg.grpo
        metrics = self.train_step()
        step = self.state.step
        timings = {k: v for k, v in self.timer.get_timing_metrics().items()}
        async_metrics = {k.split("/", 1)[1]: metrics.pop(k) for k in list(metrics) if k.startswith("async/")}
        self.logger.log_metrics(metrics, step, prefix="train")
        self.logger.log_metrics(timings, step, prefix="timing")
        if async_metrics:
            self.logger.log_metrics(async_metrics, step, prefix="async")
        self.history.append({**metrics, **{f"timing/{k}": v for k, v in timings.items()},
                             **{f"async/{k}": v for k, v in async_metrics.items()}})
        last = step == g.max_num_steps or self._epochs_done()
        if self.val_datums and ((g.val_period and step % g.val_period == 0) or (last and g.val_at_end)):
            with self.collector.engine_lock if self.collector else contextlib.nullcontext():
                self.validate()
        self.logger.update_progress(step, metrics["reward"], timings)
        if cfg.checkpointing.enabled and (step % cfg.checkpointing.save_period == 0 or last):
            self.save()

    def summary(self) -> str:
        """One line for the end of a run: steps, mean train reward at the first and last step run by this
        process, the best validation accuracy of this process and its step, the checkpoint and plot paths."""
        head = f"done: {self.state.step} steps"
        if self.resumed_at is not None:
            head += f" (resumed at step {self.resumed_at})"
        if self.stopped_on is not None:
            head += f" (stopped on {self.stopped_on} at step {self.state.step} of {self.cfg.grpo.max_num_steps})"
        parts = [head]
        if self.history:
            parts.append(f"reward {self.history[0]['reward']:.2f} -> {self.history[-1]['reward']:.2f}")
        if self.val_history:
            best = max(acc for _, acc in self.val_history)
            step = min(s for s, acc in self.val_history if acc == best)
            parts.append(f"best val:accuracy {best:.2f} at step {step}")
        parts.append(f"checkpoint {_short(self.last_checkpoint)}" if self.last_checkpoint else
                     "checkpoint none" + ("" if self.cfg.checkpointing.enabled else " (checkpointing.enabled=false)"))
        if self.plot_path:
            parts.append(f"plot {_short(self.plot_path)}")
        return " | ".join(parts)

    def close(self) -> None:
        """Close the logs (and draw the plot), the refit's transfer, then the run's actors (RunActors.close)."""
        self.logger.close()
        if self.cfg.logger.plot:
            self.plot_path = self.logger.save_plot()
        try:
            self.refitter.close()  # its shared region or transfer group, on the policy and the engine
        except RayActorError:  # an engine that died (GenerationFailed): shutting it down follows
            log.debug("the refit transfer could not be closed on a dead actor", exc_info=True)
        finally:
            self.actors.close()
