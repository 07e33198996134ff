"""SpareWorkers' bookkeeping (nemo_grpo/distributed/spare_workers.py), with stand-ins for actors and placement
groups: a key gets its most recently kept group, and the least recently kept groups are killed beyond the cap;
only the classes named are recycled; and what runs in an actor to tear it down and restart it."""

import os

from nemo_grpo.distributed import spare_workers
from nemo_grpo.distributed.spare_workers import Recycling, SpareGroup, SpareWorkers


def test_take_returns_the_newest_group_of_its_key_and_keep_kills_the_oldest_beyond_the_cap(monkeypatch):
    killed = []
    monkeypatch.setattr(spare_workers, "kill_actors", lambda actors, pg, name: killed.append((actors, pg)))
    spares = SpareWorkers(max_workers=4)
    spares.keep("dtensor x2", SpareGroup(["a0", "a1"], "pg-a"))
    spares.keep("megatron x1", SpareGroup(["b0"], "pg-b"))
    spares.keep("dtensor x2", SpareGroup(["c0", "c1"], "pg-c"))  # 5 workers: the oldest group goes
    assert killed == [(["a0", "a1"], "pg-a")]
    assert spares.take("dtensor x2").actors == ["c0", "c1"] and spares.restarts == 1
    assert spares.take("dtensor x2") is None and spares.take("megatron x2") is None
    spares.clear()
    assert killed[-1] == (["b0"], "pg-b") and spares.groups == []


def test_install_returns_the_previous_spares():
    spares = SpareWorkers(max_workers=2)
    previous = spare_workers.install(spares)
    try:
        assert spare_workers.installed() is spares
    finally:
        assert spare_workers.install(previous) is spares


def test_only_the_classes_named_are_recycled_and_their_kind_is_part_of_the_key():
    class Recycled:
        pass

    class Other:
        pass

    spares = SpareWorkers(max_workers=2, recycle={Recycled: Recycling(kind=lambda kwargs: kwargs["backend"])})
    assert spares.key(Other, {"backend": "dtensor"}, 2) is None
    assert spares.key(Recycled, {"backend": "dtensor"}, 2) == (Recycled, "dtensor", 2)
    assert spares.key(Recycled, {"backend": "dtensor"}, 2) != spares.key(Recycled, {"backend": "megatron"}, 2)
    assert SpareWorkers(1, {Recycled: Recycling()}).key(Recycled, {}, 2) == (Recycled, None, 2)


def test_teardown_releases_then_clears_and_restart_runs_the_constructor_again(monkeypatch):
    """What the spares run in an actor (through __ray_call__), on a plain object in this process."""
    class Rank:
        def __init__(self, rank: int):
            self.rank, self.model = rank, object()

    released = []
    actor = Rank(0)
    spare_workers.teardown(actor, lambda a: released.append(a.rank))
    assert released == [0] and actor.__dict__ == {}
    monkeypatch.setenv("RANK", "0")  # (restored after the test)
    spare_workers.restart(actor, {"RANK": "1"}, (1,), {})
    assert actor.rank == 1 and os.environ["RANK"] == "1"
