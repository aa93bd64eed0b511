"""The shared Redis index (router/routing/feed.py's sink, router/routing/redis_feed.py's source) against a real
redis-server (conftest.py): round trips, snapshots, outages, restarts and a stream that starts over."""
from __future__ import annotations

import asyncio
import pickle
import socket
import time

import redis

from engine.kv.events import AllCleared, BlockRemoved, WorkerLoad
from prefill_worker.event_sinks import RedisEventSink
from proto.kv_codec import decode_batch, encode_batch
from router.routing.feed import parse_stream_id
from router.routing.redis_feed import RedisEventSource
from tests.redis_server import RedisProcess
from tests.router.routing.test_feed import batch, dev, held, new_feed, stored


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
