"""engine.kv.events dataclasses <-> the wire (proto/duet/v1/kv_events.proto).

    data = encode_batch(worker, seq, events, load, timestamp_s)
    batch = decode_batch(data)          # DecodedBatch(worker, seq, events, load, timestamp_s)

Hashes are unsigned 64-bit on the wire and Python ints in memory, so they round-trip exactly.
A malformed payload raises ValueError (a router skips it and counts it; it never crashes the feed).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv.events import AllCleared, BlockRemoved, BlockStored, KVEvent, Tier, TierUsage, WorkerLoad
from proto.build import ensure_generated

ensure_generated()
from proto.duet.v1 import kv_events_pb2 as pb  # noqa: E402  (generated above when missing)

# the shared Redis stream of the KV events: prefill_worker/event_sinks.py writes it, router/routing/redis_feed.py
# reads it
DEFAULT_STREAM = "duet:kv-events"
DEFAULT_STREAM_MAXLEN = 100_000  # entries; router/routing/feed.py "Snapshots and trimming" gives the rule
STREAM_FIELD = b"b"  # the one field of an entry: an encoded batch

_TIER_TO_PB = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2}
_TIER_FROM_PB = {v: k for k, v in _TIER_TO_PB.items()}


def _tier_from_pb(value: int) -> Tier:
    try:
        return _TIER_FROM_PB[value]
    except KeyError:  # a newer worker's tier we do not know: refuse the batch rather than misfile its blocks
        raise ValueError(f"unknown KV tier {value}") from None


@dataclass(frozen=True)
class DecodedBatch:
    worker: str
    seq: int
    events: tuple[KVEvent, ...]
    load: WorkerLoad | None
    timestamp_s: float


def _event_to_pb(event: KVEvent) -> pb.KVEvent:
    if isinstance(event, BlockStored):
        msg = pb.BlockStored(block_hashes=list(event.block_hashes), tier=_TIER_TO_PB[event.tier])
        if event.parent_hash is not None:
            msg.parent_hash = event.parent_hash
        return pb.KVEvent(stored=msg)
    if isinstance(event, BlockRemoved):
        return pb.KVEvent(removed=pb.BlockRemoved(block_hashes=list(event.block_hashes),
                                                         tier=_TIER_TO_PB[event.tier]))
    if isinstance(event, AllCleared):
        return pb.KVEvent(cleared=pb.AllCleared())
    raise TypeError(f"not a KV event: {event!r}")


def _event_from_pb(worker: str, msg: pb.KVEvent) -> KVEvent:
    kind = msg.WhichOneof("kind")
    if kind == "stored":
        parent = msg.stored.parent_hash if msg.stored.HasField("parent_hash") else None
        return BlockStored(worker, tuple(msg.stored.block_hashes), parent, _tier_from_pb(msg.stored.tier))
    if kind == "removed":
        return BlockRemoved(worker, tuple(msg.removed.block_hashes), _tier_from_pb(msg.removed.tier))
    if kind == "cleared":
        return AllCleared(worker)
    raise ValueError("KV event with no kind")


def encode_batch(worker: str, seq: int, events: Sequence[KVEvent], load: WorkerLoad | None,
                 timestamp_s: float = 0.0) -> bytes:
    batch = pb.EventBatch(worker=worker, seq=seq, events=[_event_to_pb(e) for e in events],
                          timestamp_s=timestamp_s)
    if load is not None:
        batch.load.CopyFrom(pb.WorkerLoad(
            role=load.role, running=load.running, waiting=load.waiting, kv_blocks_used=load.kv_blocks_used,
            kv_blocks_total=load.kv_blocks_total, queued_prefill_tokens=load.queued_prefill_tokens,
            tiers=[pb.TierUsage(tier=_TIER_TO_PB[t.tier], blocks_total=t.blocks_total, blocks_used=t.blocks_used)
                   for t in load.tiers]))
    return batch.SerializeToString()


def decode_batch(data: bytes) -> DecodedBatch:
    batch = pb.EventBatch()
    try:
        batch.ParseFromString(data)
    except Exception as e:  # google.protobuf.message.DecodeError
        raise ValueError(f"malformed KV event batch: {e}") from e
    if not batch.worker:
        raise ValueError("KV event batch without a worker")
    load = None
    if batch.HasField("load"):
        m = batch.load
        tiers = tuple(TierUsage(_tier_from_pb(t.tier), t.blocks_total, t.blocks_used) for t in m.tiers)
        load = WorkerLoad(batch.worker, m.role, m.running, m.waiting, m.kv_blocks_used, m.kv_blocks_total,
                          m.queued_prefill_tokens, tiers)
    events = tuple(_event_from_pb(batch.worker, e) for e in batch.events)
    return DecodedBatch(batch.worker, batch.seq, events, load, batch.timestamp_s)
