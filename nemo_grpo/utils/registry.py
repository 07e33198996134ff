"""Lazy registries: a name maps to "module:attribute", imported only when that name is used."""

from __future__ import annotations

import importlib


def load_registered(registry: dict[str, str], name: str, what: str):
    """The object registered as `name`; an unknown name lists the known ones, naming `what` (a config key)."""
    if name not in registry:
        raise ValueError(f"unknown {what} '{name}'; known: {', '.join(sorted(registry))}")
    module, attr = registry[name].split(":")
    return getattr(importlib.import_module(module), attr)
