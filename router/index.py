"""Prefix index: which worker holds which KV block, built from the workers' KV events.

Layout: ``block_hash -> bitmask of worker slots`` (one dict) plus, per worker, the set of hashes it holds
(for ``num_blocks``, ``remove_worker`` and ``AllCleared``). Each worker gets a small integer slot; slots of
removed workers are reused.

Why a flat dict and not a radix tree: block hashes are chained (``hash(i)`` covers the parent's hash, see
engine/hashing.py), so a hash names its whole prefix. ``match`` walks the request's hashes in order,
AND-ing the bitmask of workers still matching; a worker drops out at the first block it lacks, and the walk
stops as soon as nobody is left. That is one dict lookup and one int AND per block, with no per-worker
loop in the common case. ``BlockStored.parent_hash`` is therefore not needed for matching and is ignored.

Semantics that mirror the block pool: a worker that lost a block in the middle of a chain (evicted) has
the blocks after it still registered, but ``match`` stops at the hole — as the engine's ``match_prefix``
does, since a prefix hit must be contiguous from the first block.

The index is eventually consistent: it is as fresh as the last event applied. A ``BlockRemoved`` for a
hash the worker is not known to hold (e.g. events from before a restore) is counted in
``num_stale_removals`` and otherwise ignored; a duplicate ``BlockStored`` is idempotent.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from engine.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent

SNAPSHOT_VERSION = 1


class PrefixIndex:
    def __init__(self) -> None:
        self._mask_by_hash: dict[int, int] = {}
        self._slot_by_worker: dict[str, int] = {}
        self._worker_by_slot: dict[int, str] = {}
        self._hashes_by_worker: dict[str, set[int]] = {}
        self._free_slots: list[int] = []
        self.num_events = 0
        self.num_stale_removals = 0

    # ---- queries -------------------------------------------------------------------------------
    @property
    def workers(self) -> list[str]:
        """Known workers, in registration order."""
        return list(self._slot_by_worker)

    def num_blocks(self, worker: str) -> int:
        """Blocks ``worker`` is known to hold (0 for an unknown worker)."""
        hashes = self._hashes_by_worker.get(worker)
        return len(hashes) if hashes is not None else 0

    @property
    def num_indexed_hashes(self) -> int:
        """Distinct block hashes held by at least one worker."""
        return len(self._mask_by_hash)

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """``{worker: number of leading blocks of block_hashes it holds}``, for workers holding >= 1.

        Workers absent from the result hold 0 leading blocks. No side effects.
        """
        out: dict[str, int] = {}
        if not block_hashes:
            return out
        get = self._mask_by_hash.get
        active = get(block_hashes[0], 0)
        if not active:
            return out
        for i, h in enumerate(block_hashes):
            still = get(h, 0) & active
            if still != active:
                self._credit(out, active & ~still, i)
                active = still
                if not active:
                    return out
        self._credit(out, active, len(block_hashes))
        return out

    def _credit(self, out: dict[str, int], mask: int, num_blocks: int) -> None:
        if num_blocks == 0:
            return
        names = self._worker_by_slot
        while mask:
            low = mask & -mask
            out[names[low.bit_length() - 1]] = num_blocks
            mask ^= low

    # ---- events ----------------------------------------------------------------------------------
    def add_worker(self, worker: str) -> None:
        """Register a worker holding nothing yet (idempotent). Events from unknown workers register them."""
        if worker in self._slot_by_worker:
            return
        slot = self._free_slots.pop() if self._free_slots else len(self._slot_by_worker)
        self._slot_by_worker[worker] = slot
        self._worker_by_slot[slot] = worker
        self._hashes_by_worker[worker] = set()

    def apply(self, event: KVEvent) -> None:
        self.num_events += 1
        if isinstance(event, BlockStored):
            self._store(event.worker, event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self._remove(event.worker, event.block_hashes)
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
        self._free_slots.append(slot)

    def _store(self, worker: str, block_hashes: Sequence[int]) -> None:
        self.add_worker(worker)
        bit = 1 << self._slot_by_worker[worker]
        held = self._hashes_by_worker[worker]
        masks = self._mask_by_hash
        for h in block_hashes:
            masks[h] = masks.get(h, 0) | bit
            held.add(h)

    def _remove(self, worker: str, block_hashes: Sequence[int]) -> None:
        held = self._hashes_by_worker.get(worker)
        if held is None:
            self.num_stale_removals += len(block_hashes)
            return
        bit = 1 << self._slot_by_worker[worker]
        masks = self._mask_by_hash
        for h in block_hashes:
            if h not in held:
                self.num_stale_removals += 1
                continue
            held.discard(h)
            self._drop_bit(masks, h, bit)

    def _clear(self, worker: str) -> None:
        held = self._hashes_by_worker.get(worker)
        if not held:
            return
        bit = 1 << self._slot_by_worker[worker]
        masks = self._mask_by_hash
        for h in held:
            self._drop_bit(masks, h, bit)
        held.clear()

    @staticmethod
    def _drop_bit(masks: dict[int, int], h: int, bit: int) -> None:
        mask = masks[h] & ~bit
        if mask:
            masks[h] = mask
        else:
            del masks[h]

    # ---- snapshot / restore ------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """A plain (JSON-serializable) copy: ``{"version": 1, "workers": {worker: [hash, ...]}}``.

        Hashes are sorted so equal indexes give equal snapshots. A restarting router restores the last
        snapshot, then replays the event stream from where the snapshot was taken (events are idempotent
        to re-apply: a store of a held hash and a removal of an absent one change nothing).
        """
        return {
            "version": SNAPSHOT_VERSION,
            "workers": {w: sorted(self._hashes_by_worker[w]) for w in self._slot_by_worker},
        }

    @classmethod
    def restore(cls, snapshot: Mapping[str, Any]) -> PrefixIndex:
        version = snapshot.get("version")
        if version != SNAPSHOT_VERSION:
            raise ValueError(f"prefix-index snapshot version {version!r}, expected {SNAPSHOT_VERSION}")
        index = cls()
        for worker, hashes in snapshot["workers"].items():
            index.add_worker(worker)
            index._store(worker, [int(h) for h in hashes])
        return index
