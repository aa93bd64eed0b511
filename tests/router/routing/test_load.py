import pytest

from engine.kv.events import WorkerLoad
from router.routing.load import LoadEstimate, LoadTracker


def report(worker, *, running=0, waiting=0, used=0, total=100, queued=0):
    return WorkerLoad(worker, "prefill", running, waiting, used, total, queued)


def test_dispatch_prefill_done_finish():
    t = LoadTracker()
    t.dispatch("r1", "p0", num_prefill_tokens=100, num_kv_blocks=7)
    t.dispatch("r2", "p0", num_prefill_tokens=50, num_kv_blocks=4)
    assert t.get("p0") == LoadEstimate(150, 2, 11, None)
    assert t.prefill_done("r1", "p0")
    assert not t.prefill_done("r1", "p0")  # once only
    assert t.get("p0") == LoadEstimate(50, 2, 11, None)
    assert t.finish("r1", "p0")
    assert t.get("p0") == LoadEstimate(50, 1, 4, None)
    assert t.finish("r2", "p0")  # finishing before prefill_done also drops its queued tokens
    assert t.get("p0") == LoadEstimate(0, 0, 0, None)
    assert not t.finish("r2", "p0")  # idempotent
    assert t.num_inflight() == 0


def test_requests_on_a_worker():
    t = LoadTracker()
    t.dispatch("r1", "d0", num_prefill_tokens=0, num_kv_blocks=3)
    t.dispatch("r1", "p0", num_prefill_tokens=10, num_kv_blocks=3)
    t.dispatch("r2", "d0", num_prefill_tokens=0, num_kv_blocks=3)
    assert sorted(t.requests_on("d0")) == ["r1", "r2"] and t.requests_on("p0") == ["r1"]
    t.finish("r1", "d0")
    assert t.requests_on("d0") == ["r2"] and t.requests_on("nobody") == []


def test_unknown_worker_is_idle_and_duplicate_dispatch_refused():
    t = LoadTracker()
    assert t.get("nobody") == LoadEstimate()
    t.dispatch("r", "d0", num_prefill_tokens=0, num_kv_blocks=3)
    with pytest.raises(ValueError):
        t.dispatch("r", "d0", num_prefill_tokens=0, num_kv_blocks=3)
    t.dispatch("r", "p0", num_prefill_tokens=10, num_kv_blocks=3)  # same request on its other worker
    assert t.estimates(["d0", "p0"]) == {"d0": LoadEstimate(0, 1, 3), "p0": LoadEstimate(10, 1, 3)}
    with pytest.raises(ValueError):
        t.dispatch("x", "p0", num_prefill_tokens=-1, num_kv_blocks=0)


def test_report_adds_only_foreign_load_and_own_changes_show_at_once():
    t = LoadTracker()
    t.dispatch("r1", "p0", num_prefill_tokens=100, num_kv_blocks=5)
    # the worker sees our 100 tokens plus 300 from another router
    t.report(report("p0", running=3, waiting=1, used=20, total=64, queued=400))
    assert t.get("p0") == LoadEstimate(400, 4, 20, 64)
    # our dispatch after the report shows immediately, without waiting for the next report
    t.dispatch("r2", "p0", num_prefill_tokens=60, num_kv_blocks=2)
    assert t.get("p0") == LoadEstimate(460, 5, 22, 64)
    t.finish("r1", "p0")
    assert t.get("p0") == LoadEstimate(360, 4, 17, 64)
    # a report that lags behind our own bookkeeping never makes the load negative or drop ours
    t.report(report("p0", queued=0, used=0, total=64))
    assert t.get("p0") == LoadEstimate(60, 1, 2, 64)


def test_remove_worker_returns_its_requests():
    t = LoadTracker()
    t.dispatch("a", "p0", num_prefill_tokens=1, num_kv_blocks=1)
    t.dispatch("b", "p1", num_prefill_tokens=1, num_kv_blocks=1)
    assert t.remove_worker("p0") == ["a"]
    assert t.workers == ["p1"] and t.get("p0") == LoadEstimate()
    assert not t.finish("a", "p0")
    assert t.num_inflight() == 1
