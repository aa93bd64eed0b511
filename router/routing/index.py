"""Prefix index: which worker holds which KV block on which tier, built from the workers' KV events.

Layout: ``block_hash -> packed mask`` (one dict) in which worker slot ``s`` owns the three bits
``3s + t``, ``t`` being the tier's position in ``TIERS`` (device 0, host 1, disk 2); plus, per worker, the
hashes it holds on any tier (for ``remove_worker`` and ``AllCleared``) and a block count per tier.
Each worker gets a small integer slot; slots of removed workers are reused.

Why a flat dict and not a radix tree: block hashes are chained (``hash(i)`` covers the parent's hash, see
engine/kv/hashing.py), so a hash names its whole prefix. ``BlockStored.parent_hash`` is therefore not needed
for matching and is ignored.

Why one packed mask and not one dict per tier: a worker's tiers are written through, so a cached block
is usually on two or three tiers of the same worker. One dict holds one entry per distinct hash whatever
the number of tiers (a third of the entries, and of the int objects, that three dicts would need), and
``match`` does one lookup per block, not three. Measured in docs/benchmarks.md ("Router decision with KV
tiers").

``match`` walks the request's hashes in order. Per block it looks the hash up once and masks it with the
tier bits of the workers still matching; while that value equals the previous block's, nothing changed
for anyone (every live worker still holds the block, on the same fastest tier) and the walk moves on —
one lookup, one AND and one compare per block. Only at a block where some worker's tiers change (it
dropped out, or the fastest tier it holds the block on changed) does the walk visit those workers, to
close their run of blocks on the old fastest tier. A worker drops out at the first block it holds on no
tier, so its match is a contiguous prefix across tiers: blocks 0-3 on device and 4-7 only on host count
8, as ``TierMatch(device=4, host=4)``. The walk stops when nobody is left.

Semantics that mirror the block pool: a worker that lost a block in the middle of a chain (evicted from
every tier) has the blocks after it still registered, but ``match`` stops at the hole — as the engine's
``match_prefix`` does, since a prefix hit must be contiguous from the first block.

Events per tier are independent (DESIGN.md "KV tiers"): ``BlockRemoved(tier=device)`` leaves the host copy
indexed; ``AllCleared`` clears every tier of the worker.

The index is eventually consistent: it is as fresh as the last event applied. A ``BlockRemoved`` for a
hash the worker is not known to hold on that tier (e.g. events from before a restore) is counted in
``stale_removals[tier]`` and otherwise ignored; a duplicate ``BlockStored`` is idempotent.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from itertools import groupby, repeat
from typing import Any, NamedTuple

from engine.kv.events import TIERS, AllCleared, BlockRemoved, BlockStored, KVEvent, Tier

SNAPSHOT_VERSION = 2  # 1: {"workers": {worker: [hash, ...]}}, device only; still restored
_SLOT_BITS = len(TIERS)
assert _SLOT_BITS == 3, "match() folds a slot's bits for exactly three tiers"
_SLOT_MASK = (1 << _SLOT_BITS) - 1  # one slot's tier bits
_TIER_BIT = {tier: t for t, tier in enumerate(TIERS)}
# a slot's tier bits -> position in TIERS of the fastest tier among them (-1: none)
_FASTEST = tuple((g & -g).bit_length() - 1 for g in range(1 << _SLOT_BITS))


class TierMatch(NamedTuple):
    """A worker's leading blocks of a request, by the fastest tier it holds each one on."""
    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk


NO_MATCH = TierMatch()
_new_match = partial(tuple.__new__, TierMatch)  # TierMatch from an iterable, without the generated __new__


def _low_bits(num_slots: int) -> int:
    """Bit ``3s`` set for every slot ``s < num_slots``."""
    return ((1 << (_SLOT_BITS * num_slots)) - 1) // _SLOT_MASK


def _tier_bit(tier: Tier) -> int:
    try:
        return _TIER_BIT[tier]
    except KeyError:
        raise ValueError(f"unknown KV tier {tier!r}") from None


class PrefixIndex:
    def __init__(self) -> None:
        self._mask_by_hash: dict[int, int] = {}
        self._slot_by_worker: dict[str, int] = {}
        self._worker_by_slot: dict[int, str] = {}
        # per worker, the hashes it holds on any tier: a dict used as a set, because a dict of ints is not
        # tracked by the garbage collector and a set is (a full collection would visit every entry)
        self._hashes_by_worker: dict[str, dict[int, None]] = {}
        self._counts_by_worker: dict[str, list[int]] = {}  # blocks per tier, in TIERS order
        self._free_slots: list[int] = []
        self._low = 0  # _low_bits(number of slots ever allocated)
        self.num_events = 0
        self.stale_removals: dict[Tier, int] = dict.fromkeys(TIERS, 0)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def workers(self) -> list[str]:
        """Known workers, in registration order."""
        return list(self._slot_by_worker)

    def num_blocks(self, worker: str, tier: Tier | None = None) -> int:
        """Blocks ``worker`` is known to hold on ``tier`` (None: distinct blocks on any tier); 0 if unknown."""
        if tier is None:
            return len(self._hashes_by_worker.get(worker, ()))
        counts = self._counts_by_worker.get(worker)
        return counts[_tier_bit(tier)] if counts is not None else 0

    def block_counts(self) -> dict[tuple[str, Tier], int]:
        """``{(worker, tier): blocks held}`` for every known worker and every tier."""
        return {(w, tier): n for w, counts in self._counts_by_worker.items() for tier, n in zip(TIERS, counts)}

    @property
    def num_entries(self) -> int:
        """Indexed (worker, tier, block) entries."""
        return sum(sum(c) for c in self._counts_by_worker.values())

    @property
    def num_indexed_hashes(self) -> int:
        """Distinct block hashes held by at least one worker on at least one tier."""
        return len(self._mask_by_hash)

    @property
    def num_stale_removals(self) -> int:
        return sum(self.stale_removals.values())

    def match(self, block_hashes: Sequence[int]) -> dict[str, TierMatch]:
        """``{worker: its leading blocks of block_hashes, by fastest tier}`` for workers holding >= 1.

        A block counts if the worker holds it on any tier; it is credited to the fastest of them. Workers
        absent from the result hold 0 leading blocks. No side effects. (Walk: module docstring.)
        """
        if not block_hashes:
            return {}
        masks = map(self._mask_by_hash.get, block_hashes, repeat(0))
        cur = next(masks)  # tier bits, at the previous block, of the workers still matching
        if not cur:
            return {}
        live = (cur | cur >> 1 | cur >> 2) & self._low  # bit 3s: slot s still matches
        select = live * _SLOT_MASK  # every tier bit of the live slots
        runs: dict[int, list[int]] = {}  # bit position 3s -> [first block of slot s's current run, and its
        #                                  blocks by fastest tier in closed runs]; absent: one run from block 0
        i = 1  # the block the next group starts at
        for raw, group in groupby(masks):  # runs of equal masks: the per-block work stays in C
            m = raw & select
            if m != cur:
                live = self._close_runs(i, cur, m, live, runs)
                cur, select = m, live * _SLOT_MASK
                if not live:
                    break
            i += len(list(group))
        self._close_runs(i, cur, 0, live, runs)
        names = self._worker_by_slot
        return {names[pos // _SLOT_BITS]: _new_match(run[1:]) for pos, run in runs.items()}

    def _close_runs(self, i: int, cur: int, m: int, live: int, runs: dict[int, list[int]]) -> int:
        """Block ``i`` has tier bits ``m`` where block ``i - 1`` had ``cur``: close the run of every live
        worker whose fastest tier changed (or that dropped out) at ``i``; returns the slots still live."""
        diff = cur ^ m
        changed = (diff | diff >> 1 | diff >> 2) & live
        fastest = _FASTEST
        while changed:  # one pass per changed slot: the walk's only per-worker work
            low = changed & -changed
            changed ^= low
            pos = low.bit_length() - 1
            old = fastest[(cur >> pos) & _SLOT_MASK]
            if old != fastest[(m >> pos) & _SLOT_MASK]:
                run = runs.get(pos)
                if run is None:
                    runs[pos] = run = [i, 0, 0, 0]
                    run[old + 1] = i
                else:
                    run[old + 1] += i - run[0]
                    run[0] = i
        return (m | m >> 1 | m >> 2) & self._low

    # ---- events ----------------------------------------------------------------------------------
    def add_worker(self, worker: str) -> None:
        """Register a worker holding nothing yet (idempotent). Events from unknown workers register them."""
        if worker in self._slot_by_worker:
            return
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = len(self._slot_by_worker)
            self._low = _low_bits(slot + 1)
        self._slot_by_worker[worker] = slot
        self._worker_by_slot[slot] = worker
        self._hashes_by_worker[worker] = {}
        self._counts_by_worker[worker] = [0] * _SLOT_BITS

    def apply(self, event: KVEvent) -> None:
        self.num_events += 1
        if isinstance(event, BlockStored):
            self._store(event.worker, _tier_bit(event.tier), event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self._remove(event.worker, _tier_bit(event.tier), event.block_hashes)
        elif isinstance(event, AllCleared):
            self._clear(event.worker)
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def apply_all(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(event)

    def remove_worker(self, worker: str) -> None:
        """Forget a worker and everything it held (it died or left the pool); its slot is reused."""
        if worker not in self._slot_by_worker:
            return
        self._clear(worker)
        slot = self._slot_by_worker.pop(worker)
        del self._worker_by_slot[slot]
        del self._hashes_by_worker[worker]
        del self._counts_by_worker[worker]
        self._free_slots.append(slot)

    def _store(self, worker: str, t: int, block_hashes: Sequence[int]) -> None:
        self.add_worker(worker)
        pos = _SLOT_BITS * self._slot_by_worker[worker]
        bit, group = 1 << (pos + t), _SLOT_MASK << pos
        held = self._hashes_by_worker[worker]
        masks = self._mask_by_hash
        added = 0
        for h in block_hashes:
            old = masks.get(h, 0)
            if not old & bit:
                masks[h] = old | bit
                added += 1
                if not old & group:
                    held[h] = None
        self._counts_by_worker[worker][t] += added

    def _remove(self, worker: str, t: int, block_hashes: Sequence[int]) -> None:
        held = self._hashes_by_worker.get(worker)
        if held is None:
            self.stale_removals[TIERS[t]] += len(block_hashes)
            return
        pos = _SLOT_BITS * self._slot_by_worker[worker]
        bit, group = 1 << (pos + t), _SLOT_MASK << pos
        masks = self._mask_by_hash
        removed = 0
        for h in block_hashes:
            old = masks.get(h, 0)
            if not old & bit:
                continue
            new = old ^ bit
            if new:
                masks[h] = new
                if not new & group:
                    del held[h]
            else:
                del masks[h]
                del held[h]
            removed += 1
        self._counts_by_worker[worker][t] -= removed
        self.stale_removals[TIERS[t]] += len(block_hashes) - removed

    def _clear(self, worker: str) -> None:
        held = self._hashes_by_worker.get(worker)
        if not held:
            return
        keep = ~(_SLOT_MASK << (_SLOT_BITS * self._slot_by_worker[worker]))
        masks = self._mask_by_hash
        for h in held:
            mask = masks[h] & keep
            if mask:
                masks[h] = mask
            else:
                del masks[h]
        held.clear()
        self._counts_by_worker[worker] = [0] * _SLOT_BITS

    # ---- snapshot / restore ------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """A plain (JSON-serializable) copy:
        ``{"version": 2, "workers": {worker: {tier: [hash, ...]}}}`` (tiers holding nothing are left out).

        Hashes are sorted so equal indexes give equal snapshots. A restarting router restores the last
        snapshot, then replays the event stream from where the snapshot was taken (events are idempotent
        to re-apply: a store of a held hash and a removal of an absent one change nothing).
        """
        workers: dict[str, dict[str, list[int]]] = {}
        masks = self._mask_by_hash
        for worker, slot in self._slot_by_worker.items():
            pos = _SLOT_BITS * slot
            by_tier: list[list[int]] = [[] for _ in TIERS]
            for h in self._hashes_by_worker[worker]:
                group = masks[h] >> pos
                for t, hashes in enumerate(by_tier):
                    if group >> t & 1:
                        hashes.append(h)
            workers[worker] = {tier.value: sorted(hs) for tier, hs in zip(TIERS, by_tier) if hs}
        return {"version": SNAPSHOT_VERSION, "workers": workers}

    @classmethod
    def restore(cls, snapshot: Mapping[str, Any]) -> PrefixIndex:
        index = cls()
        index.replace(snapshot)
        return index

    def replace(self, snapshot: Mapping[str, Any]) -> None:
        """Make this index (in place) what ``snapshot()`` describes. A version-1 snapshot (before tiers)
        reads as device blocks. ValueError for anything else, and then the index is unchanged."""
        parsed = _parse_snapshot(snapshot)
        for worker in self.workers:
            self.remove_worker(worker)
        for worker, by_tier in parsed.items():
            self.add_worker(worker)
            for t, hashes in by_tier.items():
                self._store(worker, t, hashes)


def _parse_snapshot(snapshot: Mapping[str, Any]) -> dict[str, dict[int, list[int]]]:
    """``{worker: {tier bit: [hash, ...]}}`` from a snapshot of either version; ValueError if invalid."""
    try:
        version, workers = snapshot.get("version"), snapshot["workers"]
        if version == 1:
            return {str(w): {_TIER_BIT[Tier.DEVICE]: [int(h) for h in hs]} for w, hs in workers.items()}
        if version != SNAPSHOT_VERSION:
            raise ValueError(f"prefix-index snapshot version {version!r}, expected {SNAPSHOT_VERSION} (or 1)")
        return {str(w): {_tier_bit(Tier(tier)): [int(h) for h in hs] for tier, hs in by_tier.items()}
                for w, by_tier in workers.items()}
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"bad prefix-index snapshot: {e!r}") from e
