"""Policy back ends by name: each is a `BackendSpec` (backends/<back end>/spec.py), the one place that knows it.

Validation, the planner and the trainer ask the spec of `policy.backend` and never branch on its name:

    spec = backend_spec(cfg.policy.backend)         # ValueError listing the known names
    spec.section                                     # its config section's key in policy.* (and a reward model's)
    spec.layout(cfg.policy, world=4)                 # its ParallelLayout (ConfigError naming its keys)
    spec.engine_class()                              # its PolicyEngine subclass, imported only here

A spec module is light (no torch.distributed, no Megatron at its top): the driver imports it to validate and
plan; the engine class (and PolicyActor, the one Ray actor class that runs it) is imported on first use.
"""

from __future__ import annotations

from typing import Optional

from nemo_grpo.errors import ConfigError
from nemo_grpo.layout import DEGREE_NAMES, ParallelLayout
from nemo_grpo.utils.registry import load_registered

BACKENDS = {
    "dtensor": "nemo_grpo.backends.dtensor.spec:SPEC",
    "megatron": "nemo_grpo.backends.mcore.spec:SPEC",
}

# the one Ray actor class of every back end, loaded by name (it imports this module)
ACTOR = "nemo_grpo.backends.actor:PolicyActor"


class BackendSpec:
    """What a back end is to the rest of the house: its config section, its layout keys, its rules, its memory
    model and what it builds. A subclass sets the class attributes and overrides the hooks that differ."""
    name: str = ""  # its policy.backend value
    section: str = ""  # its config section in policy.* (and in a reward model's section)
    engine: str = ""  # "module:Class" of its PolicyEngine (backends/engine.py)
    degree_keys: dict[str, str] = {}  # degree (tp, pp, cp, dp) -> its key in the section; a degree not here is 1
    features: frozenset[str] = frozenset()  # what it builds: pp, ep, cp, sequence_parallel, router_replay, lora

    def cfg(self, p):
        """Its section of a policy-like config `p` (policy.*, a reward model's section)."""
        return getattr(p, self.section)

    def section_key(self, prefix: str = "policy") -> str:
        """The dotted key of its section under `prefix`: policy.<section>."""
        return f"{prefix}.{self.section}"

    def key(self, prefix: str, name: str = "") -> str:
        """The dotted key of `name` in its section under `prefix`: policy.<section>.<name>."""
        return f"{self.section_key(prefix)}.{name}"

    def degree(self, p, name: str) -> Optional[int]:
        """The configured degree `name` (tp, pp, cp, dp) of `p`; 1 for one the back end does not have."""
        return getattr(self.cfg(p), self.degree_keys[name]) if name in self.degree_keys else 1

    def worker_class(self):
        """The Ray actor class of its ranks: PolicyActor (backends/actor.py), the same for every back end, which
        runs engine_class()."""
        return load_registered({self.name: ACTOR}, self.name, "policy.backend")

    def engine_class(self):
        """Its PolicyEngine subclass (imports torch.distributed and the back end's framework)."""
        return load_registered({self.name: self.engine}, self.name, "policy.backend")

    # ------------------------------------------------------------------------------------ layout
    def layout(self, p, world: int, prefix: str = "policy", where: str = "") -> ParallelLayout:
        """The layout its section sets on `world` ranks; a ConfigError names the key of the degree at fault."""
        c = self.cfg(p)
        keys = {d: self.key(prefix, k) for d, k in self.degree_keys.items()}
        return ParallelLayout.build(world, keys=keys, where=where,
                                    **{d: getattr(c, k) for d, k in self.degree_keys.items()})

    def check_degrees(self, p, prefix: str) -> None:
        """Its degrees are >= 1 even where it is not the back end in use (a recipe switched to it later must not
        carry a silently impossible value)."""
        for degree, name in self.degree_keys.items():
            value = getattr(self.cfg(p), name)
            if value is not None and value < 1:
                raise ConfigError(f"config key '{self.key(prefix, name)}': the {DEGREE_NAMES[degree]} size must "
                                  f"be >= 1, got {value}")

    def describe(self, p) -> str:
        """Its model-parallel degrees for a one-line summary, e.g. 'tp=2'."""
        return f"tp={self.degree(p, 'tp')}"

    # ------------------------------------------------------------------------------------ validation
    def validate(self, p, prefix: str) -> None:
        """Its section's own rules, run whether or not it is the back end in use (`p.backend`)."""

    def sequence_split(self, p) -> tuple[int, str]:
        """How many ranks split each context-parallel chunk again along the sequence (1: none), and what sets
        that, for a message (' x <key> <ranks> (...)')."""
        return 1, ""

    def validate_context_parallel(self, p, prefix: str, cp: int) -> None:
        """Its rules for context_parallel_size `cp` > 1, beyond the shared ones."""

    def validate_model(self, p, hf, model_path: str, prefix: str) -> None:
        """Its rules for the model (HF config `hf`) on its layout, checked before any worker starts."""
        raise NotImplementedError

    def router_replay(self, p) -> str:
        """The Mixture-of-Experts routing replay mode of its section (none where it is not built)."""
        return "none"

    def router_replay_key(self, prefix: str = "policy") -> str:
        """The key that sets the routing replay mode (for messages)."""
        return self.key(prefix, "moe_router_replay")

    # ------------------------------------------------------------------------------------ planning
    def dense_packing_mask(self, p) -> bool:
        """Whether its attention needs a packed row's dense block-diagonal mask (beyond sequence_packing's own
        attention=mask)."""
        return False

    def model_spec(self, p, hf, scalar_head: bool, prefix: str):
        """The ModelSpec of HF config `hf` as it builds it (ValueError or ConfigError when it cannot)."""
        raise NotImplementedError

    def plan_devices(self, p, spec, workload, world: int) -> tuple[list, dict[str, float]]:
        """Its memory model: a Device (backends/memory_model.py) per kind of rank, and one rank's host memory."""
        raise NotImplementedError

    def describe_plan(self, p, layout: ParallelLayout) -> tuple[str, list[str]]:
        """The planner's name of its layout (e.g. 'TP 2 x PP 2 x DP 1') and the options on ('recompute', ...)."""
        raise NotImplementedError

    def moe_notes(self, p, spec, layout: ParallelLayout) -> list[str]:
        """Where a Mixture-of-Experts model's experts live on its ranks, and what it does not build yet."""
        return []


def backend_names() -> list[str]:
    return sorted(BACKENDS)


def backend_spec(name: str, key: str = "policy.backend") -> BackendSpec:
    """The spec registered as `name`; an unknown name is a ValueError naming `key` and listing the known ones."""
    return load_registered(BACKENDS, name, key)


def all_specs() -> list[BackendSpec]:
    """Every registered back end's spec, in registration order."""
    return [backend_spec(name) for name in BACKENDS]


def policy_layout(p, world: int, prefix: str = "policy", where: str = "") -> ParallelLayout:
    """The layout of a policy-like config (policy.*, or a reward model's section under `prefix`) on `world` ranks."""
    return backend_spec(p.backend).layout(p, world, prefix, where)


def check_degrees(p, prefix: str = "policy") -> None:
    """The degrees of every back end's section are >= 1 (in use or not)."""
    for spec in all_specs():
        spec.check_degrees(p, prefix)
