"""The plain PyTorch generation engine: a Hugging Face model in a Ray actor with a KV-cache sampling loop.

The fallback when vLLM is not installed, and fast enough for tiny models on a CPU. Sampling applies
temperature, top-k and top-p; the reported log-prob of each sampled token is taken from the distribution it
was sampled from (temperature-scaled and truncated), which is what the policy's log-probs are compared to.
For a Mixture-of-Experts model it also records the experts every position was routed to (GenerationOutput
.routed_experts), from forward hooks on the routers: what routing replay from the engine replays in training.
For LoRA adapter refits (`lora_cfg`: policy.lora with refit=adapters) the model gets peft's LoRA layers once, on
the targets (models/lora.py inject_adapters; B zero: the base model), and a refit copies the adapters, by peft's
keys, into them in place.
"""

from __future__ import annotations

from typing import Optional

import ray
import torch
from transformers import AutoModelForCausalLM

from nemo_grpo.generation.interface import GenerationEngine, GenerationOutput, request_seed
from nemo_grpo.models import lora
from nemo_grpo.models.experts import moe_routers
from nemo_grpo.models.tokenizer import load_tokenizer
from nemo_grpo.weights.receiver import WeightReceiver


def filter_logits(logits: torch.Tensor, top_k: Optional[int], top_p: float) -> torch.Tensor:
    """[B, V] logits with everything outside the top-k / top-p nucleus set to -inf."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        outside = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return logits


class TorchGenerationWorker:
    """Ray actor holding one HF causal LM (on the CPU); `generate` runs a batched, left-padded sampling loop.
    A WeightSink (weights/protocols.py): its `weight_receiver` loads each bucket of a refit in place."""

    def __init__(self, model_path: str, cfg, num_threads: int = 1, in_flight_updates: bool = False, lora_cfg=None):
        torch.set_num_threads(num_threads)
        self.weight_receiver = WeightReceiver(self, in_flight_updates)
        self.cfg = cfg
        self.tokenizer = load_tokenizer(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.lora_cfg = lora_cfg  # policy.lora when refits install adapters (None: refits load weights)
        if lora_cfg is not None:
            lora.inject_adapters(self.model, lora_cfg)
        self.model.eval()  # (after the injection: its dropout layers too)
        # what a refit loads: peft's saved key of each adapter -> its state-dict key; else HF names, as they are
        self.refit_keys = {lora.saved_key(k): k for k in self.model.state_dict() if lora.is_adapter(k)} \
            if lora_cfg is not None else {k: k for k in self.model.state_dict()}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.stop_ids = {self.tokenizer.eos_token_id, *(cfg.stop_token_ids or [])} - {None}
        self.routes: list[torch.Tensor] = []  # per MoE layer, the top-k expert ids [N, k] of the last forward
        for router in moe_routers(self.model):
            router.register_forward_hook(lambda m, args, out: self.routes.append(out[2]))

    # WeightSink (weights/protocols.py)
    def weight_names(self) -> set[str]:
        return set(self.refit_keys)

    def takes_adapters(self) -> bool:
        return self.lora_cfg is not None

    def weight_dtype(self) -> torch.dtype:
        return torch.float32

    def weight_device(self) -> torch.device:
        return torch.device("cpu")

    def prepare_for_refit(self) -> None:
        """Nothing to take back: the model stays in memory."""

    def begin_refit(self) -> None:
        """Nothing to open: buckets are copied into the live parameters."""

    def finish_refit(self) -> int:
        return 0

    def load_bucket(self, bucket: dict[str, torch.Tensor]) -> int:
        """Copy HF-named tensors (adapter refits: peft-keyed adapters) into the live parameters in place; returns
        how many were loaded."""
        params = self.model.state_dict()
        unknown = [k for k in bucket if k not in self.refit_keys]
        if unknown:
            raise KeyError(f"refit: the engine's model has no parameter(s) {unknown[:5]}")
        with torch.no_grad():
            for name, tensor in bucket.items():
                params[self.refit_keys[name]].copy_(tensor)
        return len(bucket)

    def _stopped_by_string(self, tokens: list[int], stops: list[str]) -> bool:
        if not stops:
            return False
        longest = max(len(s) for s in stops)
        tail = self.tokenizer.decode(tokens[-longest:], skip_special_tokens=False)
        return any(s in tail for s in stops)

    def generate(self, prompts, greedy=False, seed=None, stop_strings=None, max_new_tokens=None, indices=None):
        """One sample per prompt; `indices`: each prompt's place in the engine's call (its seed), default 0..B-1."""
        with self.weight_receiver.generation(), torch.no_grad():
            return self._sample(prompts, greedy, seed, stop_strings, max_new_tokens,
                                range(len(prompts)) if indices is None else indices)

    def _forward(self, **inputs):
        """One forward step of the sampling loop (a refit may land between two): (model output, the routes of the
        [B, S] positions it ran, [B, S, L, k] int16, or None for a dense model)."""
        self.routes = []
        with self.weight_receiver.model_turn():
            out = self.model(**inputs, use_cache=True)
        if not self.routes:
            return out, None
        b, s = inputs["input_ids"].shape
        return out, torch.stack(self.routes, dim=1).reshape(b, s, len(self.routes), -1).to(torch.int16)

    def _sample(self, prompts, greedy, seed, stop_strings, max_new_tokens, indices):
        cfg = self.cfg
        max_new = max_new_tokens or cfg.max_new_tokens
        # one generator per request: a row's draws do not depend on the other rows of the batch
        generators = None if seed is None or greedy else [
            torch.Generator().manual_seed(request_seed(seed, int(i))) for i in indices]
        stops = [list(cfg.stop_strings or []) + list((stop_strings or [None] * len(prompts))[i] or [])
                 for i in range(len(prompts))]
        B, P = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: the newest token of every row is in the last column
            ids[i, P - len(p):] = torch.tensor(p)
            mask[i, P - len(p):] = 1
        out, routes = self._forward(input_ids=ids, attention_mask=mask,
                                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        routed = None if routes is None else [[routes[i, P - len(p):]] for i, p in enumerate(prompts)]
        tokens, logprobs = [[] for _ in range(B)], [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool)
        reasons = ["length"] * B
        for step in range(max_new):
            logits = out.logits[:, -1].float()
            if not greedy:
                logits = filter_logits(logits / cfg.temperature, cfg.top_k, cfg.top_p)
            logp = torch.log_softmax(logits, -1)  # [B, V]
            nxt = logp.argmax(-1) if greedy else draw(logp.exp(), generators)
            for i in torch.nonzero(~done).flatten().tolist():
                tok = int(nxt[i])
                tokens[i].append(tok)
                logprobs[i].append(float(logp[i, tok]))
                if tok in self.stop_ids or self._stopped_by_string(tokens[i], stops[i]):
                    done[i], reasons[i] = True, "stop"
            if bool(done.all()) or step == max_new - 1:
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], dim=1)
            out, routes = self._forward(input_ids=nxt[:, None], attention_mask=mask,
                                        past_key_values=out.past_key_values,
                                        position_ids=(mask.sum(-1, keepdim=True) - 1))
            for i in range(B) if routed is not None else ():
                if len(tokens[i]) == step + 1:  # row i sampled at this step: the forward ran its token
                    routed[i].append(routes[i])
        outputs = [GenerationOutput(t, lp, r) for t, lp, r in zip(tokens, logprobs, reasons)]
        if routed is not None:
            _attach_routes(outputs, prompts, routed)
        return outputs


def draw(probs: torch.Tensor, generators: Optional[list[torch.Generator]]) -> torch.Tensor:
    """One token per row of [B, V] probs: [B]; row i from generators[i] (None: the global generator)."""
    if generators is None:
        return torch.multinomial(probs, 1).squeeze(-1)
    return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators)])


def _attach_routes(outputs: list[GenerationOutput], prompts: list[list[int]], routed: list[list[torch.Tensor]]
                   ) -> None:
    """Each output's routed_experts [len(prompt) + len(token_ids), L, k]: the routes of the positions its forwards
    ran (routed[i]: the prompt's [len(prompt), L, k], then one [L, k] per token fed back), -1 after them."""
    for out, prompt, parts in zip(outputs, prompts, routed):
        ran = torch.cat([p.reshape(-1, *p.shape[-2:]) for p in parts])
        missing = len(prompt) + len(out.token_ids) - ran.shape[0]
        out.routed_experts = torch.cat([ran, ran.new_full((missing, *ran.shape[1:]), -1)])


class TorchGeneration(GenerationEngine):
    """Driver-side front of TorchGenerationWorker actors, one per replica (`replicas`: a Ray scheduling strategy
    each, resource_plan.engine_replicas; (None,): one replica, anywhere). lora_cfg: policy.lora, for LoRA
    adapter refits (the module)."""

    def __init__(self, cfg, model_path: str, cluster_cfg, *, in_flight_updates: bool = False, replicas=(None,),
                 lora_cfg=None):
        self.cfg = cfg
        worker = ray.remote(TorchGenerationWorker)
        self.replicas = [worker.options(num_cpus=0, max_concurrency=2 if in_flight_updates else 1,
                                        scheduling_strategy=strategy).remote(
            model_path, cfg, cluster_cfg.num_threads_per_worker, in_flight_updates, lora_cfg) for strategy in replicas]

    def _generate_on(self, replica, prompts, indices, greedy, seed, stop_strings, max_new_tokens):
        return replica.generate.remote(prompts, greedy, seed, stop_strings, max_new_tokens, indices)
