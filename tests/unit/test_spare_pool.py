"""SpareWorkers' bookkeeping (nemo_grpo/distributed/spare_workers.py), with stand-ins for actors and placement
groups: a key gets its most recently kept group, and the least recently kept groups are killed beyond the cap."""

from nemo_grpo.distributed import spare_workers
from nemo_grpo.distributed.spare_workers import SpareGroup, SpareWorkers


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
