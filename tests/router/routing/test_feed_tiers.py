"""KV tiers on the event plane: the codec's tier fields and TierUsage, the feed's checks that a worker sized
every lower tier it publishes on, tier capacity reaching the registry, and snapshots (in memory and through
a real redis-server) that carry tiers."""
from __future__ import annotations

import json
import logging
import pickle

import pytest

from engine.kv.events import AllCleared, BlockRemoved, BlockStored, Tier, TierUsage, WorkerLoad
from prefill_worker.event_sinks import RedisEventSink
from proto.duet.v1 import kv_events_pb2 as pb
from proto.kv_codec import decode_batch, encode_batch
from router.routing.feed import IndexFeed
from router.routing.index import PrefixIndex, TierMatch
from router.routing.load import LoadTracker
from router.routing.policy import Role
from router.routing.redis_feed import RedisEventSource
from router.workers.registry import WorkerRegistry

DEVICE, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK
SIZED = (TierUsage(HOST, 400, 12), TierUsage(DISK, 4000, 30))


def load(worker="w0", tiers=SIZED) -> WorkerLoad:
    return WorkerLoad(worker, "prefill", 1, 0, 5, 100, 32, tiers)


def new_feed(**kw) -> IndexFeed:
    return IndexFeed(PrefixIndex(), LoadTracker(), **kw)


# ---- codec ----------------------------------------------------------------------------------------------
def test_codec_round_trips_tiers_and_tier_usage():
    events = (BlockStored("w0", (1, 2 ** 64 - 1), None, HOST), BlockStored("w0", (3,), 2, DISK),
              BlockStored("w0", (4,), None), BlockRemoved("w0", (1,), HOST), BlockRemoved("w0", (4,), DEVICE),
              AllCleared("w0"))
    got = decode_batch(encode_batch("w0", 7, events, load(), 1.5))
    assert got.events == events and got.load == load() and got.load.tiers == SIZED
    assert decode_batch(encode_batch("w0", 8, (), load(tiers=()))).load.tiers == ()


def test_an_event_without_a_tier_reads_as_device():
    """What a worker that predates tiers sends: no tier field on the wire (and no TierUsage in its load)."""
    old = pb.EventBatch(worker="w0", seq=1, events=[
        pb.KVEvent(stored=pb.BlockStored(block_hashes=[5, 6])), pb.KVEvent(removed=pb.BlockRemoved(block_hashes=[5]))],
        load=pb.WorkerLoad(role="decode", kv_blocks_used=1, kv_blocks_total=8))
    data = old.SerializeToString()
    assert b"\x18" not in data  # field 3 (BlockStored.tier) is absent, not written as 0
    got = decode_batch(data)
    assert got.events == (BlockStored("w0", (5, 6), None, DEVICE), BlockRemoved("w0", (5,), DEVICE))
    assert got.load.tiers == ()


@pytest.mark.parametrize("make", [
    lambda: pb.KVEvent(stored=pb.BlockStored(block_hashes=[1], tier=7)),
    lambda: pb.KVEvent(removed=pb.BlockRemoved(block_hashes=[1], tier=3)),
])
def test_an_unknown_tier_is_refused(make):
    data = pb.EventBatch(worker="w0", seq=1, events=[make()]).SerializeToString()
    with pytest.raises(ValueError, match="unknown KV tier"):
        decode_batch(data)
    feed = new_feed()
    assert feed.apply_batch(data) is False and feed.counters.malformed == 1  # skipped, never misfiled
    assert feed.index.num_entries == 0


def test_an_unknown_tier_in_a_load_report_is_refused():
    batch = pb.EventBatch(worker="w0", seq=1, load=pb.WorkerLoad(tiers=[pb.TierUsage(tier=9, blocks_total=1)]))
    with pytest.raises(ValueError, match="unknown KV tier"):
        decode_batch(batch.SerializeToString())


# ---- IndexFeed ------------------------------------------------------------------------------------------
def test_feed_indexes_tiers_and_passes_their_capacity_to_the_registry():
    registry = WorkerRegistry()
    registry.add("w0", Role.PREFILL, 0.0)
    feed = new_feed(on_load=lambda report: registry.update_load(report, 1.0))
    events = [BlockStored("w0", (1, 2, 3), None, DEVICE), BlockStored("w0", (1, 2, 3, 4), None, HOST)]
    assert feed.apply_batch(encode_batch("w0", 1, events, load()))
    assert feed.index.match([1, 2, 3, 4]) == {"w0": TierMatch(device=3, host=1)}
    assert feed.counters.unreported_tiers == 0
    assert registry.get("w0").summary(2.0)["kv_tiers"] == {
        "device": {"blocks_total": 100, "blocks_used": 5}, "host": {"blocks_total": 400, "blocks_used": 12},
        "disk": {"blocks_total": 4000, "blocks_used": 30}}


def test_events_on_a_tier_never_sized_are_counted_and_logged_once(caplog):
    feed = new_feed()
    host_only = (TierUsage(HOST, 400, 0),)
    with caplog.at_level(logging.WARNING, logger="router.routing.feed"):
        feed.apply_batch(encode_batch("w0", 1, [BlockStored("w0", (1,), None, DISK)], load(tiers=host_only)))
        feed.apply_batch(encode_batch("w0", 2, [BlockStored("w0", (2,), 1, DISK), BlockRemoved("w0", (1,), DISK)],
                                      None))  # no load in this batch: the last report counts
        feed.apply_batch(encode_batch("w0", 3, [BlockStored("w0", (1,), None, HOST)], None))  # sized: fine
        feed.apply_batch(encode_batch("w1", 1, [BlockStored("w1", (1,), None, HOST)], None))  # never reported
    assert feed.counters.unreported_tiers == 4
    warnings = [r.getMessage() for r in caplog.records if "has not reported" in r.getMessage()]
    assert len(warnings) == 2 and "w0" in warnings[0] and "disk" in warnings[0] and "w1" in warnings[1]
    assert feed.index.num_blocks("w0", DISK) == 1  # indexed all the same
    feed.apply_batch(encode_batch("w0", 4, [BlockStored("w0", (3,), None, DISK)], load()))  # now sized
    assert feed.counters.unreported_tiers == 4


def test_feed_snapshot_carries_tiers_and_tier_capacity():
    feed = new_feed()
    feed.apply_batch(encode_batch("w0", 1, [BlockStored("w0", (1, 2), None, DEVICE),
                                           BlockStored("w0", (1, 2, 3), None, DISK)], load()))
    snap = feed.snapshot()
    for copy in (pickle.loads(pickle.dumps(snap)), json.loads(json.dumps(snap))):  # Redis stores JSON
        other = new_feed()
        other.restore(copy)
        assert json.loads(json.dumps(other.snapshot())) == json.loads(json.dumps(snap))
        assert other.index.match([1, 2, 3]) == {"w0": TierMatch(device=2, disk=1)}
        assert other._last_load["w0"] == load() and other._last_load["w0"].tiers == SIZED
    bad = json.loads(json.dumps(snap))
    bad["loads"]["w0"]["tiers"][0]["tier"] = "tape"
    with pytest.raises(ValueError):
        new_feed().restore(bad)


def test_feed_restores_a_snapshot_from_before_tiers():
    old = {"index": {"version": 1, "workers": {"w0": [1, 2]}}, "seqs": {"w0": 3}, "needs_resync": [],
           "resync_at": {}, "loads": {"w0": {"worker": "w0", "role": "decode", "running": 0, "waiting": 0,
                                             "kv_blocks_used": 2, "kv_blocks_total": 8, "queued_prefill_tokens": 0}}}
    feed = new_feed()
    feed.restore(old)
    assert feed.index.match([1, 2]) == {"w0": TierMatch(device=2)} and feed.last_seq("w0") == 3
    assert feed._last_load["w0"].tiers == ()


# ---- Redis ----------------------------------------------------------------------------------------------
def test_redis_snapshot_and_stream_carry_tiers(redis_url):
    stream, key = "t:tiers", "t:tiers:snap"
    sink = RedisEventSink(redis_url, stream=stream)
    sink.publish("w0", 1, encode_batch("w0", 1, [BlockStored("w0", (1, 2), None, DEVICE),
                                                 BlockStored("w0", (1, 2, 3), None, HOST)], load()))
    first = RedisEventSource(redis_url, new_feed(), stream, key)
    assert first.restore() is False and first.save_snapshot()
    # after the snapshot: a device eviction (the host copy stays) and a disk write
    sink.publish("w0", 2, encode_batch("w0", 2, [BlockRemoved("w0", (2,), DEVICE),
                                                 BlockStored("w0", (4,), 3, DISK)], load()))
    late = RedisEventSource(redis_url, new_feed(), stream, key)
    assert late.restore() is True  # the snapshot (taken after seq 1) + the stream after it
    first.catch_up()
    assert late.feed.snapshot() == first.feed.snapshot()
    assert late.feed.index.match([1, 2, 3, 4]) == {"w0": TierMatch(device=1, host=2, disk=1)}
    assert late.feed.snapshot()["loads"]["w0"]["tiers"][1] == {"tier": "disk", "blocks_total": 4000,
                                                                 "blocks_used": 30}
    for closeable in (first, late, sink):
        closeable.close()
