"""Two router processes on one Redis stream decide alike, and a late router restores from the snapshot.

The test replays the Mooncake trace through real BlockPools and makes each routing decision in both router
processes at an agreed stream position: the publisher (this process) is the only writer, it publishes a
step's batches, reads the stream's last id, and asks both routers to route once they have applied the
stream up to that id. It waits for both answers before it publishes again, so both decide on exactly the
same events. The Redis server is real (conftest.py).
"""
from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import time
import traceback
from dataclasses import asdict

import pytest
import redis

from bench.sim.trace_replay import SimWorker, load_trace
from bench.workloads import TRACE
from engine.kv.block_pool import BlockPool
from engine.kv.events import WorkerLoad
from prefill_worker.event_sinks import RedisEventSink
from proto.kv_codec import encode_batch
from router.routing.policy import CacheAwarePolicy, Role, route
from router.routing.redis_feed import RedisEventSource
from tests.router.routing.test_feed import NAMES, B, new_feed

assert TRACE.exists(), f"Mooncake trace not found at {TRACE}"

class _Router:
    """One router: its own index, tracker and feed, fed from the shared stream. Routes with cache_aware; its
    load comes only from the workers' reports (no dispatch bookkeeping), so routers can be compared."""

    def __init__(self, url: str, stream: str, snapshot_key: str) -> None:
        self.feed = new_feed()
        self.source = RedisEventSource(url, self.feed, stream, snapshot_key, block_ms=20)
        self.policy = CacheAwarePolicy(B)

    def handle(self, cmd: str, arg):
        if cmd == "restore":
            return self.source.restore()
        if cmd == "save":
            return self.source.save_snapshot()
        if cmd == "route":
            d = route(self.policy, self.feed.index, self.feed.tracker, Role.PREFILL, NAMES, arg, len(arg) * B)
            return d.worker, d.overlap_blocks, d.peer, d.peer_blocks  # the peer too: ties broken alike
        if cmd == "state":
            return {"index": self.feed.index.snapshot(), "seqs": self.feed.last_seqs, "last_id": self.source.last_id,
                    "needs_resync": sorted(self.feed.needs_resync), "counters": asdict(self.feed.counters)}
        raise ValueError(cmd)


def _answer(conn, router: _Router, cmd, arg) -> None:
    try:
        conn.send((True, router.handle(cmd, arg)))
    except Exception:
        conn.send((False, traceback.format_exc()))


def _serve_polling(router: _Router, conn) -> None:
    while (msg := conn.recv())[0] != "stop":
        cmd, target, arg = msg
        while target and not router.source.has_reached(target):
            router.source.poll_once(block_ms=20)
        _answer(conn, router, cmd, arg)


async def _serve_task(router: _Router, conn) -> None:
    loop = asyncio.get_running_loop()
    router.source.start(snapshot_interval_s=None)  # snapshots only when the test says so
    while (msg := await loop.run_in_executor(None, conn.recv))[0] != "stop":
        cmd, target, arg = msg
        while target and not router.source.has_reached(target):
            await asyncio.sleep(0.0005)
        _answer(conn, router, cmd, arg)
    await router.source.stop()


def _router_main(url: str, stream: str, snapshot_key: str, mode: str, conn) -> None:
    router = _Router(url, stream, snapshot_key)
    if mode == "task":
        asyncio.run(_serve_task(router, conn))
    else:
        _serve_polling(router, conn)


class _RouterProcess:
    def __init__(self, url: str, stream: str, snapshot_key: str, mode: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_router_main, args=(url, stream, snapshot_key, mode, child), daemon=True)
        self.proc.start()
        child.close()

    def send(self, cmd: str, target: str | None = None, arg=None) -> None:
        self.conn.send((cmd, target, arg))

    def recv(self):
        assert self.conn.poll(30), "router process did not answer within 30 s"
        ok, value = self.conn.recv()
        assert ok, value
        return value

    def ask(self, cmd: str, target: str | None = None, arg=None):
        self.send(cmd, target, arg)
        return self.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop", None, None))
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


class _Publisher:
    """Simulated prefill workers (real BlockPools, bench_routing_trace's service model) publishing their events
    and load through RedisEventSinks, one batch per worker per step that changed something."""

    def __init__(self, url: str, stream: str, capacity_blocks: int) -> None:
        self.stream = stream
        self.workers = [SimWorker(n, BlockPool(capacity_blocks, worker_id=n), B, 8000.0) for n in NAMES]
        self.sinks = {n: pickle.loads(pickle.dumps(RedisEventSink(url, stream))) for n in NAMES}
        self.seq = dict.fromkeys(NAMES, 0)
        self.sent_load: dict[str, WorkerLoad] = {}
        self.client = redis.Redis.from_url(url)

    @staticmethod
    def load(w: SimWorker) -> WorkerLoad:
        queued = [req for _, req in w.queue] + ([w.current.req] if w.current else [])
        return WorkerLoad(w.name, "prefill", int(w.current is not None), len(w.queue), w.pool.num_used_blocks,
                          w.pool.num_blocks, sum(len(r.block_hashes) * B for r in queued))

    def publish(self, w: SimWorker, events, *, drop: bool = False) -> None:
        self.seq[w.name] += 1
        load = self.sent_load[w.name] = self.load(w)
        if not drop:
            self.sinks[w.name].publish(w.name, self.seq[w.name], encode_batch(w.name, self.seq[w.name], events, load,
                                                                               time.time()))

    def step(self, now_s: float) -> None:
        for w in self.workers:
            w.advance(now_s, lambda *a: None, lambda *a: None)
            events = w.pool.take_events()
            if events or self.load(w) != self.sent_load.get(w.name):
                self.publish(w, events)

    def stream_end(self) -> str:
        return self.client.xrevrange(self.stream, count=1)[0][0].decode()

    def truth(self) -> dict[str, dict[str, list[int]]]:
        """Every worker's cached blocks as an index snapshot names them (one tier: device)."""
        held = {w.name: sorted(b.block_hash for b in w.pool.blocks if b.block_hash is not None) for w in self.workers}
        return {name: {"device": hashes} if hashes else {} for name, hashes in held.items()}


@pytest.mark.slow
def test_two_router_processes_decide_identically_and_a_late_router_restores(redis_url):
    stream, key = "t:kv", "t:kv:snap"
    reqs = load_trace(TRACE, limit=500, block_size=B)
    pub = _Publisher(redis_url, stream, capacity_blocks=1024)
    a, b = _RouterProcess(redis_url, stream, key, "task"), _RouterProcess(redis_url, stream, key, "poll")
    routers = [a, b]
    try:
        decisions = []
        for i, req in enumerate(reqs):
            pub.step(req.arrival_s)
            if i == 100:  # junk in the stream: counted, skipped, by both
                pub.client.xadd(stream, {"b": b"\xff\x00junk"})
                pub.client.xadd(stream, {"x": b"1"})
            if i == 200:  # w1 loses a batch; the next one reveals the gap
                pub.publish(pub.workers[1], pub.workers[1].pool.take_events(), drop=True)
                pub.publish(pub.workers[1], [])
            if i == 210:  # w1 resyncs in-band: its full state as its next batch
                pub.workers[1].pool.take_events()
                pub.publish(pub.workers[1], pub.workers[1].pool.snapshot_events())
            end = pub.stream_end()
            for r in routers:
                r.send("route", end, req.block_hashes)
            answers = [r.recv() for r in routers]
            assert answers[0] == answers[1], f"decision {i}: {answers}"
            decisions.append(answers[0])
            pub.workers[NAMES.index(answers[0][0])].queue.append((i, req))
            if i == 150:
                assert a.ask("save", end) is True
            if i == 205:
                assert [r.ask("state", end)["needs_resync"] for r in routers] == [["w1"], ["w1"]]
        assert len({d[0] for d in decisions}) > 1, "every request went to one worker"
        assert sum(1 for d in decisions if d[1]) > len(reqs) // 2, "too few cache hits"
        assert sum(1 for d in decisions if d[1] > 1) >= 10, "too few hits beyond the shared first block"
        assert sum(1 for d in decisions if d[2] is not None) >= 10, "too few decisions with a peer"

        pub.step(float("inf"))
        end = pub.stream_end()
        state_a, state_b = a.ask("state", end), b.ask("state", end)
        assert state_a == state_b
        assert state_a["index"]["workers"] == pub.truth()  # exact, after the gap and the resync
        assert state_a["needs_resync"] == [] and state_a["seqs"] == pub.seq
        counters = state_a["counters"]
        assert (counters["malformed"], counters["gaps"], counters["resyncs"], counters["stale"]) == (2, 1, 1, 0)

        c = _RouterProcess(redis_url, stream, key, "poll")  # started late: snapshot (taken at 150) + stream
        routers.append(c)
        assert c.ask("restore") is True
        state_c = c.ask("state", end)
        assert {k: state_c[k] for k in ("index", "seqs", "needs_resync", "last_id")} == \
               {k: state_a[k] for k in ("index", "seqs", "needs_resync", "last_id")}
        for req in reqs[-20:]:  # same index and load reports: same decisions
            for r in routers:
                r.send("route", end, req.block_hashes)
            assert len({repr(r.recv()) for r in routers}) == 1

        scratch = RedisEventSource(redis_url, new_feed(), stream, "t:kv:no-snapshot")
        assert scratch.restore() is False  # the whole stream from 0
        assert scratch.feed.index.snapshot() == state_a["index"] and scratch.feed.needs_resync == frozenset()
        scratch.close()
    finally:
        for r in routers:
            r.stop()
        pub.client.close()
        for sink in pub.sinks.values():
            sink.close()
