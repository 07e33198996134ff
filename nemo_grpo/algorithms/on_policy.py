"""When a GRPO step is exactly on-policy: its old log-probs are the training forward's own.

GRPO's loss reads "prev_logprobs", the log-probs of the weights the step starts from. `GRPOTrainer` gets them
from a separate forward pass of the current weights just before `Policy.train`; when the step makes one optimizer
step over the whole rollout batch, every micro-batch's training forward sees those same weights, so its
log-probs, detached, are the old ones and the pass can be skipped (TRL and verl do): ratio = exp(curr -
curr.detach()), 1 in value with the gradient of logp, the same numbers as the separate pass gives (up to the
float rounding of two forwards). `Policy.train(..., on_policy=True)` runs such a step.

The trajectories' age does not enter: the old log-probs are the trainer's current weights' in either path (async
GRPO included), and the engine's staleness is what the importance-sampling correction (prev vs generation) is for.
"""

from __future__ import annotations

from typing import Optional


def off_policy_reason(cfg, router_replay: str = "none") -> Optional[str]:
    """Why a GRPO step under `cfg` (MasterConfig) needs the separate old-log-prob pass, naming the key; None when
    the step is exactly on-policy and the training forward's log-probs serve as the old ones.
    router_replay: the back end's Mixture-of-Experts routing replay mode (BackendSpec.router_replay).

    Needs the pass: grpo.recompute_old_logprobs=true (asked for); more than one optimizer step per rollout batch
    (policy.train_global_batch_size below the step's num_prompts_per_step x num_generations_per_prompt samples,
    which dynamic sampling fills exactly: the second step's weights are no longer the old ones);
    loss_fn.use_kl_in_reward (the advantages need KL(old || reference) before training); routing replay
    old_policy (the training forward replays the routes that pass records, in eval mode); LoRA dropout (the
    training forward is not the eval forward, and today's ratio sees its noise)."""
    g, p = cfg.grpo, cfg.policy
    samples = g.num_prompts_per_step * g.num_generations_per_prompt
    if g.recompute_old_logprobs:
        return "grpo.recompute_old_logprobs=true"
    if p.train_global_batch_size != samples:
        return (f"policy.train_global_batch_size={p.train_global_batch_size} makes "
                f"{samples / p.train_global_batch_size:g} optimizer steps of the step's {samples} samples")
    if cfg.loss_fn.use_kl_in_reward:
        return "loss_fn.use_kl_in_reward=true needs the old log-probs before the advantages"
    if router_replay == "old_policy":
        return "routing replay old_policy replays the routes of the old log-prob pass"
    if p.lora.enabled and p.lora.dropout > 0:
        return f"policy.lora.dropout={p.lora.dropout}: the training forward differs from the old log-prob pass"
    return None
