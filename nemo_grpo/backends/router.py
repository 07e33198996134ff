"""The Mixture-of-Experts router's training losses and routing statistics, written once for both back ends.

A back end records each MoE layer's router logits during a training forward (`RouterLosses.recorder`: [N, E]
per layer in fp32, N = the micro-batch's positions row by row) and the worker adds the router terms to the
micro-batch's loss contribution (`RouterLosses.add`, with the positions' real-token mask [r, t]). Padding never
counts: the real tokens are the rows' first input_lengths positions (prompt and response alike).

- Load-balancing loss (`moe_router_load_balancing_type: aux_loss`): Hugging Face's definition, transformers'
  qwen3_moe `load_balancing_loss_func` with the attention mask, over one micro-batch's n real tokens and its L
  MoE layers: aux = E * sum_e f_e * P_e, with f_e = (top-k assignments to expert e, summed over the layers) /
  (L * n) and P_e = (softmax probability of e, summed over the tokens and layers) / (L * n).
  Megatron-Core 0.16.1's `switch_load_balancing_loss_func` is another number: each layer adds its own
  E / k * sum_e f_le * P_le, a sum over layers of per-layer products where HF takes the product of layer sums
  (cross-layer terms; HF's f sums to k, not 1), and it counts padding unless GPTModel's forward is given a
  padding_mask. They agree only for one layer, up to the factor k. Its backward does not fit our normalisation
  either: MoEAuxLossAutoScaler injects the gradient of aux * (the micro-batch's tokens) under
  calculate_per_token_loss (which the worker sets so the schedule passes our loss contributions undivided),
  expecting finalize_model_grads to divide every gradient by the global token count, which our loss functions
  do themselves (global counts passed in) and which the worker never calls: the aux gradient would come out
  N times too large. So HF's definition is the one here, on both back ends (tests compare with HF), added to the
  loss contribution in the worker; Megatron's own aux-loss machinery stays off (coefficient 0, type none).
- Router z-loss (`moe_z_loss_coeff`, ST-MoE; HF's Qwen3-MoE has none): Megatron's `z_loss_func`, the mean over
  the real tokens of logsumexp(logits)^2, summed over the layers.
- A step's value of either loss is the token-weighted mean over its micro-batches on all data-parallel ranks,
  sum_mb (n_mb / N) * loss_mb (N: the step's real tokens): an additive contribution like the policy loss, so
  the worker's sums make it, and its gradient is coeff times that value's. (HF over a whole global batch in one
  forward pools f and P over that batch: the same number when a micro-batch is the batch.)
- Expert load imbalance: per layer, the top-k assignments per expert over the step's real tokens (every
  micro-batch and data-parallel rank), max / mean; the worst layer. 1.0 is a perfect balance, E / k the worst.
Under context parallelism each rank sees a share of the positions: the counts stay exact, the losses are each
share's (the router-loss coefficients are refused there). Under sequence parallelism a TP rank's router sees a
share too: the Megatron back end all-gathers the logits and routes over the TP group, so they are exact.
- Pipeline parallelism: a stage holds some of the layers. The z-loss, the counts and the agreement are sums over
  layers, so each stage does its own. The load-balancing loss is not (a product of sums over all layers), but
  it is linear in the probabilities: aux = sum over stages of P_stage . g, g = E f / (L n)^2 from every
  stage's assignments f. Each stage sends its assignments [E] of a micro-batch to the others at the forward
  (StageExchange) and, at the backward, receives theirs and backpropagates P_stage . g through an identity on
  its output (RouterLosses.add_stage); the step's values are summed over the stages in step_metrics.
- Routing agreement, when a training micro-batch carries recorded routes (`routed_experts` [b, T, L, k]: the
  top-k experts each position went to in an earlier forward, e.g. the log-prob pass of the same weights):
  "moe/routing_agreement", the share of the recorded (position, layer) choices that the training forward routed
  to (1.0 under routing replay, which makes the forward route as recorded), and "moe/router_topk_agreement",
  the same share for the router's own top-k of its logits (what it would route to without replay). Over the
  real positions of the step's global batch that have recorded routes (an engine's lack the last sampled token):
  sum over those positions and layers of |recorded & chosen| / (n L k), n those positions.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from nemo_grpo.backends.registry import backend_spec
from nemo_grpo.errors import require, require_choice

BALANCING_TYPES = ["none", "aux_loss"]


# ---------------------------------------------------------------------------------------------- definitions
def load_balancing_loss(logits: list[torch.Tensor], real: torch.Tensor, top_k: int) -> torch.Tensor:
    """HF's load-balancing loss (see the module docstring) of L layers' router logits [N, E] over the positions
    where real [N] (bool) is True; a scalar, differentiable through the probabilities."""
    assigned, probs = expert_sums(logits, real, top_k)
    return probs @ balancing_gradient(assigned, real, len(logits))


def expert_sums(logits: list[torch.Tensor], real: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Over the real positions and the layers: (top-k assignments per expert [E], no gradient; softmax
    probabilities per expert [E], differentiable)."""
    weight = real.float()[:, None]  # [N, 1]
    assigned = sum(_assignments(x, top_k) * weight for x in logits).sum(0)
    probs = sum(torch.softmax(x.float(), dim=-1) * weight for x in logits).sum(0)
    return assigned, probs


def balancing_gradient(assigned: torch.Tensor, real: torch.Tensor, layers: int) -> torch.Tensor:
    """d aux / d probs [E] of HF's load-balancing loss aux = E sum_e (assigned_e / n)(probs_e / n), n = the real
    positions x the layers; aux is linear in probs, so it is also probs @ this. assigned: all layers' [E]."""
    n = real.float().sum().clamp(min=1.0) * layers
    return assigned.shape[-1] * assigned / n ** 2


def z_loss(logits: list[torch.Tensor], real: torch.Tensor) -> torch.Tensor:
    """Megatron's router z-loss without its coefficient: per layer, the mean over the real positions of
    logsumexp(logits [N, E])^2; summed over the layers."""
    weight = real.float()  # [N]
    n = weight.sum().clamp(min=1.0)
    return sum((torch.logsumexp(x.float(), dim=-1).square() * weight).sum() / n for x in logits)


def expert_counts(logits: list[torch.Tensor], real: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-k assignments per expert of the real positions, [L, E] (float)."""
    with torch.no_grad():
        return torch.stack([(_assignments(x, top_k) * real.float()[:, None]).sum(0) for x in logits])


def load_imbalance(counts: torch.Tensor) -> float:
    """counts [L, E] of assignments -> the worst layer's max / mean tokens per expert."""
    counts = counts.float()
    return float((counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-12)).max())


def routing_matches(chosen: list[torch.Tensor], recorded: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """How many recorded choices were chosen again: chosen, per layer [N, k] expert ids; recorded [N, L, k]
    (-1: none); real [N] bool (the positions to count). Sum over them and the layers of |recorded & chosen|, a
    float scalar."""
    hits = sum(((c[:, :, None] == recorded[:, layer, None, :].long()).any(-1).sum(-1) * real).sum()
               for layer, c in enumerate(chosen))
    return torch.as_tensor(hits, dtype=torch.float32)


def _top_experts(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """[N, E] logits -> [N, k] the ids of each position's top-k experts (ties as torch.topk breaks them)."""
    return torch.topk(logits.detach().float(), top_k, dim=-1).indices


def _assignments(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """[N, E] logits -> [N, E] 1.0 at each position's top-k experts."""
    return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, _top_experts(logits, top_k), 1.0)


# ---------------------------------------------------------------------------------------------- in a worker
class RouterLogits:
    """Collects the router logits of one training forward, one [N, E] tensor per MoE layer in layer order, and
    the experts each position was routed to, [N, k] expert ids per layer, between `start()` (right before the
    forward) and `take()`; a back end calls `record` / `record_routes` from its routers (forward hooks, or a
    wrapped gating function). Not in eval mode (get_logprobs, score), except the routes inside `eval_routes()`;
    nor after `take` (a backward that recomputes the forward for activation checkpointing routes again)."""

    def __init__(self):
        self.logits: list[torch.Tensor] = []
        self.routes: list[torch.Tensor] = []
        self.armed = False
        self.routes_in_eval = False

    def start(self) -> None:
        self.logits, self.routes, self.armed = [], [], True

    def wants_logits(self, module: torch.nn.Module) -> bool:
        """Whether `record` keeps this router's logits now (a back end may skip making them otherwise)."""
        return self.armed and module.training

    def wants_routes(self, module: torch.nn.Module) -> bool:
        return self.armed and (module.training or self.routes_in_eval)

    def record(self, module: torch.nn.Module, logits: torch.Tensor) -> None:
        if self.wants_logits(module):
            self.logits.append(logits)

    def record_routes(self, module: torch.nn.Module, experts: torch.Tensor) -> None:
        """experts [N, k]: the ids of the experts each of the layer's N positions was dispatched to."""
        if self.wants_routes(module):
            self.routes.append(experts.detach())

    def take(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(logits, routes) of the forward since `start`, each a list over the MoE layers."""
        out = self.logits, self.routes
        self.logits, self.routes, self.armed = [], [], False
        return out

    @contextlib.contextmanager
    def eval_routes(self) -> Iterator[None]:
        """Record the routes of eval-mode forwards too (get_logprobs with return_routes)."""
        self.routes_in_eval = True
        try:
            yield
        finally:
            self.routes_in_eval = False


class RouterLosses:
    """One rank's router terms of a training step: `start_step(N)`, then per micro-batch `recorder.start()`
    right before its forward and `add(real, metrics)` right after (the loss term to add; "moe/aux_loss",
    "moe/z_loss" contributions into metrics), then `step_metrics(group)` (collective over the data-parallel
    group: "moe/load_imbalance"). Under pipeline parallelism (`stages`) each stage adds its own layers' terms to
    its output instead (`add_stage`), and step_metrics also gives the step's "moe/aux_loss" and "moe/z_loss"."""

    def __init__(self, cfg, top_k: int, stages: Optional["StageExchange"] = None):
        """cfg: policy.megatron_cfg or policy.dtensor_cfg (config.RouterLossConfig); stages: the exchange with
        the other pipeline stages, whose MoE layers this rank does not hold."""
        self.top_k, self.stages = top_k, stages
        self.aux_coeff = cfg.moe_aux_loss_coeff if cfg.moe_router_load_balancing_type == "aux_loss" else 0.0
        self.z_coeff = cfg.moe_z_loss_coeff or 0.0
        self.recorder = RouterLogits()
        self.step_tokens = 1.0
        self.counts: Optional[torch.Tensor] = None  # [L, E], this rank's so far this step
        self.agreement: Optional[torch.Tensor] = None  # [3]: matches dispatched, matches of the own top k, choices
        self.stage_losses = torch.zeros(2)  # pipeline stages: this stage's share of the step's aux and z-loss

    def start_step(self, step_tokens: float) -> None:
        """step_tokens: the real tokens of the step's global batch (all micro-batches and DP ranks)."""
        self.step_tokens, self.counts, self.agreement = float(step_tokens), None, None
        self.stage_losses = torch.zeros(2)

    def add(self, real: torch.Tensor, metrics: dict, recorded: Optional[torch.Tensor] = None) -> torch.Tensor:
        """real [r, t]: the real-token mask of the positions the forward saw; recorded [r, t, L, k]: the routes
        recorded for them earlier (-1 where none), for the agreement metrics; -> coeff-weighted loss term."""
        logits, real = self._take(real, recorded)
        share = real.sum() / self.step_tokens
        aux = load_balancing_loss(logits, real, self.top_k) * share
        metrics["moe/aux_loss"] = aux.detach()
        term = self.aux_coeff * aux
        if self.z_coeff:
            z = z_loss(logits, real) * share
            metrics["moe/z_loss"] = z.detach()
            term = term + self.z_coeff * z
        return term

    def add_stage(self, output: torch.Tensor, real: torch.Tensor, recorded: Optional[torch.Tensor] = None
                  ) -> torch.Tensor:
        """Pipeline parallelism: this stage's output (hidden states or logits), unchanged, whose backward also
        backpropagates this stage's router terms; real, recorded as in `add` (recorded: this stage's layers).
        The load-balancing loss is linear in each stage's probabilities once every stage's assignments are known:
        this stage's are sent at the forward, the others' received at the backward (they are all in by then).
        Every stage holds as many MoE layers (the Megatron back end splits them evenly)."""
        logits, real = self._take(real, recorded)
        total_layers = len(logits) * len(self.stages.ranks)
        share = real.sum() / self.step_tokens
        assigned, probs = expert_sums(logits, real, self.top_k)
        self.stages.send(assigned)
        z = z_loss(logits, real) * share if self.z_coeff else probs.new_zeros(())
        self.stage_losses[1] += float(z.detach())

        def gradients() -> tuple[torch.Tensor, torch.Tensor]:  # in the backward: d loss / d (probs, z)
            pooled = assigned + self.stages.receive(assigned)
            d_aux = balancing_gradient(pooled, real, total_layers) * share
            self.stage_losses[0] += float(probs.detach() @ d_aux)
            return self.aux_coeff * d_aux, torch.tensor(float(self.z_coeff), device=z.device)
        return _WithStageTerms.apply(output, probs, z, gradients)

    def _take(self, real: torch.Tensor, recorded: Optional[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The micro-batch's router logits per layer [N, E] and real [N] bool; its counts and agreement noted."""
        (logits, routes), real = self.recorder.take(), real.reshape(-1).bool()
        if not logits:
            raise RuntimeError("router losses: the training forward recorded no router logits")
        if recorded is not None:
            self._add_agreement(logits, routes, recorded.reshape(real.shape[0], *recorded.shape[-2:]), real)
        counts = expert_counts(logits, real, self.top_k)
        self.counts = counts if self.counts is None else self.counts + counts
        return logits, real

    def _add_agreement(self, logits: list[torch.Tensor], routes: list[torch.Tensor], recorded: torch.Tensor,
                       real: torch.Tensor) -> None:
        """The micro-batch's matches of the recorded routes [N, L, k], dispatched (routes) and of the router's own
        top k (logits), over its real positions that have recorded routes; summed into self.agreement."""
        if len(routes) != len(logits):
            raise RuntimeError(f"routing agreement: {len(routes)} layers' routes recorded for {len(logits)} routers")
        counted = real & (recorded >= 0).all(-1).all(-1)  # [N]
        own = [_top_experts(x, self.top_k) for x in logits]
        part = torch.stack([routing_matches(routes, recorded, counted).to(counted.device),
                            routing_matches(own, recorded, counted).to(counted.device),
                            counted.sum().float() * len(logits) * self.top_k])
        self.agreement = part if self.agreement is None else self.agreement + part

    def step_metrics(self, group) -> dict[str, float]:
        """Collective over `group` (the data-parallel ranks), and over the pipeline stages: the step's load
        imbalance (the worst layer of any stage), the agreement; the stages' aux and z-loss summed."""
        counts, reduce = self.counts, group is not None and dist.get_world_size(group) > 1
        if reduce:
            dist.all_reduce(counts, group=group)
        imbalance = torch.tensor([load_imbalance(counts)])
        out = {}
        if self.stages is not None:
            self.stages.finish_step()
            dist.all_reduce(imbalance, op=dist.ReduceOp.MAX, group=self.stages.group)
            dist.all_reduce(self.stage_losses, group=self.stages.group)
            out["moe/aux_loss"] = float(self.stage_losses[0])
            if self.z_coeff:
                out["moe/z_loss"] = float(self.stage_losses[1])
        out["moe/load_imbalance"] = float(imbalance)
        if self.agreement is not None:  # every rank's micro-batches carried routes (the train call's column)
            agreement = self.agreement.clone()
            if reduce:
                dist.all_reduce(agreement, group=group)
            if self.stages is not None:
                agreement = self.stages.sum(agreement)
            whole = float(agreement[2].clamp(min=1))
            out.update({"moe/routing_agreement": float(agreement[0]) / whole,
                        "moe/router_topk_agreement": float(agreement[1]) / whole})
        return out

    def all_layers(self, routes: list[torch.Tensor]) -> torch.Tensor:
        """This rank's MoE layers' routes, per layer [N, k] -> every layer's [N, L, k] (gathered over the
        pipeline stages, in layer order)."""
        stacked = torch.stack(routes, dim=1)  # [N, L_stage, k]
        return stacked if self.stages is None else self.stages.gather(stacked)


class _WithStageTerms(torch.autograd.Function):
    """Identity on a pipeline stage's output; its backward also backpropagates the stage's router terms into
    probs [E] and z (a scalar) with the gradients gradients() returns, called then (Megatron's
    MoEAuxLossAutoScaler carries its aux loss the same way)."""

    @staticmethod
    def forward(ctx, output, probs, z, gradients):
        ctx.gradients = gradients
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        d_probs, d_z = ctx.gradients()
        return grad, d_probs, d_z, None


class StageExchange:
    """Between the pipeline stages of one model replica, over a gloo group of their ranks (in stage order; CPU
    tensors, beside the schedule's own transfers): each stage's expert assignments [E] of a micro-batch, sent to
    every other stage at its forward and received at its backward. Every stage's backward of a micro-batch
    follows every stage's forward of it, and all run the micro-batches in one order (1F1B), so each receive
    finds the message it waits for first in line."""

    def __init__(self, group):
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.peers = [r for r in self.ranks if r != dist.get_rank()]
        self.pending: list = []  # (work, tensor) of this step's sends

    def send(self, assigned: torch.Tensor) -> None:
        message = assigned.detach().float().cpu()
        self.pending += [(dist.isend(message, dst=peer, group=self.group), message) for peer in self.peers]

    def receive(self, like: torch.Tensor) -> torch.Tensor:
        """The sum of the other stages' assignments of the micro-batch, like `like` [E]."""
        total = torch.zeros(like.shape, dtype=torch.float32)
        for peer in self.peers:
            message = torch.empty_like(total)
            dist.recv(message, src=peer, group=self.group)
            total += message
        return total.to(like.device)

    def finish_step(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        out = values.detach().float().cpu()
        dist.all_reduce(out, group=self.group)
        return out.to(values.device)

    def gather(self, stage_part: torch.Tensor) -> torch.Tensor:
        """[N, L_stage, ...] on every stage -> [N, L, ...] in stage (layer) order."""
        parts = [torch.empty_like(stage_part.cpu()) for _ in self.ranks]
        dist.all_gather(parts, stage_part.cpu().contiguous(), group=self.group)
        return torch.cat(parts, dim=1).to(stage_part.device)


def validate_router_losses(p, prefix: str = "policy") -> None:
    """The router-loss keys of the back end's section (policy.megatron_cfg / dtensor_cfg): a known balancing
    type, coefficients >= 0, a coefficient only with its loss on, and no coefficient with activation
    checkpointing (Megatron recomputes the router without autograd) or context parallelism (each rank sees a
    share of a micro-batch's tokens)."""
    spec = backend_spec(p.backend)
    cfg, key = spec.cfg(p), spec.key(prefix)
    kind = cfg.moe_router_load_balancing_type
    require_choice(kind, key + "moe_router_load_balancing_type", BALANCING_TYPES)
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        value = getattr(cfg, name)
        require(value is None and name == "moe_z_loss_coeff" or isinstance(value, (int, float)) and value >= 0,
                key + name, f"must be a number >= 0{' or null' if name == 'moe_z_loss_coeff' else ''}, got {value}")
    require(kind == "aux_loss" or not cfg.moe_aux_loss_coeff, key + "moe_aux_loss_coeff",
            f"{cfg.moe_aux_loss_coeff} with moe_router_load_balancing_type '{kind}': the load-balancing loss is off; "
            "set moe_router_load_balancing_type to aux_loss")
    on = (kind == "aux_loss" and cfg.moe_aux_loss_coeff) or cfg.moe_z_loss_coeff
    require(not (on and cfg.activation_checkpointing), key + "activation_checkpointing",
            "not with a router loss (moe_aux_loss_coeff / moe_z_loss_coeff > 0) yet: the recomputed router "
            "would carry no gradient of it; set one of them off")
    require(not (on and cfg.context_parallel_size > 1), key + "context_parallel_size",
            f"{cfg.context_parallel_size}: not with a router loss (moe_aux_loss_coeff / moe_z_loss_coeff > 0) "
            "yet: each rank sees a share of a micro-batch's tokens; set one of them off")
