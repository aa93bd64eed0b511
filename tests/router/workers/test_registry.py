"""The worker registry's lifecycle (router/workers/registry.py): the one list of workers everything reads."""
from __future__ import annotations

import pytest

from engine.kv.events import WorkerLoad
from router.routing.policy import Role
from router.workers.registry import RegistryError, WorkerRegistry, WorkerState


def test_lifecycle_and_views():
    reg = WorkerRegistry()
    reg.add("p0", Role.PREFILL, 0.0, pid=1)
    reg.add("d0", Role.DECODE, 0.0)
    assert reg.ready(Role.PREFILL) == [] and [r.worker_id for r in reg.live()] == ["p0", "d0"]
    reg.mark_ready("p0", 2.0, client="c", node="host")
    rec = reg.get("p0")
    assert (rec.state, rec.client, rec.pid, rec.node, rec.age_s(5.0)) == (WorkerState.READY, "c", 1, "host", 3.0)
    assert reg.get("d0").age_s(5.0) == 0.0  # not ready yet: no warm-up clock running
    reg.mark_draining("p0", "scale-down")
    assert reg.ready(Role.PREFILL) == [] and reg.get("p0").reason == "scale-down"
    assert reg.mark_dead("p0", "drained", 9.0, fault=False).fault is False
    assert reg.mark_dead("p0", "again", 9.5, fault=True) is None  # idempotent
    counts = reg.counts()
    assert counts[(Role.PREFILL, WorkerState.DEAD)] == 1 and counts[(Role.DECODE, WorkerState.STARTING)] == 1
    assert sum(counts.values()) == 2


@pytest.mark.parametrize("steps", [
    [("mark_draining", "x")],                       # starting -> draining
    [("mark_ready", 1.0), ("mark_ready", 2.0)],      # ready twice
])
def test_illegal_transitions_are_refused(steps):
    reg = WorkerRegistry()
    reg.add("w", Role.DECODE, 0.0)
    with pytest.raises(RegistryError):
        for name, arg in steps:
            getattr(reg, name)("w", arg)


def test_dead_workers_come_back_only_as_new_records_and_history_is_trimmed():
    reg = WorkerRegistry(max_dead=2)
    with pytest.raises(RegistryError):
        reg.get("nobody")
    for i in range(4):
        reg.add(f"w{i}", Role.DECODE, 0.0)
        reg.mark_dead(f"w{i}", "crashed", float(i), fault=True)
    assert [r.worker_id for r in reg.records()] == ["w2", "w3"]  # the oldest dead records are forgotten
    reg.add("w3", Role.DECODE, 5.0)  # the same id may start again once its record is dead
    with pytest.raises(RegistryError, match="already registered"):
        reg.add("w3", Role.DECODE, 6.0)


def test_loads_and_stats_land_on_live_records_only():
    reg = WorkerRegistry()
    reg.add("d0", Role.DECODE, 0.0)
    reg.mark_ready("d0", 0.0)
    load = WorkerLoad(worker="d0", role="decode", running=3, waiting=1, kv_blocks_used=10, kv_blocks_total=40,
                      queued_prefill_tokens=0)
    reg.update_load(load, 1.0)
    reg.update_load(WorkerLoad(worker="ghost", role="decode", running=1, waiting=0, kv_blocks_used=0,
                               kv_blocks_total=1, queued_prefill_tokens=0), 1.0)
    reg.update_stats("d0", {"num_requests": 4}, 1.5)
    summary = reg.get("d0").summary(2.0)
    assert (summary["running"], summary["waiting"], summary["kv_blocks_used"], summary["load_age_s"]) == (3, 1, 10, 1.0)
    assert summary["stats"] == {"num_requests": 4} and "ghost" not in reg
    reg.mark_dead("d0", "crashed", 3.0, fault=True)
    reg.update_stats("d0", {"num_requests": 0}, 4.0)
    assert reg.get("d0").stats == {"num_requests": 4}  # a dead worker's last word stays
