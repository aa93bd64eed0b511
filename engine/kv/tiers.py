"""Lower KV tiers: host and disk copies of a worker's cached blocks. Bookkeeping only — no torch.

A worker's cache is tiers (DESIGN.md "KV tiers"): the device tier is the paged cache the kernels read
(engine/kv/block_pool.py); below it a host tier (``kv_host_bytes``) and a disk tier (``kv_disk_bytes``).
A block has one hash everywhere and the same bytes on every tier.

Policies (docs/ARCHITECTURE.md "KV tiers" has the measurements behind them):
- **Write-through to host.** Every block the device tier caches is copied to the host tier right after the
  step that filled it (the device block pinned until the copy lands), so evicting it from the device later
  costs nothing and never waits. Write-on-eviction would put a copy on the allocation path of the engine
  thread: the evicted block is reused by the very step that evicted it.
- **Write-on-eviction from host to disk.** The host tier's LRU victim is spilled to disk before its slot
  is reused (the mover runs jobs in order, so the spill reads the slot before the next store writes it).
  The tiers are inclusive; a lower tier smaller than the one above it only churns (the config refuses it).
- **Loading back.** A request whose prefix continues on a lower tier gets device blocks and one load job
  (disk → host → device); it waits outside the batch (``WAITING_FOR_TIER_LOAD``) while the steps run the
  others. A request that needs a block another request is loading waits for that load, and only for it.
  A load that fails, or a disk file that does not check out, is a miss from that block on: recomputed,
  counted, and the bad copy dropped — never used.

Events: a store on a tier is published when its copy has landed, a spilled block's removal from the host
after its store on disk. All events go into the block pool's one queue (``emit``), so a reader sees them
in the order they happened. Everything here runs on the engine thread; the mover (engine/kv/mover.py)
moves the bytes on its own thread and reports back through ``Mover.completions``.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.kv.events import BlockRemoved, BlockStored, KVEvent, Tier, TierUsage


@dataclass(frozen=True)
class Op:
    """One copy the mover makes. ``kind``: store (device block → host slot), spill (host slot → disk),
    fetch (disk → host slot), load (host slot → device block), delete (a disk file)."""

    kind: str
    block_hash: int
    token_ids: tuple[int, ...]
    host_slot: int = -1
    device_block: int = -1


@dataclass
class Job:
    job_id: int
    ops: list[Op]
    request_id: str | None = None  # a load for this request
    num_loaded: int = 0  # load: device blocks whose bytes arrived (ops before the first failure)


@dataclass(frozen=True)
class Completion:
    job_id: int
    failed: frozenset[int] = frozenset()  # indices of ops that failed (or were skipped: a load whose fetch failed)
    error: str | None = None  # the first failure's message


class Mover(Protocol):
    def submit(self, job: Job) -> None: ...

    def completions(self, wait_s: float = 0.0) -> list[Completion]: ...


@dataclass
class Slot:
    slot_id: int
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    ready: bool = False  # the bytes have landed
    pins: int = 0  # readers in flight (a load, a spill)


class TierIndex:
    """One lower tier's slots: hash → ready slot, an LRU of unpinned ready slots, a free list."""

    def __init__(self, tier: Tier, num_slots: int) -> None:
        self.tier = tier
        self.slots = [Slot(i) for i in range(num_slots)]
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[int, Slot] = {}  # ready or being written

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def num_used(self) -> int:
        return len(self.slots) - len(self._free)

    def get(self, block_hash: int) -> Slot | None:
        """The slot holding or receiving ``block_hash`` (ready or not)."""
        return self._by_hash.get(block_hash)

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> Slot | None:
        """A ready slot with exactly these tokens under this hash (a 64-bit collision never matches)."""
        slot = self._by_hash.get(block_hash)
        if slot is None or not slot.ready or slot.token_ids != tuple(token_ids):
            return None
        return slot

    def reserve(self, block_hash: int, token_ids: tuple[int, ...]) -> tuple[Slot, Slot | None] | None:
        """A slot to write ``block_hash`` into: a free one, else the least recently used unpinned ready one.
        Returns ``(slot, victim)`` — ``victim`` a copy of the evicted slot's state — or None if every slot
        is pinned or being written."""
        victim = None
        if self._free:
            slot = self.slots[self._free.pop()]
        elif self._lru:
            slot_id, _ = self._lru.popitem(last=False)
            slot = self.slots[slot_id]
            victim = Slot(slot.slot_id, slot.block_hash, slot.token_ids, True)
            del self._by_hash[slot.block_hash]
        else:
            return None
        slot.block_hash, slot.token_ids, slot.ready, slot.pins = block_hash, token_ids, False, 0
        self._by_hash[block_hash] = slot
        return slot, victim

    def landed(self, slot: Slot) -> None:
        slot.ready = True
        self._release_if_idle(slot)

    def drop(self, slot: Slot) -> None:
        """Forget a slot's block (a write that failed, bad bytes); the slot becomes free."""
        if self._by_hash.get(slot.block_hash) is slot:
            del self._by_hash[slot.block_hash]
        self._lru.pop(slot.slot_id, None)
        slot.block_hash, slot.token_ids, slot.ready, slot.pins = None, None, False, 0
        self._free.append(slot.slot_id)

    def pin(self, slot: Slot) -> None:
        slot.pins += 1
        self._lru.pop(slot.slot_id, None)

    def unpin(self, slot: Slot) -> None:
        slot.pins -= 1
        self._release_if_idle(slot)

    def _release_if_idle(self, slot: Slot) -> None:
        if slot.ready and slot.pins == 0 and self._by_hash.get(slot.block_hash) is slot:
            self._lru[slot.slot_id] = None  # most recently used end

    def hashes(self) -> list[int]:
        return [h for h, s in self._by_hash.items() if s.ready]

    def check(self) -> None:
        used = [s for s in self.slots if s.block_hash is not None]
        assert len(used) + len(self._free) == len(self.slots), (len(used), len(self._free), len(self.slots))
        assert all(self._by_hash[s.block_hash] is s for s in used)
        assert all(self.slots[i].ready and self.slots[i].pins == 0 for i in self._lru)
        assert all(s.pins >= 0 for s in self.slots)


@dataclass
class TierHit:
    tier: Tier  # the fastest lower tier holding the block
    block_hash: int
    token_ids: tuple[int, ...]


@dataclass
class TierStats:
    stores: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})  # copies landed per tier
    store_failures: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    stores_skipped: int = 0  # write-through impossible: every host slot pinned or being written
    loads: int = 0  # load jobs that finished (some blocks may have failed)
    loaded_blocks: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})  # by source tier
    load_failures: int = 0  # blocks whose load failed or whose disk file did not check out: recomputed
    waits_on_load: int = 0  # scheduling passes in which a request waited for another request's load


class TierManager:
    """The engine thread's view of the lower tiers: what is where, what to copy next, what landed."""

    def __init__(self, host_slots: int, disk_slots: int, mover: Mover, emit: Callable[[KVEvent], None],
                 worker_id: str) -> None:
        if host_slots <= 0:
            raise ValueError("a TierManager needs a host tier")
        self.host = TierIndex(Tier.HOST, host_slots)
        self.disk = TierIndex(Tier.DISK, disk_slots) if disk_slots > 0 else None
        self.mover = mover
        self._emit = emit
        self.worker_id = worker_id
        self.stats = TierStats()
        self._jobs: dict[int, Job] = {}
        self._next_job_id = 0
        self._loading: dict[int, int] = {}  # block hash → job id of the load bringing it to the device
        self._pinned_device: dict[int, list[object]] = {}  # job id → device blocks pinned while stored
        self._unpin_device: Callable[[list[object]], None] = lambda blocks: None

    # ---- queries ----------------------------------------------------------------------------------
    def usage(self) -> tuple[TierUsage, ...]:
        tiers = [TierUsage(Tier.HOST, self.host.num_slots, self.host.num_used)]
        if self.disk is not None:
            tiers.append(TierUsage(Tier.DISK, self.disk.num_slots, self.disk.num_used))
        return tuple(tiers)

    @property
    def num_jobs_in_flight(self) -> int:
        return len(self._jobs)

    def is_loading(self, block_hash: int) -> bool:
        return block_hash in self._loading

    def match(self, block_hashes: Sequence[int], token_ids_of: Callable[[int], tuple[int, ...]],
              first: int, limit: int) -> tuple[list[TierHit], bool]:
        """Blocks ``first, first+1, …`` (below ``limit``) held on a lower tier, contiguous. Returns the hits and
        whether the walk stopped at a block another request is loading (the caller then waits for it)."""
        hits: list[TierHit] = []
        for i in range(first, limit):
            h = block_hashes[i]
            if h in self._loading:
                return hits, True
            tokens = token_ids_of(i)
            if self.host.lookup(h, tokens) is not None:
                hits.append(TierHit(Tier.HOST, h, tokens))
            elif self.disk is not None and self.disk.lookup(h, tokens) is not None:
                hits.append(TierHit(Tier.DISK, h, tokens))
            else:
                break
        return hits, False

    # ---- write-through ------------------------------------------------------------------------------
    def offload(self, blocks: Sequence, unpin: Callable[[list[object]], None]) -> list[object]:
        """Copy newly cached device blocks (``Block`` objects: block_id, block_hash, token_ids) to the host
        tier. Returns the blocks the caller must pin until the job lands (``unpin`` then releases them)."""
        self._unpin_device = unpin
        ops: list[Op] = []
        pinned: list[object] = []
        for block in blocks:
            h = block.block_hash
            if h is None or self.host.get(h) is not None:
                continue  # evicted meanwhile, or already on the host (loaded from it, or stored before)
            reserved = self.host.reserve(h, block.token_ids)
            if reserved is None:
                self.stats.stores_skipped += 1
                continue
            slot, victim = reserved
            if victim is not None:
                ops += self._evict_host(victim)
            ops.append(Op("store", h, block.token_ids, host_slot=slot.slot_id, device_block=block.block_id))
            pinned.append(block)
        if ops:
            job = self._submit(ops)
            self._pinned_device[job.job_id] = pinned
        return pinned

    def _evict_host(self, victim: Slot) -> list[Op]:
        """The host slot ``victim`` is being reused: spill its block to disk first (if there is a disk tier
        that can take it), else it is gone from the host now."""
        h, tokens = victim.block_hash, victim.token_ids
        if self.disk is None or self.disk.get(h) is not None:
            self._emit(BlockRemoved(self.worker_id, (h,), Tier.HOST))
            return []
        reserved = self.disk.reserve(h, tokens)
        if reserved is None:
            self._emit(BlockRemoved(self.worker_id, (h,), Tier.HOST))
            return []
        _, disk_victim = reserved
        ops = []
        if disk_victim is not None:
            self._emit(BlockRemoved(self.worker_id, (disk_victim.block_hash,), Tier.DISK))
            ops.append(Op("delete", disk_victim.block_hash, disk_victim.token_ids))
        ops.append(Op("spill", h, tokens, host_slot=victim.slot_id))  # its removal from host once it landed
        return ops

    # ---- loading back -------------------------------------------------------------------------------
    def start_load(self, request_id: str, hits: Sequence[TierHit], device_block_ids: Sequence[int]) -> int:
        """Bring ``hits`` into ``device_block_ids`` (allocated by the caller); returns the job id."""
        ops: list[Op] = []
        for hit, block_id in zip(hits, device_block_ids, strict=True):
            slot = self.host.lookup(hit.block_hash, hit.token_ids)
            if slot is None:  # on disk only: fetch into a host slot first (promoted to the host tier)
                reserved = self.host.reserve(hit.block_hash, hit.token_ids)
                if reserved is None:
                    break  # every host slot busy: load what we have, recompute the rest
                slot, victim = reserved
                if victim is not None:
                    ops += self._evict_host(victim)
                self.disk.pin(self.disk.get(hit.block_hash))
                ops.append(Op("fetch", hit.block_hash, hit.token_ids, host_slot=slot.slot_id))
            self.host.pin(slot)
            ops.append(Op("load", hit.block_hash, hit.token_ids, host_slot=slot.slot_id, device_block=block_id))
        job = self._submit(ops, request_id)
        for op in ops:
            if op.kind == "load":
                self._loading[op.block_hash] = job.job_id
        return job.job_id

    # ---- completions --------------------------------------------------------------------------------
    def poll(self, wait_s: float = 0.0) -> list[Job]:
        """Apply what the mover finished; returns the finished load jobs (``num_loaded`` set)."""
        loads = []
        for done in self.mover.completions(wait_s):
            job = self._jobs.pop(done.job_id)
            self._settle(job, done)
            if job.request_id is not None:
                loads.append(job)
        return loads

    def _settle(self, job: Job, done: Completion) -> None:
        stats = self.stats
        fetched: set[int] = set()
        loads_ok = True  # still in the leading run of loaded blocks
        for i, op in enumerate(job.ops):
            ok = i not in done.failed
            if op.kind == "store":
                self._settle_write(self.host, op, ok)
            elif op.kind == "spill":
                self._settle_write(self.disk, op, ok)
                self._emit(BlockRemoved(self.worker_id, (op.block_hash,), Tier.HOST))  # after its store on disk
            elif op.kind == "fetch":
                self._settle_fetch(op, ok)
                if ok:
                    fetched.add(op.block_hash)
            elif op.kind == "load":
                self._loading.pop(op.block_hash, None)
                slot = self.host.get(op.block_hash)
                if slot is not None and slot.pins:
                    self.host.unpin(slot)
                loads_ok = loads_ok and ok
                if loads_ok:
                    job.num_loaded += 1
                    stats.loaded_blocks["disk" if op.block_hash in fetched else "host"] += 1
                elif not ok:
                    stats.load_failures += 1
        if job.request_id is not None:
            stats.loads += 1
        pinned = self._pinned_device.pop(job.job_id, None)
        if pinned:
            self._unpin_device(pinned)

    def _settle_fetch(self, op: Op, ok: bool) -> None:
        disk_slot = self.disk.get(op.block_hash) if self.disk is not None else None
        if disk_slot is not None:
            self.disk.unpin(disk_slot)
            if not ok:  # the file is missing or failed its checks: never read it again
                self._emit(BlockRemoved(self.worker_id, (op.block_hash,), Tier.DISK))
                self.disk.drop(disk_slot)
        self._settle_write(self.host, op, ok)

    def _settle_write(self, index: TierIndex, op: Op, ok: bool) -> None:
        slot = index.get(op.block_hash)
        if slot is None or slot.ready:
            return  # dropped or replaced meanwhile
        tier = index.tier.value
        if ok:
            index.landed(slot)
            self.stats.stores[tier] += 1
            self._emit(BlockStored(self.worker_id, (op.block_hash,), None, index.tier))
        else:
            self.stats.store_failures[tier] += 1
            index.drop(slot)

    def _submit(self, ops: list[Op], request_id: str | None = None) -> Job:
        job = Job(self._next_job_id, ops, request_id)
        self._next_job_id += 1
        self._jobs[job.job_id] = job
        self.mover.submit(job)
        return job

    def snapshot_events(self) -> list[KVEvent]:
        """BlockStored events for every ready block of the lower tiers (a resync after ``AllCleared``)."""
        events: list[KVEvent] = []
        for index in (self.host, self.disk):
            if index is not None and (hashes := index.hashes()):
                events.append(BlockStored(self.worker_id, tuple(hashes), None, index.tier))
        return events

    def check(self) -> None:
        self.host.check()
        if self.disk is not None:
            self.disk.check()
