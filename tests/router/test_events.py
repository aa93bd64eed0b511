"""The event plane: worker-side logs and sinks, the router's IndexFeed, and the shared Redis index.

The Redis tests run a real redis-server (conftest.py); two router processes on one stream are in
test_events_two_routers.py.
"""
from __future__ import annotations

import asyncio
import pickle
import socket
import subprocess
import sys
import threading
import time

import pytest
import redis

from engine.block_pool import BlockPool
from engine.kv_events import AllCleared, BlockRemoved, BlockStored, WorkerLoad
from proto.kv_codec import decode_batch, encode_batch
from router.events import FeedCounters, IndexFeed, MemoryEventLog, RedisEventSink, parse_stream_id
from router.index import PrefixIndex, TierMatch
from router.load import LoadTracker
from router.redis_events import RedisEventSource
from tests.redis_server import RedisProcess

B = 16
NAMES = ["w0", "w1", "w2", "w3"]


def batch(worker, seq, events=(), load=None, ts=0.0) -> bytes:
    return encode_batch(worker, seq, list(events), load, ts)


def stored(worker, *hashes, parent=None):
    return BlockStored(worker, tuple(hashes), parent)


def dev(**blocks):
    """Matches of workers holding device blocks only: dev(w0=3) == {"w0": TierMatch(device=3)}."""
    return {w: TierMatch(device=n) for w, n in blocks.items()}


def held(index, worker):
    """The hashes the index says ``worker`` holds on its device tier."""
    return index.snapshot()["workers"][worker].get("device", [])


def new_feed() -> IndexFeed:
    return IndexFeed(PrefixIndex(), LoadTracker())


def test_events_module_imports_no_torch():
    code = "import sys, router.events; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- MemoryEventLog ---------------------------------------------------------------------------------
def test_memory_log_reads_in_order_and_pages():
    log = MemoryEventLog(8)
    assert log.read(0) == ([], 0, False)
    for s in range(1, 6):
        log.publish("w0", s, bytes([s]))
    assert log.read(0, 3) == ([b"\x01", b"\x02", b"\x03"], 3, False)
    assert log.read(3, 10) == ([b"\x04", b"\x05"], 5, False)
    assert log.read(5) == ([], 5, False)


def test_memory_log_ring_truncates_a_slow_reader():
    log = MemoryEventLog(4)
    for s in range(1, 11):
        log.publish("w0", s, bytes([s]))
    assert log.read(6) == ([bytes([s]) for s in range(7, 11)], 10, False)  # just in time
    assert log.read(2) == ([bytes([s]) for s in range(7, 11)], 10, True)  # 3..6 are gone
    assert log.read(0, 2) == ([b"\x07", b"\x08"], 8, True)


def test_memory_log_restart_worker_check_and_pickle():
    log = MemoryEventLog(4)
    for s in range(1, 6):
        log.publish("w0", s, bytes([s]))
    with pytest.raises(ValueError):
        log.publish("w1", 6, b"")
    copy = pickle.loads(pickle.dumps(log))  # how the cluster ships it into the worker process
    assert copy.read(3) == log.read(3)
    copy.publish("w0", 6, b"\x06")
    assert log.read(5) == ([], 5, False)  # independent
    log.publish("w0", 1, b"new")  # a new incarnation starts over: readers ahead of it are truncated
    assert log.read(5) == ([b"new"], 1, True)
    assert log.read(1) == ([], 1, False)
    assert MemoryEventLog().read(3) == ([], 0, True)  # an empty log below the reader: it restarted


def test_memory_log_is_thread_safe():
    total = 20_000
    small, big = MemoryEventLog(64), MemoryEventLog(total)
    errors: list[str] = []

    def write():
        for s in range(1, total + 1):
            data = s.to_bytes(4, "little")
            small.publish("w0", s, data)
            big.publish("w0", s, data)

    def read(log, expect_all):
        after, seen, deadline = 0, [], time.monotonic() + 20
        while after < total and time.monotonic() < deadline:
            datas, last, truncated = log.read(after, 16)
            seqs = [int.from_bytes(d, "little") for d in datas]
            ok = (seqs == list(range(seqs[0], seqs[-1] + 1)) and seqs[-1] == last
                  and (truncated or seqs[0] == after + 1)) if seqs else (last == after and not truncated)
            if not ok:
                errors.append(f"read after {after}: {seqs[:3]}… last={last} truncated={truncated}")
            if truncated and expect_all:
                errors.append("a ring big enough for everything truncated")
            seen += seqs
            after = last
        if expect_all and seen != list(range(1, total + 1)):
            errors.append("the big log's reader did not see every batch exactly once")

    threads = [threading.Thread(target=write), threading.Thread(target=read, args=(small, False)),
               threading.Thread(target=read, args=(big, True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# ---- IndexFeed ----------------------------------------------------------------------------------------
def test_feed_applies_events_and_load_in_order():
    feed = new_feed()
    load = WorkerLoad("w0", "prefill", 1, 2, 3, 100, 64)
    assert feed.apply_batch(batch("w0", 1, [stored("w0", 1, 2, 3)], load))
    assert feed.index.match([1, 2, 3]) == dev(w0=3)
    assert feed.tracker.get("w0").queued_prefill_tokens == 64 and feed.tracker.get("w0").running_seqs == 3
    assert feed.apply_batch(batch("w0", 2, [BlockRemoved("w0", (2,))]))
    assert feed.index.match([1, 2, 3]) == dev(w0=1)
    assert feed.counters == FeedCounters(batches=2, events=2, loads=1)
    assert feed.last_seq("w0") == 2 and feed.needs_resync == frozenset()


def test_feed_gap_drops_the_worker_until_a_full_state_batch():
    feed = new_feed()
    feed.apply_batch(batch("w0", 1, [stored("w0", 1, 2)]))
    feed.apply_batch(batch("w1", 1, [stored("w1", 1)]))
    feed.apply_batch(batch("w0", 3, [stored("w0", 5, parent=4)]))  # seq 2 was lost
    assert feed.needs_resync == {"w0"} and feed.counters.gaps == 1
    assert feed.index.match([1, 2]) == dev(w1=1)  # w0's earlier blocks are forgotten …
    assert feed.index.num_blocks("w0") == 1  # … and what came after the gap is kept (a subset of the truth)
    feed.apply_batch(batch("w0", 4, [BlockRemoved("w0", (5,))]))
    assert feed.needs_resync == {"w0"}
    feed.apply_batch(batch("w0", 5, [AllCleared("w0"), stored("w0", 1, 2, 7)]))  # in-band full state
    assert feed.needs_resync == frozenset() and feed.counters.resyncs == 1
    assert feed.index.match([1, 2]) == dev(w0=2, w1=1) and feed.index.num_blocks("w0") == 3


def test_feed_seq_backwards_restart_and_first_seen_mid_stream():
    feed = new_feed()
    for s in (1, 2, 3):
        feed.apply_batch(batch("w0", s, [stored("w0", s)]))
        feed.apply_batch(batch("w2", s, [stored("w2", 10 + s)]))
    feed.apply_batch(batch("w0", 2, [stored("w0", 9)]))  # backwards, not a fresh start
    feed.apply_batch(batch("w1", 7, [stored("w1", 8)]))  # joined mid-stream: blocks before seq 7 unknown
    assert feed.needs_resync == {"w0", "w1"} and feed.counters.gaps == 2
    assert feed.index.num_blocks("w0") == 1 and feed.index.num_blocks("w1") == 1
    feed.apply_batch(batch("w2", 1, [stored("w2", 99)]))  # restarted: empty pool, complete history from 1
    assert feed.counters.restarts == 1 and "w2" not in feed.needs_resync
    assert held(feed.index, "w2") == [99]


def test_feed_out_of_band_resync_skips_stale_stream_batches():
    feed = new_feed()
    feed.apply_batch(batch("w0", 1, [stored("w0", 1)], ts=1.0))
    # the router asks the worker for a snapshot while seqs 2..3 are still on their way
    feed.apply_batch(batch("w0", 3, [AllCleared("w0"), stored("w0", 1, 2, 3)], ts=3.5))
    feed.apply_batch(batch("w0", 2, [stored("w0", 2)], ts=2.0))  # stale
    feed.apply_batch(batch("w0", 3, [stored("w0", 3)], ts=3.0))  # stale
    feed.apply_batch(batch("w0", 4, [BlockRemoved("w0", (3,))], ts=4.0))
    feed.apply_batch(batch("w0", 2, [AllCleared("w0")], ts=5.0))  # a full state older than seq 4: stale
    assert feed.counters.stale == 3 and feed.counters.gaps == 0
    assert feed.index.snapshot()["workers"] == {"w0": {"device": [1, 2]}} and feed.last_seq("w0") == 4


def test_embedded_reader_falls_behind_the_ring_and_resyncs_from_the_worker():
    pool, log, feed, seq = BlockPool(8, worker_id="w0"), MemoryEventLog(4), new_feed(), 0

    def worker_step(tokens):  # one request's prefill: the pool records stores / evictions
        hashes = [hash((tokens, i)) & (2 ** 63 - 1) for i in range(2)]
        blocks = pool.allocate(2)
        pool.cache_full_blocks(blocks, hashes, list(range(2 * B)), B, 0, None)
        pool.free_blocks(reversed(blocks))

    def publish(events):
        nonlocal seq
        seq += 1
        log.publish("w0", seq, batch("w0", seq, events))

    def truth():
        return sorted(b.block_hash for b in pool.blocks if b.block_hash is not None)

    for t in range(10):
        worker_step(t)
        publish(pool.take_events())
    datas, last, truncated = log.read(0)
    assert truncated and last == 10
    for data in datas:
        feed.apply_batch(data)
    assert feed.needs_resync == {"w0"}
    publish(pool.take_events())  # the worker's snapshot() publishes what is pending first …
    feed.apply_batch(batch("w0", seq, pool.snapshot_events()))  # … then answers with its full state
    worker_step(99)
    publish(pool.take_events())
    datas, last, truncated = log.read(feed.last_seq("w0"))
    assert not truncated and len(datas) == 1
    feed.apply_batch(datas[0])  # reading after the resync's seq skips seq 11, which the full state covers
    assert feed.needs_resync == frozenset() and held(feed.index, "w0") == truth()


def test_feed_counts_malformed_payloads_and_never_raises():
    feed = new_feed()
    feed.apply_batch(batch("w0", 1, [stored("w0", 1)]))
    for data in (b"", b"\xff\xff\xff", b"garbage" * 3, batch("", 2, [stored("w0", 2)])):
        assert feed.apply_batch(data) is False
    assert feed.counters.malformed == 4 and feed.counters.batches == 1
    assert feed.index.snapshot()["workers"] == {"w0": {"device": [1]}}


def test_feed_snapshot_restores_in_place():
    feed = new_feed()
    feed.apply_batch(batch("w0", 1, [stored("w0", 1, 2)], WorkerLoad("w0", "prefill", 0, 1, 2, 50, 32)))
    feed.apply_batch(batch("w1", 4, [stored("w1", 2 ** 64 - 1)], ts=1.0))
    feed.apply_batch(batch("w2", 2, [AllCleared("w2"), stored("w2", 5)], ts=2.0))
    snap = pickle.loads(pickle.dumps(feed.snapshot()))
    other = new_feed()
    other.apply_batch(batch("w9", 1, [stored("w9", 9)]))
    index_before = other.index
    other.restore(snap)
    assert other.index is index_before  # in place: the router's policy keeps its reference
    assert other.snapshot() == feed.snapshot()
    assert other.tracker.get("w0") == feed.tracker.get("w0") and other.needs_resync == {"w1"}
    with pytest.raises(ValueError):
        other.restore({"index": {"version": 99, "workers": {}}})
    assert other.snapshot() == feed.snapshot()  # untouched by a bad snapshot


# ---- Redis --------------------------------------------------------------------------------------------
def test_redis_sink_round_trips_the_codec_and_pickles(redis_url):
    events = [stored("w0", 1, 2 ** 64 - 1, parent=7), stored("w0", 3), BlockRemoved("w0", (1,)), AllCleared("w0")]
    load = WorkerLoad("w0", "decode", 3, 1, 40, 100, 0)
    sink = pickle.loads(pickle.dumps(RedisEventSink(redis_url, stream="t:codec", maxlen=1000)))
    sink.publish("w0", 1, encode_batch("w0", 1, events, load, 12.5))
    sink = pickle.loads(pickle.dumps(sink))  # a connected sink pickles too (its client is not carried)
    sink.publish("w0", 2, encode_batch("w0", 2, [], None, 13.0))
    sink.close()
    client = redis.Redis.from_url(redis_url)
    entries = client.xrange("t:codec")
    client.close()
    got = [decode_batch(fields[b"b"]) for _, fields in entries]
    assert [(b.worker, b.seq, b.events, b.load, b.timestamp_s) for b in got] == [
        ("w0", 1, tuple(events), load, 12.5), ("w0", 2, (), None, 13.0)]


def test_redis_snapshot_newest_wins_and_trimmed_stream_forces_resync(redis_url):
    stream, key = "t:trim", "t:trim:snap"
    sink = RedisEventSink(redis_url, stream=stream, maxlen=10)  # approximate: trims whole 100-entry nodes
    sink.publish("w0", 1, batch("w0", 1, [stored("w0", 1)]))
    early = RedisEventSource(redis_url, new_feed(), stream, key)
    assert early.restore() is False and early.save_snapshot()
    for s in range(2, 400):
        sink.publish("w0", s, batch("w0", s, [stored("w0", s)]))
    late = RedisEventSource(redis_url, new_feed(), stream, key)
    assert late.restore() is True  # the snapshot is used, but its entry was trimmed away …
    assert late.feed.needs_resync == {"w0"}  # … so w0 must resync
    assert set(held(late.feed.index, "w0")) < set(range(1, 400))
    scratch = RedisEventSource(redis_url, new_feed(), stream, "t:trim:none")
    assert scratch.restore() is False and scratch.feed.needs_resync == {"w0"}  # first seen at seq != 1
    assert late.save_snapshot() is True
    assert early.save_snapshot() is False  # older than the stored one: kept
    for source in (early, late, scratch):
        source.close()
    sink.close()


def test_redis_snapshot_taken_before_any_entry_is_not_mistaken_for_a_trim(redis_url):
    empty = RedisEventSource(redis_url, new_feed(), "t:zero", "t:zero:snap")
    assert empty.save_snapshot() and empty.last_id == "0-0"
    sink = RedisEventSink(redis_url, stream="t:zero")
    for s in (1, 2):
        sink.publish("w0", s, batch("w0", s, [stored("w0", s)]))
    late = RedisEventSource(redis_url, new_feed(), "t:zero", "t:zero:snap")
    assert late.restore() is True and late.feed.needs_resync == frozenset()
    assert late.feed.index.snapshot()["workers"] == {"w0": {"device": [1, 2]}}
    for closeable in (empty, late, sink):
        closeable.close()


def test_redis_sink_drops_batches_for_a_while_after_a_failure():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = RedisEventSink(f"redis://127.0.0.1:{port}/0", retry_interval_s=60.0)
    assert sink.available()
    assert sink.publish("w0", 1, b"x") is False  # tried, failed, logged
    assert not sink.available()
    t0 = time.monotonic()
    assert sink.publish("w0", 2, b"x") is False  # dropped without trying: the engine thread is not held up
    assert time.monotonic() - t0 < 0.05 and sink.num_dropped == 2
    sink.close()


async def test_redis_source_runs_as_an_asyncio_task(redis_url):
    sink = RedisEventSink(redis_url, stream="t:task")
    source = RedisEventSource(redis_url, new_feed(), "t:task", "t:task:snap", block_ms=20)
    task = source.start(snapshot_interval_s=0.01)
    for s in range(1, 4):
        sink.publish("w0", s, batch("w0", s, [stored("w0", s)]))
    client = redis.Redis.from_url(redis_url)
    end = client.xrevrange("t:task", count=1)[0][0]
    deadline = time.monotonic() + 5
    while not (source.has_reached(end) and client.exists("t:task:snap")) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert source.feed.index.snapshot()["workers"] == {"w0": {"device": [1, 2, 3]}} and client.exists("t:task:snap")
    await source.stop()
    assert task.done() and parse_stream_id(source.last_id) == parse_stream_id(end)
    client.close()
    sink.close()


async def _until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_redis_source_survives_a_redis_restart_and_a_stream_that_starts_over(tmp_path):
    """redis-server is SIGKILLed and started again on the same port with no data: the source keeps
    retrying (counted), reads the new stream, and the worker whose batches were lost is out of the index
    until its full state. Then the stream is replaced by one whose ids sort below what was read (a replica
    with less data): the source notices within RESET_CHECK_INTERVAL_S and reads it from 0."""
    server = RedisProcess(tmp_path)
    url = server.start()
    sink = RedisEventSink(url, stream="t:restart", retry_interval_s=0.1)
    source = RedisEventSource(url, new_feed(), "t:restart", "t:restart:snap", block_ms=20)
    task = source.start(snapshot_interval_s=None)
    try:
        for s in (1, 2):
            assert sink.publish("w0", s, batch("w0", s, [stored("w0", s)]))
        assert await _until(lambda: source.feed.last_seq("w0") == 2)
        server.stop()
        assert sink.publish("w0", 3, batch("w0", 3, [stored("w0", 3)])) is False  # lost with Redis
        assert await _until(lambda: source.feed.counters.source_errors >= 2)
        assert not task.done()
        server.start()  # same port, empty
        await asyncio.sleep(0.15)  # the sink's retry window
        assert sink.publish("w0", 4, batch("w0", 4, [stored("w0", 4)]))
        assert await _until(lambda: source.feed.last_seq("w0") == 4)
        assert source.feed.needs_resync == {"w0"} and source.feed.counters.gaps == 1
        assert source.feed.index.snapshot()["workers"] == {"w0": {"device": [4]}}  # a subset of the truth, never more
        full = [AllCleared("w0"), stored("w0", 1, 2, 3, 4)]
        assert sink.publish("w0", 5, batch("w0", 5, full))
        assert await _until(lambda: not source.feed.needs_resync)
        assert source.feed.index.snapshot()["workers"] == {"w0": {"device": [1, 2, 3, 4]}}

        # The empty stream after the restart may or may not have been seen before the sink's next XADD.
        resets = source.feed.counters.stream_resets
        assert resets <= 1
        client = redis.Redis.from_url(url)
        client.delete("t:restart")
        client.xadd("t:restart", {"b": batch("w1", 1, [stored("w1", 9)])}, id="1-1")  # below everything read
        assert await _until(lambda: source.feed.last_seq("w1") == 1, timeout_s=5.0)
        assert source.feed.counters.stream_resets == resets + 1 and source.last_id == "1-1"
        assert source.feed.index.match([9]) == dev(w1=1)
        client.close()
    finally:
        await source.stop()
        sink.close()
        server.stop()


async def test_redis_source_stops_even_when_redis_py_turns_the_cancel_into_a_timeout(tmp_path, monkeypatch):
    """On Python 3.11 a cancel that meets redis-py's read timeout can come out as ``redis.TimeoutError``, which
    the source takes for an outage and retries: stop() must still end the task (it hung CI for 600 s)."""
    import redis.asyncio as aioredis

    real_xread = aioredis.Redis.xread

    async def xread_losing_the_cancel(self, *args, **kwargs):
        try:
            return await real_xread(self, *args, **kwargs)
        except asyncio.CancelledError:
            raise redis.TimeoutError("Timeout reading from socket") from None

    monkeypatch.setattr(aioredis.Redis, "xread", xread_losing_the_cancel)
    server = RedisProcess(tmp_path)
    url = server.start()
    source = RedisEventSource(url, new_feed(), "t:stop", "t:stop:snap", block_ms=200)
    task = source.start(snapshot_interval_s=None)
    try:
        await asyncio.sleep(0.3)  # inside a blocking XREAD
        began = time.monotonic()
        await asyncio.wait_for(source.stop(), timeout=10.0)
        assert task.done() and time.monotonic() - began < 5.0
    finally:
        server.stop()
