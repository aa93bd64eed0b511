"""The event plane: worker-side logs and sinks, the router's IndexFeed, and the shared Redis index.

The Redis sink and source are in test_redis_feed.py (a real redis-server); two router processes on one
stream are in test_feed_two_routers.py.
"""
from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import time

import pytest

from engine.kv.block_pool import BlockPool
from engine.kv.events import AllCleared, BlockRemoved, BlockStored, WorkerLoad
from prefill_worker.event_sinks import MemoryEventLog
from proto.kv_codec import encode_batch
from router.routing.feed import FeedCounters, IndexFeed
from router.routing.index import PrefixIndex, TierMatch
from router.routing.load import LoadTracker

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
    code = "import sys, router.routing.feed; sys.exit('torch' in sys.modules)"
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
