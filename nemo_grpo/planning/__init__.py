"""Planning a run before a cluster is spent: parameter counts and per-GPU memory of every role."""
