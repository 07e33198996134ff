"""Policy back ends: each provides exactly one PolicyEngine (backends/engine.py), which the one Ray actor class of
every back end, PolicyActor (backends/actor.py), runs, and a BackendSpec, found by name in backends/registry.py."""
