"""The event plane, router side: KV events + load from workers into every router's PrefixIndex and LoadTracker.

Workers publish through the sinks of prefill_worker/event_sinks.py (a ``MemoryEventLog`` ring a router long-polls, or
the Redis stream ``DEFAULT_STREAM`` of proto/kv_codec.py); one batch per engine step that had events, and a
load-only batch at least every ~100 ms, with ``seq`` = 1, 2, 3, … per worker.

Router side, ``IndexFeed.apply_batch(data)`` is the one place a batch enters the router. Per worker, with
``last`` the seq of the last batch applied from it:
  * undecodable: counted ``malformed`` and skipped, never raised;
  * full state (starts with AllCleared), seq >= last: applied (AllCleared resets the worker), clears
    ``needs_resync`` and becomes its resync point; with seq < last it is ``stale`` (older than ours): skipped;
  * seq == last + 1: applied;
  * seq == 1 from a known worker: ``restarts``, a new incarnation whose history from 1 is complete: reset;
  * seq <= the resync point and not newer by timestamp: ``stale`` (an out-of-band resync covered it);
  * anything else (a gap, a seq going backwards, a worker first seen at seq != 1): ``gaps``; the worker is
    dropped from the index and marked ``needs_resync``, then the batch is applied.

Tiers: events name the tier they happened on (the index keeps worker x tier), and each batch's load
report carries the capacity of the worker's lower tiers (``WorkerLoad.tiers``), which reaches the worker
registry through ``on_load`` (/admin/workers, /metrics). An applied event on a lower tier that the
worker's latest report does not size is indexed all the same, but counted (``unreported_tiers``) and
logged once per worker and tier: a router must not under-score a tier it cannot see silently.

Applying after a gap is safe: with the worker dropped, later stores add blocks it really holds and later
removals remove them, so its index entry is a subset of the truth (missed hits, never false ones) until a
full-state batch (``BlockPool.snapshot_events``: AllCleared + every cached hash) makes it exact. A full
batch may arrive out-of-band (``worker.snapshot()`` carries the worker's current seq) or in-band in the
stream as the next seq.

Shared index (Redis). One stream gives one total order; every router applies the same entries in the same
order, so two routers that have applied the stream up to the same entry id hold identical indexes and load
reports. A decision is therefore reproducible across routers only when both take it at the same stream
position (``RedisEventSource.has_reached(id)``); live routers are merely eventually consistent.

Snapshots and trimming. ``save_snapshot()`` SETs one JSON key ``{"stream_id", "format", "feed"}`` (index,
per-worker seqs, resync marks, last load reports) with a Lua check that keeps the newest: every router may
save every ``snapshot_interval_s`` and a slow one never overwrites a newer snapshot with an older one.
``restore()`` loads the snapshot (if any) and reads the stream after its ``stream_id`` (else from 0), so a
restarting router rebuilds the index the others hold. Sinks trim the stream to ``maxlen`` entries
(approximately); the rule is maxlen >= 2 x the entries published per snapshot interval (16 workers x ~50
batches/s publish 8k entries per 10 s: 100k leaves a 6x margin). If the snapshot's own entry has been
trimmed (first entry id > stream_id), events after it may be lost: every worker is dropped and marked
``needs_resync``. Without a snapshot a trimmed head shows up per worker as "first seen at seq != 1", and
a live router that falls behind the trim sees per-worker seq gaps.

Concurrency. ``MemoryEventLog`` is thread-safe (engine thread publishes, actor thread reads).
``IndexFeed`` is not: ``RedisEventSource.run()`` is an asyncio task on the router's own event loop
(``redis.asyncio``), the loop that also routes, so index reads and writes never interleave. The sync
``restore()`` / ``poll_once()`` / ``save_snapshot()`` serve start-up, tests and tools.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from engine.kv.events import AllCleared, BlockRemoved, BlockStored, Tier, TierUsage, WorkerLoad
from proto.kv_codec import DecodedBatch, decode_batch
from router.routing.index import PrefixIndex
from router.routing.load import LoadTracker

log = logging.getLogger(__name__)

DEFAULT_SNAPSHOT_KEY = "duet:index:snapshot"
DEFAULT_SNAPSHOT_INTERVAL_S = 10.0
FIRST_SEQ = 1  # a worker's first batch
SNAPSHOT_FORMAT = 1


def parse_stream_id(stream_id: str | bytes) -> tuple[int, int]:
    """``"<ms>-<n>"`` -> ``(ms, n)``, ordered as Redis orders entries."""
    text = stream_id.decode() if isinstance(stream_id, bytes) else stream_id
    ms, _, n = text.partition("-")
    return int(ms), int(n or 0)


@dataclass
class FeedCounters:
    batches: int = 0  # applied
    events: int = 0  # applied, inside those batches
    loads: int = 0  # load reports passed to the tracker
    malformed: int = 0  # undecodable payloads, skipped
    gaps: int = 0  # seq gaps / going backwards / first seen mid-stream: worker marked needs_resync
    restarts: int = 0  # a known worker started over at FIRST_SEQ
    resyncs: int = 0  # full-state batches applied
    stale: int = 0  # skipped: older than a full state already applied
    source_errors: int = 0  # failed reads of the shared stream (Redis down), retried with backoff
    stream_resets: int = 0  # the shared stream started over below the last entry read (Redis lost its data)
    unreported_tiers: int = 0  # applied events on a lower tier whose capacity the worker never reported


class IndexFeed:
    """Applies encoded batches to a PrefixIndex and a LoadTracker (seq rules: module docstring)."""

    def __init__(self, index: PrefixIndex, tracker: LoadTracker,
                 on_load: Callable[[WorkerLoad], None] | None = None) -> None:
        self.index = index
        self.tracker = tracker
        self.on_load = on_load  # e.g. the worker registry's update_load: every load report, as it arrives
        self.counters = FeedCounters()
        self._last_seq: dict[str, int] = {}
        self._resync_at: dict[str, tuple[int, float]] = {}  # worker -> (seq, timestamp_s) of its last full state
        self._needs_resync: set[str] = set()
        self._last_load: dict[str, WorkerLoad] = {}
        self._warned_tiers: set[tuple[str, Tier]] = set()  # (worker, tier) already logged as unreported

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def needs_resync(self) -> frozenset[str]:
        """Workers whose index entry may be incomplete until a full-state batch arrives."""
        return frozenset(self._needs_resync)

    @property
    def last_seqs(self) -> dict[str, int]:
        return dict(self._last_seq)

    def last_seq(self, worker: str) -> int | None:
        return self._last_seq.get(worker)

    # ---- batches ---------------------------------------------------------------------------------
    def apply_batch(self, data: bytes) -> bool:
        """Decode and apply one batch; False if it was malformed or stale (counted, never raised)."""
        try:
            batch = decode_batch(data)
        except ValueError as e:
            self.counters.malformed += 1
            log.debug("skipping malformed KV event batch: %s", e)
            return False
        if not self._admit(batch):
            self.counters.stale += 1
            return False
        self._check_tiers(batch)
        self.index.apply_all(batch.events)
        if batch.load is not None:
            self.tracker.report(batch.load)
            self._last_load[batch.worker] = batch.load
            if self.on_load is not None:
                self.on_load(batch.load)
            self.counters.loads += 1
        self._last_seq[batch.worker] = batch.seq
        self.counters.batches += 1
        self.counters.events += len(batch.events)
        return True

    def _admit(self, batch: DecodedBatch) -> bool:
        worker, seq = batch.worker, batch.seq
        last = self._last_seq.get(worker)
        if batch.events and isinstance(batch.events[0], AllCleared):
            if last is not None and seq < last:
                return False
            self._needs_resync.discard(worker)
            self._resync_at[worker] = (seq, batch.timestamp_s)
            self.counters.resyncs += 1
            return True
        if last is None:
            if seq != FIRST_SEQ:
                self._lose(worker, f"first seen at seq {seq}")
            return True
        if seq == last + 1:
            return True
        if seq == FIRST_SEQ:
            self.index.remove_worker(worker)
            self._needs_resync.discard(worker)
            self._resync_at.pop(worker, None)
            self.counters.restarts += 1
            return True
        point = self._resync_at.get(worker)
        if point is not None and seq <= point[0] and batch.timestamp_s <= point[1]:
            return False
        self._lose(worker, f"seq {seq} after {last}")
        return True

    def _check_tiers(self, batch: DecodedBatch) -> None:
        """Count (and log once per worker and tier) events on a lower tier whose capacity the worker's load
        reports (this batch's, else its last) do not state: the router would index blocks on a tier it
        cannot size (DESIGN.md "KV tiers": WorkerLoad carries each tier's capacity)."""
        load = batch.load or self._last_load.get(batch.worker)
        reported = {t.tier for t in load.tiers} if load is not None else set()
        for event in batch.events:
            if not isinstance(event, (BlockStored, BlockRemoved)) or event.tier is Tier.DEVICE \
                    or event.tier in reported:
                continue
            self.counters.unreported_tiers += 1
            if (batch.worker, event.tier) not in self._warned_tiers:
                self._warned_tiers.add((batch.worker, event.tier))
                log.warning("worker %s publishes KV events for its %s tier but has not reported that tier's "
                            "capacity (WorkerLoad.tiers): indexed anyway, counted in unreported_tiers",
                            batch.worker, event.tier.value)

    def _lose(self, worker: str, why: str) -> None:
        log.warning("KV events of %s lost (%s): dropped from the index until it resyncs", worker, why)
        self.counters.gaps += 1
        self.index.remove_worker(worker)
        self._needs_resync.add(worker)

    # ---- membership ------------------------------------------------------------------------------
    def remove_worker(self, worker: str) -> None:
        """Forget a worker that left the pool (its index entry and seq state; the tracker is the caller's)."""
        self.index.remove_worker(worker)
        for state in (self._last_seq, self._resync_at, self._last_load):
            state.pop(worker, None)
        self._needs_resync.discard(worker)

    def invalidate_all(self) -> None:
        """Events of unknown workers may be lost: drop everyone from the index and mark them for resync."""
        for worker in set(self.index.workers) | set(self._last_seq):
            self.index.remove_worker(worker)
            self._needs_resync.add(worker)
        self._last_seq.clear()
        self._resync_at.clear()

    # ---- snapshot --------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """JSON-able state: index, per-worker seqs, resync marks and the last load report of each worker."""
        return {
            "index": self.index.snapshot(),
            "seqs": dict(self._last_seq),
            "needs_resync": sorted(self._needs_resync),
            "resync_at": {w: list(p) for w, p in self._resync_at.items()},
            "loads": {w: asdict(load) for w, load in self._last_load.items()},
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Replace this feed's state (and its index's, in place) by a ``snapshot()``; ValueError if invalid
        (and then nothing changed)."""
        try:
            index_snap = snapshot["index"]
            seqs = {str(w): int(s) for w, s in snapshot["seqs"].items()}
            resync_at = {str(w): (int(p[0]), float(p[1])) for w, p in snapshot["resync_at"].items()}
            loads = {str(w): _load_from_dict(d) for w, d in snapshot["loads"].items()}
            needs_resync = {str(w) for w in snapshot["needs_resync"]}
        except (KeyError, TypeError, AttributeError, IndexError) as e:
            raise ValueError(f"bad event-feed snapshot: {e!r}") from e
        self.index.replace(index_snap)  # the last step that may refuse; it changes nothing when it does
        for load in loads.values():
            self.tracker.report(load)
        self._last_seq, self._resync_at, self._last_load = seqs, resync_at, loads
        self._needs_resync = needs_resync


def _load_from_dict(d: dict[str, Any]) -> WorkerLoad:
    """``asdict(WorkerLoad)`` back (its tiers are dicts by then); ValueError for an unknown tier."""
    tiers = tuple(TierUsage(Tier(t["tier"]), int(t["blocks_total"]), int(t["blocks_used"])) for t in d.get("tiers", ()))
    return WorkerLoad(**{**d, "tiers": tiers})
