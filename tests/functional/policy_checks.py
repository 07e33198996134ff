"""Checks shared by the policy back-end tests: a tiny batch, a loss, single-process HF references.

Every back end is compared with a single-process Hugging Face model computed here with plain transformers.
"""

import sys
from typing import Optional

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
from weight_io import export_weights

from nemo_grpo.algorithms.losses import make_loss
from nemo_grpo.backends import varlen
from nemo_grpo.backends.registry import backend_spec
from nemo_grpo.batch import StepBatch
from nemo_grpo.config import ClusterConfig, LossConfig, PolicyConfig
from nemo_grpo.policy import Policy

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test loss travels to the actors by value

TEMPERATURE = 0.7
CLUSTER = ClusterConfig(gpus_per_node=2, num_nodes=1, num_threads_per_worker=1)
# sequence packing at the tiny batches' scale (make_batch(..., t=12)): bins of 20 real tokens in training, 40 in
# log-prob passes, rows rounded up to a multiple of 4
PACKING = {"sequence_packing.enabled": True, "sequence_packing.train_mb_tokens": 20,
           "sequence_packing.logprob_mb_tokens": 40, "sequence_packing.sequence_length_round": 4}


# ---------------------------------------------------------------------------------------------- helpers
class TokenPGLoss:
    """-(logprobs * advantages * mask).sum() / global_valid_toks: an additive contribution per the contract.
    Metrics also check that the micro-batch carries extra keys ("extra" [b], "text" list) sliced along dim 0."""

    def __call__(self, logprobs, mb, global_valid_seqs, global_valid_toks):
        mask = mb["token_mask"] * mb["sample_mask"][:, None]  # [b, T]
        loss = -(logprobs * mb["advantages"] * mask).sum() / global_valid_toks
        return loss, {"pg_loss": loss.detach(), "seq_fraction": mb["sample_mask"].sum() / global_valid_seqs,
                      "extra_sum": mb["extra"].sum(), "num_texts": float(len(mb["text"]))}


def make_batch(n: int, seed: int, t: int = 12, vocab: int = 50) -> dict:
    """Right-padded rows of mixed lengths (one full, one of 3 tokens), prompt of 2-3 tokens, one masked sample."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, t + 1, (n,), generator=g)
    lengths[0], lengths[min(1, n - 1)] = t, 3
    pos = torch.arange(t)[None, :]
    real = pos < lengths[:, None]
    prompt = torch.randint(2, 4, (n, 1), generator=g)
    token_mask = (real & (pos >= prompt)).float()  # [n, t]
    sample_mask = torch.ones(n)
    sample_mask[n // 2] = 0.0
    return {"input_ids": torch.randint(3, vocab, (n, t), generator=g) * real, "input_lengths": lengths,
            "token_mask": token_mask, "sample_mask": sample_mask,
            "advantages": torch.randn(n, t, generator=g) * token_mask,
            "prev_logprobs": torch.zeros(n, t), "generation_logprobs": torch.zeros(n, t),
            "extra": torch.arange(n, dtype=torch.float32), "text": [f"row{i}" for i in range(n)]}


def hf_logprobs(model, batch: dict) -> torch.Tensor:
    """Single-process reference: [B, T] log p(x_t | x_<t) at temperature TEMPERATURE, 0 at column 0 / padding."""
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    logits = model(input_ids=ids, attention_mask=mask).logits.float() / TEMPERATURE
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]
    return torch.cat([torch.zeros(ids.shape[0], 1), lp], dim=1)


def load_hf(path: str, state: dict = None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    return model


def reference_train(path: str, state: dict, batch: dict, cfg: PolicyConfig):
    """Plain HF + torch AdamW + torch clip_grad_norm_ over the whole global batch; (state, losses, norms, lrs)."""
    return train_reference_model(load_hf(path, state), batch, cfg)


def hf_router_terms(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A Mixture-of-Experts HF model's router terms on `batch`, one row per micro-batch (the tests'
    train_micro_batch_size 1), from its output_router_logits: (aux, z, imbalance). aux: the rows' HF
    load_balancing_loss_func (with the row's attention mask) weighted by the row's share of the real tokens; z:
    the same weighting of, per layer, the mean over the row's real tokens of logsumexp(logits)^2, summed over
    layers; imbalance: top-k assignments per expert over all real tokens, max / mean per layer, the worst."""
    ids, lengths = batch["input_ids"], batch["input_lengths"].clamp(min=1)
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()  # [B, T]
    experts, k = model.config.num_experts, model.config.num_experts_per_tok
    logits = [x.view(*ids.shape, experts) for x in model(input_ids=ids, attention_mask=mask,
                                                         output_router_logits=True).router_logits]  # [B, T, E]
    share = mask.sum(1).float() / mask.sum()  # [B]
    aux = sum(share[r] * load_balancing_loss_func(tuple(x[r] for x in logits), experts, k, mask[r:r + 1])
              for r in range(ids.shape[0]))
    z = sum(share[r] * sum(torch.logsumexp(x[r][mask[r].bool()], -1).square().mean() for x in logits)
            for r in range(ids.shape[0]))
    counts = [torch.bincount(torch.topk(x[mask.bool()], k).indices.flatten(), minlength=experts).float()
              for x in logits]
    return aux, z, max(float(c.max() / c.mean()) for c in counts)


def check_routes_match_hf(policy: Policy, path: str, batch: dict) -> torch.Tensor:
    """get_logprobs(return_routes=True): the log-probs as without routes, and at every real position the top-k
    experts of HF's router logits in each layer (as sets), -1 on padding; returns the routes [B, T, L, k]."""
    logprobs, routes = policy.get_logprobs(batch, return_routes=True)
    assert torch.equal(logprobs, policy.get_logprobs(batch))
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    model = load_hf(path).eval()
    with torch.no_grad():
        logits = model(input_ids=ids, output_router_logits=True).router_logits  # per layer [B * T, E]
    hf = torch.stack([torch.topk(x.view(*ids.shape, -1), model.config.num_experts_per_tok).indices
                      for x in logits], dim=2)  # [B, T, L, k]
    real = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    assert routes.dtype == torch.int16 and routes.shape == hf.shape
    assert torch.equal(routes.long().sort(-1).values[real], hf.sort(-1).values[real])
    assert bool((routes[~real] == -1).all())
    return routes


def _router_coefficients(cfg: PolicyConfig) -> tuple[float, float]:
    r = backend_spec(cfg.backend).cfg(cfg)
    return (r.moe_aux_loss_coeff if r.moe_router_load_balancing_type == "aux_loss" else 0.0), r.moe_z_loss_coeff or 0.0


def train_reference_model(model, batch: dict, cfg: PolicyConfig):
    """reference_train on a given single-process model (its trainable parameters): (state, losses, norms, lrs).
    A Mixture-of-Experts config's router losses join the loss (hf_router_terms x their coefficients)."""
    aux_coeff, z_coeff = _router_coefficients(cfg)
    assert cfg.train_micro_batch_size == 1 or not (aux_coeff or z_coeff)  # hf_router_terms: a row per micro-batch
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optimizer
    opt = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    warm = o.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    gbs, n = cfg.train_global_batch_size, batch["input_ids"].shape[0]
    losses, norms, lrs = [], [], []
    for s in range(0, n, gbs):
        gb = {k: v[s:s + gbs] for k, v in batch.items()}
        mask = gb["token_mask"] * gb["sample_mask"][:, None]
        opt.zero_grad()
        loss = -(hf_logprobs(model, gb) * gb["advantages"] * mask).sum() / mask.sum()
        if aux_coeff or z_coeff:
            aux, z, _ = hf_router_terms(model, gb)
            (loss + aux_coeff * aux + z_coeff * z).backward()
        else:
            loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)))
        losses.append(float(loss.detach()))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return model.state_dict(), losses, norms, lrs


def export_state(policy: Policy) -> dict:
    return {k: v for bucket in export_weights(policy, 64.0) for k, v in bucket.items()}


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_logprobs_match_hf(policy: Policy, path: str, batch: dict) -> torch.Tensor:
    """The policy's log-probs [B, T] equal the single-process HF model's within 1e-5; returns them."""
    with torch.no_grad():
        ref = hf_logprobs(load_hf(path).eval(), batch)
    lp = policy.get_logprobs(batch)
    assert lp.shape == ref.shape
    assert (lp - ref).abs().max().item() <= 1e-5
    return lp


def assert_scores_match_hf(policy: Policy, path: str, batch: dict) -> torch.Tensor:
    """The reward model's scores [B] equal Hugging Face's sequence classifier's (pooled at the last real token;
    no real token of `batch` may be the pad id) within 1e-5; returns them."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    mask = (torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]).long()
    with torch.no_grad():
        ref = model(input_ids=batch["input_ids"], attention_mask=mask).logits[:, 0]  # [B]
    scores = policy.score(batch)
    assert scores.shape == ref.shape
    assert (scores - ref).abs().max().item() <= 1e-5
    return scores


def policy_config(path: str, backend: str = "dtensor", **overrides) -> PolicyConfig:
    """A small-batch, large-lr config (clipping active) with dotted overrides, e.g. {"dtensor_cfg.x": 2}."""
    cfg = PolicyConfig(model_name=path, backend=backend, precision="float32", train_global_batch_size=4,
                       train_micro_batch_size=1, logprob_batch_size=2, max_grad_norm=0.05)
    cfg.optimizer.lr, cfg.optimizer.warmup_steps = 1e-2, 2
    cfg.generation.temperature = TEMPERATURE
    for key, value in overrides.items():
        obj, _, field = key.rpartition(".")
        setattr(cfg if not obj else getattr(cfg, obj), field, value)
    return cfg


def check_train_parity(policy: Policy, path: str, batch: dict) -> dict:
    """One train call (several global batches) vs reference_train from the policy's current weights; a
    Mixture-of-Experts policy's router metrics vs HF's too where its micro-batches are rows (hf_router_terms
    takes a row per micro-batch: not under packing or dynamic batching)."""
    start = export_state(policy)
    metrics = policy.train(batch, TokenPGLoss())
    ref_state, losses, norms, lrs = reference_train(path, start, batch, policy.cfg)
    got = export_state(policy)
    assert max_diff(got, start) > 1e-3  # the step moved the weights
    assert max_diff(got, ref_state) <= 1e-4
    assert_step_metrics(metrics, losses, norms, lrs, batch, policy.cfg)
    if "moe/aux_loss" in metrics and not (policy.cfg.sequence_packing.enabled or policy.cfg.dynamic_batching.enabled):
        assert_router_metrics(metrics, load_hf(path, start), batch, policy.cfg)
    return metrics


def check_on_policy_step(policy: Policy, reset, batch: dict, tol: float = 1e-5) -> None:
    """One GRPO step of `batch` (one global batch, the clipped loss with the importance-sampling correction, so
    the loss reads the old log-probs) twice from the same start (`reset(policy)` restores it): today's, with the
    separate get_logprobs pass, and the exactly on-policy one (train(..., on_policy=True): the training
    forward's log-probs are the old ones). Loss, pre-clip gradient norm and every metric agree within rel 1e-5,
    the updated weights within `tol`, the old log-probs the workers kept with the pass's within 1e-5, and the
    on-policy step ran no log-prob pass."""
    g = torch.Generator().manual_seed(3)
    gen = -(2.0 + 3.0 * torch.rand(batch["input_ids"].shape, generator=g)) * batch["token_mask"]  # [B, T]
    step = StepBatch(batch["input_ids"], batch["input_lengths"], batch["token_mask"], batch["sample_mask"],
                     generation_logprobs=gen)
    loss_fn = make_loss("clipped_pg", LossConfig(use_importance_sampling_correction=True))
    start = export_state(policy)
    with policy.shipped(step) as rows:
        prev = policy.get_logprobs(rows, keep="prev_logprobs")
        want = policy.train(rows, loss_fn, columns={"advantages": batch["advantages"]})
    want_state = export_state(policy)
    reset(policy)
    passes = policy.logprob_passes
    with policy.shipped(step) as rows:
        got = policy.train(rows, loss_fn, columns={"advantages": batch["advantages"]}, on_policy=True)
        kept = policy.kept(rows, "prev_logprobs")
    assert policy.logprob_passes == passes  # no separate pass
    assert max_diff(want_state, start) > 1e-3  # the step moved the weights
    assert max_diff(export_state(policy), want_state) <= tol
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert ((kept - prev) * step.loss_mask).abs().max().item() <= 1e-5


def assert_router_metrics(metrics: dict, model, batch: dict, cfg: PolicyConfig) -> None:
    """A Mixture-of-Experts policy's one-step router metrics are hf_router_terms' of the start weights: the
    aux loss (and z-loss) within 1e-5, the load imbalance (a count) to float rounding."""
    assert batch["input_ids"].shape[0] == cfg.train_global_batch_size  # one step: its metrics are the start's
    with torch.no_grad():
        aux, z, imbalance = hf_router_terms(model, batch)
    assert abs(metrics["moe/aux_loss"] - float(aux)) <= 1e-5, (metrics["moe/aux_loss"], float(aux))
    assert ("moe/z_loss" in metrics) == bool(backend_spec(cfg.backend).cfg(cfg).moe_z_loss_coeff)
    assert abs(metrics.get("moe/z_loss", float(z)) - float(z)) <= 1e-5
    assert metrics["moe/load_imbalance"] == pytest.approx(imbalance, rel=1e-6)


def assert_step_metrics(metrics: dict, losses: list, norms: list, lrs: list, batch: dict, cfg: PolicyConfig) -> None:
    """A train call's metrics are the means over its steps of the reference's loss, pre-clip norm and lr."""
    steps = len(losses)
    assert min(norms) > cfg.max_grad_norm  # clipping was active
    assert metrics["grad_norm"] == pytest.approx(sum(norms) / steps, rel=1e-4)
    assert metrics["pg_loss"] == pytest.approx(sum(losses) / steps, rel=1e-4, abs=1e-6)
    assert metrics["lr"] == pytest.approx(sum(lrs) / steps)
    assert metrics["seq_fraction"] == pytest.approx(1.0)
    assert metrics["extra_sum"] == pytest.approx(float(batch["extra"].sum()) / steps)
    assert metrics["num_texts"] == pytest.approx(len(batch["text"]) / steps)


def check_checkpoint_resumes(policy: Policy, open_other, batch: dict, ckpt: str, state=None) -> None:
    """policy saves `ckpt` and trains a step; the policy `open_other()` makes (another layout) loads the checkpoint:
    the same `state(policy)` (default: the HF export) exactly, the same log-probs, and its next step lands where
    the saving policy's did (Adam moments and the warm-up schedule came back too)."""
    state = state or export_state
    policy.save_checkpoint(ckpt)
    saved_lp, saved = policy.get_logprobs(batch), state(policy)
    policy.train(batch, TokenPGLoss())
    after_lp = policy.get_logprobs(batch)
    with open_other() as other:
        other.load_checkpoint(ckpt)
        assert max_diff(state(other), saved) == 0.0
        assert (other.get_logprobs(batch) - saved_lp).abs().max().item() <= 1e-5
        other.train(batch, TokenPGLoss())
        assert (other.get_logprobs(batch) - after_lp).abs().max().item() <= 1e-5


def check_bf16_step(policy: Policy, path: str, batch: dict) -> None:
    """A bf16 policy (fp32 master weights): bf16 compute is really on and close to fp32 before and after a step."""
    start = export_state(policy)
    with torch.no_grad():
        ref_before = hf_logprobs(load_hf(path).eval(), batch)
    err_before = (policy.get_logprobs(batch) - ref_before).abs().max().item()
    metrics = policy.train(batch, TokenPGLoss())
    got = export_state(policy)
    ref_state, _, norms, _ = reference_train(path, start, batch, policy.cfg)
    with torch.no_grad():
        ref_after = hf_logprobs(load_hf(path, ref_state).eval(), batch)
    lp_after = policy.get_logprobs(batch)
    assert 1e-5 < err_before < 0.03, err_before  # bf16 compute is really on, and close (DTensor: 3.6e-3)
    assert all(v.dtype == torch.float32 for v in got.values())  # fp32 master weights
    assert max_diff(got, start) > 1e-3
    assert metrics["grad_norm"] == pytest.approx(norms[0], rel=0.05)
    assert (lp_after - ref_after).abs().max().item() < 0.1  # DTensor: 1.9e-2 after one step at lr 1e-2


def segment_attention_calls(policy: Policy) -> list[int]:
    """Per rank: the calls of backends/varlen.py's packed attention (any kernel) in its worker process so far."""
    return [sum(calls.values()) for calls in packed_attention_kernels(policy)]


def packed_attention_kernels(policy: Policy) -> list[dict]:
    """Per rank: backends/varlen.py's calls per kernel in its worker process so far."""
    return policy.group.run_all("__ray_call__", lambda worker: dict(varlen.CALLS))


def _set_packed_attention(policy: Policy, attention: str) -> None:
    def set_on(worker):
        worker.cfg.sequence_packing.attention = attention
    policy.group.run_all("__ray_call__", set_on)


def logprobs_and_one_train_call(policy: Policy, batch: dict) -> tuple[torch.Tensor, dict, list[int]]:
    """(log-probs [B, T], the exported weights after one train call, per rank the packed-attention calls made)."""
    calls = segment_attention_calls(policy)
    lp = policy.get_logprobs(batch)
    policy.train(batch, TokenPGLoss())
    ran = [after - before for after, before in zip(segment_attention_calls(policy), calls)]
    return lp, export_state(policy), ran


def check_varlen_equals_dense_mask(policy: Policy, batch: dict, ckpt: str, tol: float = 1e-5,
                                   varlen: Optional[tuple] = None) -> None:
    """Packed rows attended per segment (the policy's default) give the dense block-diagonal mask's log-probs and
    one train call's weights within `tol`, from the same start (checkpoint `ckpt`); the per-segment path ran on
    every rank in the first and on none in the second. `varlen`: logprobs_and_one_train_call's result already
    taken from `ckpt`'s state on per-segment attention (it is not run again). Leaves the policy on varlen
    attention, trained once from `ckpt`."""
    out = {} if varlen is None else {"varlen": varlen}
    if varlen is None:
        policy.save_checkpoint(ckpt)
    for attention in [a for a in ("mask", "varlen") if a not in out]:
        _set_packed_attention(policy, attention)
        policy.load_checkpoint(ckpt)
        out[attention] = logprobs_and_one_train_call(policy, batch)
    _set_packed_attention(policy, "varlen")
    assert all(n > 0 for n in out["varlen"][2]) and not any(out["mask"][2]), {a: o[2] for a, o in out.items()}
    lp_diff, weight_diff = (out["varlen"][0] - out["mask"][0]).abs().max().item(), max_diff(out["varlen"][1],
                                                                                            out["mask"][1])
    print(f"per-segment vs dense mask: log-probs {lp_diff:.2e}, weights after one step {weight_diff:.2e}")
    assert lp_diff <= tol and weight_diff <= tol
