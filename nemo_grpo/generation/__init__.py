"""Generation engines by name (policy.generation.backend), imported only when used, like back ends and
environments. Each is a GenerationEngine (interface.py) whose worker actors are WeightSinks
(weights/protocols.py).

    engine = make_generation_engine(cfg.policy.generation, model_path, cfg.cluster)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from typing import Optional

from nemo_grpo.utils.registry import load_registered

log = logging.getLogger(__name__)

ENGINES = {
    "vllm": "nemo_grpo.generation.vllm_engine:VllmGeneration",
    "torch": "nemo_grpo.generation.torch_engine:TorchGeneration",
}
# engines that need an optional package, and the engine used where it is not installed
OPTIONAL = {"vllm": ("vllm", "torch")}


def vllm_available() -> bool:
    """Whether vLLM can be imported here (without importing it: that takes ~10 s)."""
    return importlib.util.find_spec("vllm") is not None


def make_generation_engine(cfg, model_path: str, cluster_cfg, *, in_flight_updates: bool = False,
                           replicas=(None,), precision: Optional[str] = None, lora_cfg=None):
    """The engine named by policy.generation.backend (vllm falls back to torch, with a notice, where vLLM is
    not installed). in_flight_updates: a refit may land between two forward steps of a generate call under way
    (grpo.async_grpo.in_flight_weight_updates; the engine's actor then runs two calls at once).
    replicas: where Ray places each replica's actor, one scheduling strategy each (resource_plan.engine_replicas:
    the planned nodes); (None,): one replica, anywhere. precision: policy.precision, the default of
    cfg.vllm_cfg.precision. lora_cfg: policy.lora; with policy.lora.refit=adapters the engine starts with LoRA
    enabled and its refits install adapters (weights/refit.py)."""
    from nemo_grpo.models.lora import refits_adapters  # here: it imports torch, this module is imported light

    if cfg.vllm_cfg.precision is None and precision is not None:
        cfg = dataclasses.replace(cfg, vllm_cfg=dataclasses.replace(cfg.vllm_cfg, precision=precision))
    name = cfg.backend
    if name in OPTIONAL and importlib.util.find_spec(OPTIONAL[name][0]) is None:
        fallback = OPTIONAL[name][1]
        log.warning("policy.generation.backend=%s but %s is not installed: using the %s engine", name,
                    OPTIONAL[name][0], fallback)
        name = fallback
    return load_registered(ENGINES, name, "policy.generation.backend")(
        cfg, model_path, cluster_cfg, in_flight_updates=in_flight_updates, replicas=replicas,
        lora_cfg=lora_cfg if refits_adapters(lora_cfg) else None)
