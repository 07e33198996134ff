"""Lazy registries: a name maps to "module:attribute", imported only when that name is used."""

from __future__ import annotations

import importlib


def load_registered(registry: dict[str, str], name: str, what: str):
    """The object registered as `name`; an unknown name lists the known ones, naming `what` (a config key)."""
    if name not in registry:
        raise ValueError(f"unknown {what} '{name}'; known: {', '.join(sorted(registry))}")
    module, attr = registry[name].split(":")
    return getattr(importlib.import_module(module), attr)


def registrar(registry: dict, what: str):
    """A decorator factory that adds a class or function to `registry` under a name: `@register("name")`.
    A name registered twice is a bug, reported naming `what`."""

    def register(name: str):
        def add(obj):
            if name in registry:
                raise ValueError(f"{what} '{name}' is registered twice ({registry[name].__name__}, {obj.__name__})")
            registry[name] = obj
            return obj

        return add

    return register
