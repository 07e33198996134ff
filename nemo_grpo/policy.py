"""`Policy`: the driver-side front of a policy (or reward model) run as one SPMD group of back-end workers.

The front is thin: it splits a batch over the data-parallel ranks, sends every rank of a DP group the same
rows, computes the global-batch normalizers for the loss, gathers results in order and aggregates metrics.
Every rank is a `PolicyActor` (nemo_grpo/backends/actor.py) running the back end's engine, picked by
`policy.backend`; a training batch is a StepBatch (nemo_grpo/batch.py), the rest of the data contract is in
nemo_grpo/backends/batching.py and actor.py.

    policy = Policy(cfg.policy, cfg.cluster, model_path, init_reference=True)
    with policy.shipped(StepBatch(...)) as rows:                  # each DP shard into its workers, once
        prev = policy.get_logprobs(rows, keep="prev_logprobs")   # [B, T], also kept in the workers' shards
        metrics = policy.train(rows, loss_fn, columns={"advantages": adv})  # adv [B]; a step per global batch
    make_refitter(policy, engine, cfg.policy.generation).refit()  # weights into the engine (weights/refit.py),
                                                                   # through policy.group: no tensor passes here
    policy.shutdown()
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import ray
import torch

from nemo_grpo.backends.batching import (PACKING_ALGORITHMS, batch_size_of, equalize_group_counts,
                                         fixed_size_groups, split_sizes, take_rows, token_budget_groups)
from nemo_grpo.backends.registry import backend_spec, policy_layout
from nemo_grpo.batch import StepBatch, require_keys
from nemo_grpo.distributed.worker_group import WorkerGroup
from nemo_grpo.precision import PrecisionChoice, log_precision

log = logging.getLogger(__name__)
# metrics every rank has alike, the step's global values (rank 0's are taken): averaged over a call's optimizer
# steps (RANK0_MEAN) or summed (RANK0_SUM); the moe/ ones only for a Mixture-of-Experts model
RANK0_MEAN = ("grad_norm", "lr", "micro_batches", "moe/load_imbalance", "moe/routing_agreement",
              "moe/router_topk_agreement")
RANK0_SUM = ("skipped_steps",)


@dataclass
class ShippedRows:
    """A batch's rows held in the memory of the policy's workers, each data-parallel shard once (`Policy.ship`):
    `get_logprobs`, `get_reference_logprobs`, `score` and `train` take it in place of the batch, so a GRPO step
    sends its rows once for its calls, and a forward pass may leave its result in the shard (`keep`) for `train`.

    key: the name the workers hold the shard under (until `Policy.release`).
    rows: the driver's dict of the rows (the same tensors, not copies), B rows; step: the StepBatch they are of
        (None for a forward-only batch).
    order: per DP rank, the batch row of each of its rows, [r] long (dp_row_order); -1 marks a padding row (a
        copy of row 0 that evens out the ranks' forwards; its result is dropped).
    """

    key: str
    rows: dict[str, Any]
    order: list[torch.Tensor]
    step: Optional[StepBatch] = None

    @property
    def lengths(self) -> list[list[int]]:
        """Per DP rank: input_lengths of its rows (the micro-batch plans)."""
        return [self.rows["input_lengths"][o.clamp(min=0)].tolist() for o in self.order]

    def gather(self, per_dp: list[torch.Tensor]) -> torch.Tensor:
        """Per DP rank its results [r, ...] -> the batch's [B, ...] in batch order (padding rows dropped)."""
        out = per_dp[0].new_empty((batch_size_of(self.rows), *per_dp[0].shape[1:]))
        for rows, result in zip(self.order, per_dp):
            keep = rows >= 0
            out[rows[keep]] = result[keep]
        return out


def dp_row_order(n: int, dp: int, global_batch: int) -> list[torch.Tensor]:
    """Which batch rows each of `dp` ranks holds (ShippedRows.order). Train's layout whenever train can run (n a
    multiple of global_batch, global_batch of dp): rank d holds, for each global batch in turn, its d-th of dp
    equal contiguous parts. Else (forward only) n rows in dp contiguous parts as even as possible, the short
    ones padded with -1."""
    if n % global_batch == 0 and global_batch % dp == 0:
        k = global_batch // dp
        return [torch.cat([torch.arange(g + d * k, g + (d + 1) * k) for g in range(0, n, global_batch)])
                for d in range(dp)]
    sizes = split_sizes(n, dp)
    starts = [sum(sizes[:d]) for d in range(dp)]
    return [torch.cat([torch.arange(s, s + k), torch.full((max(sizes) - k,), -1)]) for s, k in zip(starts, sizes)]


class Policy:
    """A policy (or, with scalar_head=True, a reward model) on world_size = gpus_per_node x num_nodes workers.

    cfg: PolicyConfig; cluster: ClusterConfig; model_path: a local Hugging Face directory (tokenizer inside).
    init_reference: keep a CPU copy of the initial weights for get_reference_logprobs.
    placement_group: a ready Ray placement group with a bundle per rank (resource_plan.reserve); None = its own.
    """

    def __init__(self, cfg, cluster, model_path: str, *, scalar_head: bool = False, init_reference: bool = False,
                 seed: int = 0, name: str = "policy", placement_group=None, config_key: Optional[str] = None):
        self.cfg, self.name = cfg, name
        self.scalar_head, self.init_reference = scalar_head, init_reference
        self.logprob_passes = 0  # get_logprobs calls (the current weights' passes; not the reference's)
        self.world_size = cluster.gpus_per_node * cluster.num_nodes
        cls = backend_spec(cfg.backend).worker_class()
        policy_layout(cfg, self.world_size)  # a bad layout fails here, before any actor starts
        t0 = time.perf_counter()
        self.group = WorkerGroup(cls, cluster, name=name, placement_group=placement_group, kwargs=dict(
            cfg=cfg, model_path=os.path.abspath(model_path), scalar_head=scalar_head,
            init_reference=init_reference, seed=seed))
        layouts = self.group.run_all("layout")
        self.startup_s = time.perf_counter() - t0
        self.dp_size = layouts[0]["dp_size"]
        self._dp_rank_of = [lay["dp_rank"] for lay in layouts]  # by global rank
        self._output_rank_of = {lay["dp_rank"]: r for r, lay in enumerate(layouts) if lay["output_rank"]}
        self.devices = [lay["device"] for lay in layouts]  # by global rank: "cuda:0" | "cpu"
        self.dist_backend = layouts[0]["dist_backend"]  # "nccl" | "gloo"
        self.precision = PrecisionChoice(**layouts[0]["precision"])  # rank 0's: "auto" resolved on its device
        log_precision(self.precision, f"{config_key or name}.precision")
        log.info("%s: %d %s worker(s) on %s, torch.distributed %s, started in %.1f s", name, self.world_size,
                 cfg.backend, ", ".join(sorted(set(self.devices))), self.dist_backend, self.startup_s)
        if cluster.num_nodes > 1:  # where each rank runs and which network its process groups use
            self.log_process_groups()

    def log_process_groups(self) -> None:
        """One line a rank: `policy rank 1 on n2 (10.77.0.12): process group over eth0, peers 10.77.0.11,...`."""
        for rank, r in enumerate(self.process_group_report()):
            log.info("%s rank %d on %s (%s): process group over %s, peers %s", self.name, rank, r["hostname"],
                     r["address"], r["interface"], ",".join(r["peers"]) or "none")

    def process_group_report(self) -> list[dict[str, Any]]:
        """Per rank, where its process groups are: {"hostname", "address" (its node's Ray address), "interface"
        (the network interface they bind: the one holding that address, unless GLOO_SOCKET_IFNAME /
        NCCL_SOCKET_IFNAME was set, which wins), "peers" (remote IPv4 addresses of its established TCP
        connections)}; see distributed/interfaces.py."""
        return self.group.run_all("process_group_report")

    # ------------------------------------------------------------------------------------------ dispatch
    def ship(self, batch: "StepBatch | dict[str, Any]") -> ShippedRows:
        """Send the batch's rows (every per-row entry; a StepBatch's loss mask included) to the workers, each DP
        shard once, in train's layout where B allows it; the workers hold them until `release`. The calls that
        take the result send only its key."""
        step = batch if isinstance(batch, StepBatch) else None
        rows = step.rows() if step is not None else batch
        n = batch_size_of(rows)
        if n == 0:
            raise ValueError(f"{self.name}: empty batch")
        order = dp_row_order(n, self.dp_size, self.cfg.train_global_batch_size)
        refs = [ray.put(take_rows(rows, shard.clamp(min=0).tolist())) for shard in order]
        key = uuid.uuid4().hex
        ray.get(self.group.run_each("hold", [(key, refs[d]) for d in self._dp_rank_of]))
        return ShippedRows(key, rows, order, step)

    def release(self, rows: ShippedRows) -> None:
        """The workers drop the shards `ship` gave them (and what the forwards kept there)."""
        if self.group is not None:
            self.group.run_all("release", rows.key)

    @contextlib.contextmanager
    def shipped(self, batch: "StepBatch | dict[str, Any]") -> Iterator[ShippedRows]:
        """`ship` for the calls inside the block, `release` after it (after an error, one that the release meets
        too, e.g. a dead worker, does not hide the first)."""
        rows = self.ship(batch)
        try:
            yield rows
        except BaseException:
            with contextlib.suppress(Exception):
                self.release(rows)
            raise
        self.release(rows)

    def _micro_batch_plan(self, lengths: list[list[int]], kind: str) -> list[list[list[int]]]:
        """Per DP shard (its rows' input_lengths), its rows grouped into micro-batches (`kind`: "train" or
        "logprob"), with the same number of groups on every shard: the one place a batch is planned. Under a
        token budget: packed into bins (policy.sequence_packing; each bin runs as one packed row) or cut by length
        (policy.dynamic_batching); else in rows of policy.train_micro_batch_size / logprob_batch_size."""
        packing, dynamic = self.cfg.sequence_packing, self.cfg.dynamic_batching
        if packing.enabled:
            budget = getattr(packing, f"{kind}_mb_tokens")
            groups = [PACKING_ALGORITHMS[packing.algorithm](rows, budget) for rows in lengths]
        elif dynamic.enabled:
            budget = getattr(dynamic, f"{kind}_mb_tokens")
            groups = [token_budget_groups(rows, budget, dynamic.sequence_length_round) for rows in lengths]
        else:
            size = self.cfg.train_micro_batch_size if kind == "train" else self.cfg.logprob_batch_size
            return [fixed_size_groups(len(rows), size) for rows in lengths]
        return equalize_group_counts(groups)

    def _gather(self, refs: list) -> list[Any]:
        """Results of the output rank of each DP group, in DP order."""
        results = ray.get(refs)
        return [results[self._output_rank_of[d]] for d in range(self.dp_size)]

    def _forward(self, method: str, batch: "dict[str, Any] | ShippedRows", **kwargs) -> Any:
        """Rows split over DP (short shards padded so all ranks run the same number of forwards), each rank sent
        its shard's key; per-row results (a tensor, or a tuple of them) gathered back in batch order."""
        if not isinstance(batch, ShippedRows):
            require_keys(batch, ("input_ids", "input_lengths"), method)
            with self.shipped({"input_ids": batch["input_ids"], "input_lengths": batch["input_lengths"]}) as rows:
                return self._forward(method, rows, **kwargs)
        plan = self._micro_batch_plan(batch.lengths, "logprob")
        args = [(batch.key, plan[d]) for d in self._dp_rank_of]
        per_dp = self._gather(self.group.run_each(method, args, **kwargs))
        if isinstance(per_dp[0], tuple):
            return tuple(batch.gather(list(parts)) for parts in zip(*per_dp))
        return batch.gather(per_dp)

    # ------------------------------------------------------------------------------------------ inference
    def _need_lm(self, what: str) -> None:
        if self.scalar_head:
            raise RuntimeError(f"{self.name}: {what} needs a causal LM; this policy has a scalar head (use score)")

    def get_logprobs(self, batch: "dict[str, Any] | ShippedRows", return_routes: bool = False,
                     keep: Optional[str] = None) -> Any:
        """input_ids [B, T], input_lengths [B] -> logprobs [B, T] (column 0 and padding are 0), no grad. With
        return_routes (a Mixture-of-Experts model): (logprobs, routed_experts [B, T, L, k] int16), the experts
        each position was routed to in each of the L MoE layers (-1 on padding), which `train` takes as the
        column "routed_experts" (routing replay, policy.megatron_cfg.moe_router_replay, and the agreement
        metrics of backends/router.py). keep (shipped rows only): the workers also write the log-probs (and the
        routes) into their shard under that name, for `train`'s loss."""
        self._need_lm("get_logprobs")
        self.logprob_passes += 1
        return self._forward("get_logprobs", batch, return_routes=return_routes, keep=keep)

    def kept(self, rows: ShippedRows, name: str) -> torch.Tensor:
        """What a call left in the workers' shards of `rows` under `name` (e.g. an on-policy train's
        "prev_logprobs"), [B, ...] in batch order."""
        return rows.gather(self._gather(self.group.run_all_async("kept", rows.key, name)))

    def get_reference_logprobs(self, batch: "dict[str, Any] | ShippedRows", keep: Optional[str] = None
                               ) -> torch.Tensor:
        """Like get_logprobs with the initial weights: [B, T]. Needs init_reference=True."""
        if not self.init_reference:
            raise RuntimeError(f"{self.name}: get_reference_logprobs needs Policy(..., init_reference=True)")
        return self._forward("get_reference_logprobs", batch, keep=keep)

    def score(self, batch: "dict[str, Any] | ShippedRows") -> torch.Tensor:
        """input_ids [B, T], input_lengths [B] -> scalar-head output at the last real token, [B]."""
        if not self.scalar_head:
            raise RuntimeError(f"{self.name}: score needs a scalar head: Policy(..., scalar_head=True)")
        return self._forward("score", batch)

    # ------------------------------------------------------------------------------------------ training
    def train(self, batch: "StepBatch | dict[str, Any] | ShippedRows", loss_fn,
              columns: Optional[dict[str, torch.Tensor]] = None, on_policy: bool = False) -> dict[str, float]:
        """One optimizer step per global batch of policy.train_global_batch_size rows (B must be a multiple).

        batch: a StepBatch (or a dict of its fields), or the ShippedRows of one (`ship`), whose shards may hold
        what forwards kept there (prev_logprobs, ...); columns: per-row tensors [B, ...] sent with this call
        (GRPO: advantages [B]). loss_fn(logprobs [b, T] (scalar head: scores [b]), micro_batch,
        global_valid_seqs, global_valid_toks) -> (loss, metrics), the normalizers counted over each global
        batch. Returns the loss-fn metrics (and "loss") summed over micro-batches and DP ranks, averaged over the
        optimizer steps, plus "grad_norm" (pre-clip), "lr" and "skipped_steps" (steps skipped for a non-finite
        gradient norm); a Mixture-of-Experts model adds "moe/aux_loss" (and "moe/z_loss" with its coefficient)
        and "moe/load_imbalance" (backends/router.py).

        on_policy (B = policy.train_global_batch_size: one optimizer step, algorithms/on_policy.py): the loss's
        prev_logprobs are the training forward's own log-probs, detached (no get_logprobs pass before); the
        workers keep them in their shard, `kept(rows, "prev_logprobs")` reads them.
        """
        if not isinstance(batch, ShippedRows):
            with self.shipped(StepBatch.of(batch)) as rows:
                return self.train(rows, loss_fn, columns, on_policy)
        if batch.step is None:
            raise TypeError(f"{self.name}: train needs the ShippedRows of a StepBatch (Policy.ship(StepBatch(...)))")
        n, gbs, dp = len(batch.step), self.cfg.train_global_batch_size, self.dp_size
        if n == 0 or n % gbs:
            raise ValueError(f"train: batch size {n} is not a positive multiple of "
                             f"policy.train_global_batch_size={gbs}")
        if on_policy and n != gbs:
            raise ValueError(f"train(on_policy=True): batch size {n} makes {n // gbs} optimizer steps of "
                             f"policy.train_global_batch_size={gbs}; an on-policy step is one")
        if gbs % dp:
            raise ValueError(f"train: policy.train_global_batch_size={gbs} is not divisible by the "
                             f"data-parallel size {dp}")
        columns = dict(columns or {})
        column_shards = [{k: v[order] for k, v in columns.items()} for order in batch.order]
        steps = self._train_steps(batch.step, batch.lengths)
        refs = self.group.run_each("train", [(batch.key, column_shards[d], steps[d]) for d in self._dp_rank_of],
                                   loss_fn=ray.put(loss_fn), on_policy=on_policy)
        by_rank = ray.get(refs)
        return self._aggregate([by_rank[self._output_rank_of[d]] for d in range(dp)], by_rank[0])

    def _train_steps(self, batch: StepBatch, lengths: list[list[int]]) -> list[list[dict[str, Any]]]:
        """Per DP rank, one entry per global batch: its rows' range within the rank's shard, the global batch's
        normalizers (StepBatch.normalizers) and its micro-batches."""
        n, gbs, dp = len(batch), self.cfg.train_global_batch_size, self.dp_size
        k = gbs // dp
        per_dp: list[list[dict]] = [[] for _ in range(dp)]
        for g, start in enumerate(range(0, n, gbs)):
            normalizers = batch.normalizers(start, start + gbs)
            plan = self._micro_batch_plan([rows[g * k:(g + 1) * k] for rows in lengths], "train")
            for d in range(dp):
                per_dp[d].append({"rows": (g * k, (g + 1) * k), **normalizers, "micro_batches": plan[d]})
        return per_dp

    @staticmethod
    def _aggregate(per_dp: list[list[dict]], rank0: list[dict]) -> dict[str, float]:
        """Loss metrics: sum over DP, mean over steps; grad_norm / lr: rank 0's, mean over steps;
        skipped_steps (non-finite gradient norm): rank 0's, summed over steps."""
        steps = len(rank0)
        out: dict[str, float] = {}
        for step in range(steps):
            for rank_steps in per_dp:
                for k, v in rank_steps[step].items():
                    if k not in RANK0_MEAN + RANK0_SUM:
                        out[k] = out.get(k, 0.0) + v / steps
            for k in RANK0_MEAN + RANK0_SUM:
                if k in rank0[step]:
                    out[k] = out.get(k, 0.0) + rank0[step][k] / (steps if k in RANK0_MEAN else 1)
        return out

    # ------------------------------------------------------------------------------------------ weights
    def save_pretrained(self, path: str) -> None:
        """A Hugging Face directory (config, safetensors, tokenizer files) that from_pretrained loads."""
        self.group.run_all("save_pretrained", os.path.abspath(path))

    def save_adapter(self, path: str) -> None:
        """LoRA: a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) that
        peft.PeftModel.from_pretrained loads on the base model."""
        self.group.run_all("save_adapter", os.path.abspath(path))

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """LoRA: every adapter, full, as CPU tensors under peft's saved keys."""
        return self.group.run_all("adapter_state")[0]

    def optimizer_memory(self) -> dict[str, float]:
        """Trainable parameter elements and optimizer-state bytes, summed over the ranks."""
        per_rank = self.group.run_all("optimizer_memory")
        return {k: sum(r[k] for r in per_rank) for k in per_rank[0]}

    def save_checkpoint(self, path: str) -> None:
        """Model + optimizer + scheduler + every rank's RNG state (torch.distributed.checkpoint) under `path`."""
        self.group.run_all("save_checkpoint", os.path.abspath(path))

    def load_checkpoint(self, path: str) -> None:
        self.group.run_all("load_checkpoint", os.path.abspath(path))

    def offload(self) -> None:
        """Model and optimizer state to host memory (when on CUDA; a no-op on CPU)."""
        self.group.run_all("offload")

    def onload(self) -> None:
        self.group.run_all("onload")

    def shutdown(self) -> None:
        """Kill the workers and free their resources; safe twice."""
        if getattr(self, "group", None) is not None:
            self.group.shutdown()
            self.group = None

    def __enter__(self) -> "Policy":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
