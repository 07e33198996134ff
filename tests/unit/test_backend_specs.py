"""The back-end registry (nemo_grpo/backends/registry.py): every spec names a section the config has, keys that
section has, a PolicyEngine it can import (run by the one PolicyActor), and is light to import itself."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util

import pytest

from nemo_grpo.backends.registry import BACKENDS, all_specs, backend_spec, policy_layout
from nemo_grpo.config import PolicyConfig, RewardModelEnvConfig
from nemo_grpo.errors import ConfigError


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_a_spec_names_its_section_and_keys(name):
    spec = backend_spec(name)
    assert spec.name == name
    for schema in (PolicyConfig, RewardModelEnvConfig):  # a reward model's section holds the same sections
        section = {f.name: f for f in dataclasses.fields(schema)}[spec.section]
        keys = {f.name for f in dataclasses.fields(section.default_factory())}
        assert set(spec.degree_keys.values()) <= keys, (schema.__name__, spec.section)
        assert set(spec.degree_keys) <= {"tp", "pp", "cp", "dp"}


def test_a_spec_imports_its_engine_on_first_use_and_every_back_end_runs_in_the_policy_actor():
    from nemo_grpo.backends.actor import PolicyActor
    from nemo_grpo.backends.engine import PolicyEngine

    for spec in all_specs():
        assert issubclass(spec.engine_class(), PolicyEngine)
        assert spec.worker_class() is PolicyActor


def _top_level_imports(module: str) -> set[str]:
    """Dotted names a module imports when it is imported (its top-level statements, not its functions')."""
    path = importlib.util.find_spec(module).origin
    out = set()
    if path is None:  # a namespace package: no code
        return out
    for node in ast.parse(open(path).read()).body:
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else ():
            if isinstance(sub, ast.Import):
                out.update(a.name for a in sub.names)
            elif isinstance(sub, ast.ImportFrom) and sub.module:
                out.update(f"{sub.module}.{a.name}" for a in sub.names)
    return out


def test_specs_are_light_to_import():
    """The driver imports every spec to validate and plan: what importing them imports (read with ast,
    transitively through nemo_grpo) holds no torch, Megatron or transformers."""
    seen, outside = set(), set()
    todo = ["nemo_grpo.backends.registry", *(v.split(":")[0] for v in BACKENDS.values())]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += [module.rsplit(".", k)[0] for k in range(1, module.count(".") + 1)]  # its packages' __init__ run first
        for name in _top_level_imports(module):
            if not name.startswith("nemo_grpo"):
                outside.add(name.split(".")[0])
                continue
            todo.append(name if _is_module(name) else name.rpartition(".")[0])  # a module, or a name in one
    assert {"nemo_grpo.backends.mcore.spec", "nemo_grpo.models.spec"} <= seen
    assert outside & {"torch", "megatron", "transformers"} == set(), outside


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown policy.backend 'x'; known: dtensor, megatron"):
        backend_spec("x")


def test_layout_names_the_section_key_of_the_degree_at_fault():
    for spec in all_specs():
        p = PolicyConfig(backend=spec.name)
        setattr(spec.cfg(p), spec.degree_keys["tp"], 3)
        with pytest.raises(ConfigError, match=f"'policy.{spec.section}.{spec.degree_keys['tp']}'"):
            policy_layout(p, 4)
