"""The weight-transfer group and its bucket layout: packing, a real gloo group (threads as members), and the
engine-side receiver's protocol (every bucket received even after a failed load)."""

import os
import threading
import time

import pytest
import torch

from nemo_grpo.weights import transfer as wt
from nemo_grpo.weights.transfer import TensorSpec
from nemo_grpo.config import ConfigError, GenerationConfig
from nemo_grpo.weights.receiver import WeightReceiver
from nemo_grpo.weights.refit import _raise_if_a_receiver_died, check_generation_resources

TIMEOUT_S = 60.0


def mixed_bucket(seed: int) -> tuple[list[TensorSpec], dict[str, torch.Tensor]]:
    """Interleaved dtypes (fp32, bf16, int64, fp32), shapes of rank 0..2."""
    g = torch.Generator().manual_seed(seed)
    tensors = {"a.weight": torch.randn(3, 4, generator=g), "b.weight": torch.randn(5, generator=g).bfloat16(),
               "c.index": torch.randint(0, 100, (2, 2), generator=g), "d.scale": torch.randn((), generator=g)}
    return [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], tensors


def packed(tensors: dict[str, torch.Tensor], bucket: list[TensorSpec]) -> list[torch.Tensor]:
    """What a sender broadcasts: the bucket's tensors filled into its flat buffers."""
    flats = wt.empty_buffers(bucket, torch.device("cpu"))
    wt.fill(wt.unpack(flats, bucket), tensors, bucket)
    return flats


def test_fill_unpack_round_trip_one_buffer_per_dtype():
    bucket, tensors = mixed_bucket(0)
    flats = packed(tensors, bucket)
    assert [f.dtype for f in flats] == [torch.float32, torch.bfloat16, torch.int64]  # first appearance
    assert [f.numel() for f in flats] == [12 + 1, 5, 4]
    assert sum(f.numel() * f.element_size() for f in flats) == sum(s.nbytes for s in bucket)
    views = wt.unpack(flats, bucket)
    assert list(views) == list(tensors)
    for name, t in tensors.items():
        assert views[name].dtype == t.dtype and torch.equal(views[name], t)
    views["a.weight"][0, 0] = 42.0  # views, not copies
    assert flats[0][0] == 42.0
    assert [tuple(b.shape) for b in wt.empty_buffers(bucket, torch.device("cpu"))] == [(13,), (5,), (4,)]


def test_region_holds_every_bucket_aligned_and_views_share_its_memory():
    plan = [mixed_bucket(0)[0], mixed_bucket(1)[0]]
    offsets, nbytes = wt.region_layout(plan)
    assert all(o % wt.ALIGN == 0 for starts in offsets for o in starts)
    assert offsets == [[0, 64, 128], [192, 256, 320]] and nbytes == 384  # 52, 10 and 32 bytes, each rounded up
    region = torch.zeros(nbytes, dtype=torch.uint8)
    buffers = wt.bucket_buffers(region, plan)
    for (bucket, tensors), flats in zip([mixed_bucket(0), mixed_bucket(1)], buffers):
        for name, view in wt.unpack(flats, bucket).items():
            view.copy_(tensors[name])
    for (bucket, tensors), flats in zip([mixed_bucket(0), mixed_bucket(1)], wt.bucket_buffers(region, plan)):
        assert all(torch.equal(v, tensors[n]) for n, v in wt.unpack(flats, bucket).items())


def test_cast_plan_casts_floating_tensors_only():
    bucket = mixed_bucket(0)[0]
    cast = wt.cast_plan([bucket], torch.bfloat16)[0]
    assert [s.dtype for s in cast] == [torch.bfloat16, torch.bfloat16, torch.int64, torch.bfloat16]
    assert [s.shape for s in cast] == [s.shape for s in bucket]
    assert wt.cast_plan([bucket], None) == [bucket]


def test_shared_region_is_seen_by_a_second_mapping_and_outlives_its_file():
    region = wt.SharedRegion.create(256)
    other = wt.SharedRegion(region.path, 256)
    region.unlink()
    region.tensor[:8] = 7  # after the file is gone, the mappings still share the memory
    assert other.tensor[:8].tolist() == [7] * 8 and not os.path.exists(region.path)


def test_fill_names_a_tensor_that_does_not_match_the_plan():
    bucket, tensors = mixed_bucket(0)
    flats = wt.empty_buffers(bucket, torch.device("cpu"))
    wrong_shape = dict(tensors, **{"b.weight": tensors["b.weight"][None]})  # copy_ alone would broadcast it
    with pytest.raises(ValueError, match="b.weight"):
        wt.fill(wt.unpack(flats, bucket), wrong_shape, bucket)
    wrong_dtype = dict(tensors, **{"c.index": tensors["c.index"].float()})  # not a floating-point cast
    with pytest.raises(ValueError, match="c.index"):
        wt.fill(wt.unpack(flats, bucket), wrong_dtype, bucket)
    cast = dict(tensors, **{"b.weight": tensors["b.weight"].float()})  # fp32 into the plan's bf16: cast
    wt.fill(wt.unpack(flats, bucket), cast, bucket)
    assert torch.equal(wt.unpack(flats, bucket)["b.weight"], tensors["b.weight"])


class ListSink:
    """A WeightSink that records the buckets it loads; fails to load bucket `fail_at`; accepts `names` (None: any)."""

    def __init__(self, fail_at=None, names=None):
        self.loaded, self.fail_at, self.events, self.names = [], fail_at, [], names

    def weight_names(self):
        return self.names

    def takes_adapters(self):
        return False

    def weight_dtype(self):
        return torch.float32

    def weight_device(self):
        return torch.device("cpu")

    def prepare_for_refit(self):
        self.events.append("prepare")

    def begin_refit(self):
        self.events.append("begin")

    def finish_refit(self):
        self.events.append("finish")
        return 0

    def load_bucket(self, bucket):
        if len(self.loaded) == self.fail_at:
            raise KeyError("bad bucket")
        self.loaded.append({k: v.clone() for k, v in bucket.items()})
        return len(bucket)


def run_members(fns):
    """Run each fn in its own thread (group members block in join until all arrive); results or exceptions."""
    results = [None] * len(fns)

    def run(i):
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a member is stuck"
    return results


def test_broadcast_reaches_every_receiver_and_a_failed_load_does_not_stall_the_sender():
    plan, buckets = zip(*(mixed_bucket(seed) for seed in range(3)))
    plan = list(plan)
    store, port = wt.open_store("127.0.0.1", TIMEOUT_S)
    receivers = [WeightReceiver(ListSink()), WeightReceiver(ListSink(fail_at=1))]

    def sender():
        group = wt.join_group("", 0, 0, 3, "gloo", TIMEOUT_S, store=store)
        for bucket, tensors in zip(plan, buckets):
            wt.broadcast(group, packed(tensors, bucket))
        return "sent"

    def receiver(r):
        def fn():
            r.join_transfer("127.0.0.1", port, 1 + receivers.index(r), 3, "gloo", plan, TIMEOUT_S)
            return r.receive()
        return fn

    sent, ok, failed = run_members([sender] + [receiver(r) for r in receivers])
    assert sent == "sent"
    assert ok == sum(len(b) for b in plan)
    assert all(torch.equal(got[k], want[k]) for got, want in zip(receivers[0].sink.loaded, buckets) for k in want)
    assert isinstance(failed, KeyError)  # raised after the last bucket was received ...
    assert len(receivers[1].sink.loaded) == 1 and receivers[1].sink.events == ["begin", "finish"]  # ... and closed


def test_receiver_checks_names_before_joining():
    receiver = WeightReceiver(ListSink(names={"a.weight"}))
    with pytest.raises(KeyError, match="no parameter"):
        receiver.join_transfer("127.0.0.1", 1, 1, 2, "gloo", [mixed_bucket(0)[0]], TIMEOUT_S)


def test_non_colocated_generation_on_gpus_needs_its_resources():
    cfg = GenerationConfig()
    cfg.colocated.enabled = False
    check_generation_resources(cfg, on_gpus=False)  # a CPU cluster: actors are scheduling slots
    with pytest.raises(ConfigError, match="policy.generation.colocated.resources.gpus_per_node"):
        check_generation_resources(cfg, on_gpus=True)
    cfg.colocated.resources.gpus_per_node, cfg.colocated.resources.num_nodes = 4, 1
    check_generation_resources(cfg, on_gpus=True)


class Stepper(ListSink):
    """An engine worker whose forward steps record the weight version they ran with; a refit (of an empty plan)
    bumps it."""

    def __init__(self, in_flight: bool):
        super().__init__()
        self.weight_receiver = WeightReceiver(self, in_flight)
        self.weight_receiver._receiver = {"plan": []}  # joined a transfer of no buckets
        self.version, self.seen = 0, []

    def generate(self, steps: int) -> None:
        with self.weight_receiver.generation():
            for _ in range(steps):
                with self.weight_receiver.model_turn():
                    self.seen.append(self.version)
                    time.sleep(0.001)

    def begin_refit(self):
        self.version += 1


def test_an_in_flight_refit_lands_between_two_forward_steps():
    worker = Stepper(in_flight=True)
    gen = threading.Thread(target=worker.generate, args=(300,))
    gen.start()
    while len(worker.seen) < 20:
        time.sleep(0.001)
    worker.weight_receiver.receive()  # waits for the step under way, then goes before the next
    gen.join()
    assert worker.seen[0] == 0 and worker.seen[-1] == 1 and worker.seen == sorted(worker.seen)
    assert 20 <= worker.seen.index(1) < 300 and worker.weight_receiver.refits_mid_generation() == 1
    worker.weight_receiver.receive()  # between generations: not counted
    assert worker.weight_receiver.refits_mid_generation() == 1


def test_without_in_flight_updates_the_model_turn_is_free():
    worker = Stepper(in_flight=False)
    with worker.weight_receiver.model_turn():
        worker.weight_receiver.receive()  # no lock: the actor runs one call at a time anyway
    assert worker.version == 1


def test_a_dead_receiver_is_reported_rather_than_the_senders_symptom(ray_cluster):
    """A refit's sender fails first (gloo: connection reset) when an engine actor dies mid-broadcast; the
    refitter then reports the dead receiver (a RayActorError, which the trainer turns into GenerationFailed)."""
    import ray

    @ray.remote(num_cpus=0)
    class Receiver:
        def receive(self, seconds: float) -> None:
            import time

            time.sleep(seconds)

    alive, dying = Receiver.remote(), Receiver.remote()
    ray.get([alive.receive.remote(0), dying.receive.remote(0)])  # both started
    refs = [alive.receive.remote(0), dying.receive.remote(60)]
    ray.kill(dying)
    with pytest.raises(ray.exceptions.RayActorError):
        _raise_if_a_receiver_died(refs, grace_s=30)
    _raise_if_a_receiver_died([alive.receive.remote(0)], grace_s=30)  # all alive: nothing to report
    ray.kill(alive)
