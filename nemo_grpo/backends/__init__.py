"""Policy back ends: each provides exactly one PolicyWorker subclass and a BackendSpec, found by name in
backends/registry.py."""
