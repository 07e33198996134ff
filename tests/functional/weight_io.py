"""Weights in and out through the driver, for tests only: the refitters never route tensors this way.

export_weights(policy, mb): the policy's HF-named full CPU tensors, bucket by bucket (each bucket a collective
  gather on every rank, WeightSender.gather).
update_weights(engine, buckets): load HF-named full tensors into every engine worker through its WeightSink
  (begin_refit, load_bucket per bucket, finish_refit even after a failed load).
"""

from collections.abc import Iterable, Iterator

import ray
import torch

from nemo_grpo.weights.refit import Senders
from nemo_grpo.weights.sender import WeightSender
from nemo_grpo.weights.transfer import plan_buckets


def export_weights(policy, bucket_size_mb: float) -> Iterator[dict[str, torch.Tensor]]:
    """Buckets of at most ~bucket_size_mb (>= 1 tensor each) of the policy's HF state_dict, in order."""
    senders = Senders(policy.group.actors)
    specs = senders.run(WeightSender.specs)[0]
    for names in plan_buckets([(s.name, s.nbytes) for s in specs], bucket_size_mb * 2**20):
        yield senders.run(WeightSender.gather, names)[0]


def update_weights(engine, buckets: Iterable[dict[str, torch.Tensor]]) -> None:
    """Load `buckets` in place into the running engine (no restart); any bucket boundary is fine."""
    workers = engine.workers()
    ray.get([w.begin_refit.remote() for w in workers])
    try:
        for bucket in buckets:
            ray.get([w.load_bucket.remote(bucket) for w in workers])
    finally:
        ray.get([w.finish_refit.remote() for w in workers])  # always closed, so the engine can generate
