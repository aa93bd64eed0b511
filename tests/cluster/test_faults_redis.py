"""redis-server stopped and restarted under routers that share the prefix index through it.

A real cluster runs with `--index redis://…` on a private redis-server (no persistence, like a plain
Deployment). A second router — its own IndexFeed reading the same stream, as another router replica
would — follows along. The server is SIGKILLed under streaming load and started again, empty, on the
same port. What must hold (the fault suite's oracle, tests/cluster/test_faults.py):
  * serving never depends on Redis: every request before, during and after the outage is exact;
  * the outage is visible: read failures counted on the router, undelivered batches on the workers;
  * afterwards the index converges by itself: each worker republishes its whole cached set as soon as
    its sink gets through, so both routers' indexes equal every worker's real cache again, and equal
    each other.
"""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from engine.kv.events import AllCleared, BlockStored
from proto.kv_codec import decode_batch
from router.routing.feed import IndexFeed
from router.routing.index import PrefixIndex
from router.routing.load import LoadTracker
from router.routing.redis_feed import RedisEventSource
from router.workers.registry import WorkerState
from tests.cluster.test_disagg_cluster import wait_for
from tests.cluster.test_faults import HANG_BOUND_S, OUT, Outcome, judge, reference, stream, workload  # noqa: F401
from tests.redis_server import RedisProcess

pytestmark = pytest.mark.slow
CONVERGE_BOUND_S = 20.0
OUTAGE_S = 4.0
SERVED: list[int] = []  # exact requests per batch, for the figures


@pytest.fixture(scope="module")
def redis_process(tmp_path_factory):
    server = RedisProcess(tmp_path_factory.mktemp("redis-fault"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(cluster_factory, redis_process):
    return cluster_factory(**{"prefill.num_workers": 2, "decode.num_workers": 1,
                              "router.local_prefill_max_tokens": 0, "router.index": redis_process.url})


def _serve(loop_thread, cluster, reference_fn, seed: int, name: str) -> Outcome:
    prompts, params = workload(seed, 8)

    async def go():
        return await asyncio.gather(*(asyncio.wait_for(stream(cluster.backend, f"{name}-{i}", p, q), HANG_BOUND_S)
                                      for i, (p, q) in enumerate(zip(prompts, params))), return_exceptions=True)

    outcome = judge(loop_thread.run(go(), timeout=HANG_BOUND_S + 30), reference_fn(prompts, params), Outcome())
    assert outcome.exact == len(prompts), (name, outcome)
    SERVED.append(outcome.exact)
    return outcome


async def _truth(cluster) -> dict[str, list[int]]:
    """Every worker's real cached set, from its own full-state snapshot."""
    truth = {}
    for rec in cluster.registry.records(states=(WorkerState.READY,)):
        _, data = await rec.client.handle.snapshot.remote()
        events = decode_batch(data).events
        assert isinstance(events[0], AllCleared)
        truth[rec.worker_id] = sorted(h for e in events if isinstance(e, BlockStored) for h in e.block_hashes)
    return truth


def _index_view(index: PrefixIndex) -> dict[str, list[int]]:
    """Each worker's device blocks (the workers here run no lower tier)."""
    return {w: by_tier["device"] for w, by_tier in index.snapshot()["workers"].items() if by_tier.get("device")}


def test_redis_restart_under_routers_sharing_the_index(cluster, redis_process, loop_thread, reference):
    feed = cluster.feed
    other = RedisEventSource(redis_process.url, IndexFeed(PrefixIndex(), LoadTracker()), block_ms=50)
    other.restore()
    loop_thread.run(_start(other))
    try:
        _serve(loop_thread, cluster, reference, 21, "redis-before")

        def converged() -> bool:
            if feed.needs_resync or other.feed.needs_resync:
                return False
            truth = {w: h for w, h in loop_thread.run(_truth(cluster)).items() if h}
            return bool(truth) and _index_view(cluster.backend.index) == truth == _index_view(other.feed.index)

        assert wait_for(converged, timeout_s=CONVERGE_BOUND_S, interval_s=0.25), "index did not match before the fault"
        errors_before = feed.counters.source_errors

        redis_process.stop()
        outage_at = time.monotonic()
        _serve(loop_thread, cluster, reference, 22, "redis-down")  # served while Redis is gone
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - outage_at)))  # long enough for the retry backoff
        _serve(loop_thread, cluster, reference, 24, "redis-still-down")
        assert feed.counters.source_errors > errors_before
        undelivered = {s["worker_id"]: s["events_undelivered"] for s in loop_thread.run(cluster.stats())}
        assert all(n > 0 for n in undelivered.values()), undelivered  # every worker saw its sink fail

        redis_process.start()  # same port, no data
        restart_at = time.monotonic()
        assert wait_for(converged, timeout_s=CONVERGE_BOUND_S, interval_s=0.25), (
            "the index did not converge after Redis came back", feed.needs_resync, other.feed.needs_resync)
        converge_s = time.monotonic() - restart_at
        # the new stream carries each worker's full state: both routers resynced every worker
        assert feed.counters.resyncs >= len(cluster.registry.records(states=(WorkerState.READY,)))
        # and it keeps flowing: new prompts land in both indexes
        _serve(loop_thread, cluster, reference, 23, "redis-after")
        assert wait_for(converged, timeout_s=CONVERGE_BOUND_S, interval_s=0.25)
        figures = {"scenario": "redis-restart", "requests": sum(SERVED), "exact": sum(SERVED),
                   "outage_s": round(restart_at - outage_at, 1),
                   "index_converged_s": round(converge_s, 1),
                   "router_read_errors": feed.counters.source_errors - errors_before,
                   "undelivered_batches": undelivered, "resyncs": feed.counters.resyncs}
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "redis-restart.json").write_text(json.dumps(figures, indent=2))
        print(json.dumps(figures))
    finally:
        loop_thread.run(other.stop())
        other.close()


async def _start(source: RedisEventSource) -> None:
    source.start(snapshot_interval_s=None)


def test_a_router_restarting_after_the_outage_rebuilds_the_same_index(cluster, redis_process, loop_thread):
    """A router replica that starts after Redis came back reads the new stream from the snapshot the
    others saved (or from 0) and ends with the same index, once every worker's full state is in."""
    late = RedisEventSource(redis_process.url, IndexFeed(PrefixIndex(), LoadTracker()))

    def same() -> bool:
        late.catch_up()
        return not late.feed.needs_resync and _index_view(late.feed.index) == _index_view(cluster.backend.index)

    late.restore()
    try:
        assert wait_for(same, timeout_s=60.0, interval_s=0.5)
        assert set(_index_view(late.feed.index)) <= {r.worker_id for r in cluster.registry.records(
            states=(WorkerState.READY,))}
    finally:
        late.close()
