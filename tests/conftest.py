"""Session-wide fixtures: one Ray cluster and one set of tiny models per test session."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from nemo_grpo.distributed.cluster import init_ray

    init_ray()
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(arch="qwen2", scalar_head=False, **overrides) -> path of a saved HF dir (cached)."""
    from nemo_grpo.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    made = {}

    def make(arch="qwen2", scalar_head=False, **overrides):
        key = (arch, scalar_head, repr(sorted(overrides.items())))  # (values may be dicts: rope_scaling)
        if key not in made:
            name = f"{arch}{'_rm' if scalar_head else ''}_{len(made)}"
            made[key] = save_tiny_model(str(root / name), arch=arch, scalar_head=scalar_head, **overrides)
        return made[key]

    return make
