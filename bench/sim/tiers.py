"""Lower KV tiers and peer fetches in the simulator: duet's real ``TierManager`` with simulated copies.

A worker with tiers runs engine/kv/tiers.py's ``TierManager`` (write-through to host, spill to disk on host
eviction, loads back through the scheduler's ``_load_from_tiers`` / ``finish_load``) on a ``SimMover``: the
bytes never exist, each job takes the time its ops take on the engine's copy channel and completes when
the simulation clock passes its finish time.

Copy channel (one per engine, jobs run one after another in submission order, as ``TierMover``'s one
thread runs them): an op moves one block, ``bytes_per_block`` bytes, at its medium's bandwidth — store
(device → host) and load (host → device) over PCIe, spill (host → disk) at the disk's write bandwidth,
fetch (disk → host) at its read bandwidth; a delete costs nothing. Defaults (``TierSpec``): PCIe Gen5 x16
host↔GPU ~50 GB/s, an NVMe drive ~7 GB/s read and write.

Peer fetch (modelled, not the engine's import path: the engine reads lent blocks straight into device blocks): when the
router's decision names a peer holding a longer prefix than the chosen worker holds on any tier, the chosen engine
reserves host slots for the blocks it lacks (up to the peer's run of blocks held on its device or host tier, checked on
the peer at that moment) and one job copies them peer → host over the worker's NIC channel (RDMA, ~50 GB/s,
+ ``peer_fixed_s`` per fetch), separate from the copy channel. When it lands the blocks are ordinary
host-tier blocks (``BlockStored(tier=host)``) and the request enters the scheduler, which loads them to the
device like any host hit (PCIe). The peer's blocks are not pinned or consumed (a read of a few tens of ms;
an eviction on the peer meanwhile is not modelled).

Routing on tiers: a ``PrefixIndex`` that knows tiers (tiers-router) gets every event as is; one that does
not (main: a ``BlockRemoved`` of the host copy would drop the device copy too) is fed through ``TierFeed``,
which turns per-tier events into "held on some tier" events, so cache_aware counts a host or disk block
like a device block.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import router.routing.index
from engine.kv.block_pool import BlockPool
from engine.kv.events import AllCleared, BlockRemoved, BlockStored, KVEvent, Tier
from engine.kv.tiers import Completion, Job, Op, TierManager

INDEX_KNOWS_TIERS = hasattr(router.routing.index, "TierMatch")  # tiers-router's PrefixIndex

GB = 1e9


@dataclass(frozen=True)
class TierSpec:
    """One worker's lower tiers and the bandwidths that move blocks between them (every worker alike)."""

    host_blocks: int
    disk_blocks: int = 0
    peers: bool = False  # fetch a longer prefix from the peer the router names
    pcie_bytes_per_s: float = 50 * GB  # host <-> device
    disk_read_bytes_per_s: float = 7 * GB
    disk_write_bytes_per_s: float = 7 * GB
    rdma_bytes_per_s: float = 50 * GB  # peer -> host, one 400 Gb/s NIC per worker
    peer_fixed_s: float = 1e-3  # per peer fetch: the request to the peer, NIXL setup, notification
    # a lower-tier (host / disk / peer) block's bytes over a device block's: < 1 where the lower tiers keep the KV in
    # int8 under a bf16 device cache (quantized on the way down, dequantized on the way up; the conversion, at HBM
    # speed, is not modelled)
    lower_bytes_scale: float = 1.0

    def describe(self) -> dict:
        return asdict(self)


# ---- the mover ----------------------------------------------------------------------------------------

class SimMover:
    """The ``Mover`` protocol on simulated time: ``advance_to(now_s)`` moves the clock; ``completions``
    returns the jobs whose finish time has passed. ``wait_s`` is ignored (simulated time never passes
    inside a call)."""

    def __init__(self, spec: TierSpec, bytes_per_block: float) -> None:
        self.spec, self.bytes_per_block = spec, bytes_per_block
        self.now_s = 0.0
        self.channel_free_s = {"copy": 0.0, "nic": 0.0}
        self.busy_s = {"copy": 0.0, "nic": 0.0}  # total time each channel moved bytes
        self._done: list[tuple[float, int]] = []  # (finish time, job id) heap

    def op_time_s(self, op: Op) -> float:
        bw = {"store": self.spec.pcie_bytes_per_s, "load": self.spec.pcie_bytes_per_s,
              "spill": self.spec.disk_write_bytes_per_s, "fetch": self.spec.disk_read_bytes_per_s}.get(op.kind)
        return self.bytes_per_block * self.spec.lower_bytes_scale / bw if bw else 0.0

    def job_time_s(self, job: Job, channel: str = "copy") -> float:
        if channel == "nic":
            return self.spec.peer_fixed_s + len(job.ops) * self.bytes_per_block * self.spec.lower_bytes_scale / \
                self.spec.rdma_bytes_per_s
        return sum(self.op_time_s(op) for op in job.ops)

    def submit(self, job: Job, channel: str = "copy") -> None:
        start = max(self.now_s, self.channel_free_s[channel])
        duration = self.job_time_s(job, channel)
        self.channel_free_s[channel] = end = start + duration
        self.busy_s[channel] += duration
        heapq.heappush(self._done, (end, job.job_id))

    def advance_to(self, now_s: float) -> None:
        self.now_s = max(self.now_s, now_s)

    def completions(self, wait_s: float = 0.0) -> list[Completion]:
        out = []
        while self._done and self._done[0][0] <= self.now_s:
            out.append(Completion(heapq.heappop(self._done)[1]))
        return out

    def next_completion_s(self) -> float | None:
        return self._done[0][0] if self._done else None

    def close(self) -> None:
        """Nothing to stop: simulated copies run on no thread."""


class SimTierManager(TierManager):
    """``TierManager`` plus the peer import this simulator models (module docstring)."""

    def __init__(self, spec: TierSpec, mover: SimMover, emit: Callable[[KVEvent], None], worker_id: str) -> None:
        super().__init__(spec.host_blocks, spec.disk_blocks, mover, emit, worker_id)
        self._peer_jobs: set[int] = set()
        self.peer_done: list[Job] = []  # peer imports that landed, for the engine to collect
        self.peer_fetches = 0
        self.peer_blocks = 0

    def import_from_peer(self, blocks: Sequence[tuple[int, tuple[int, ...]]]) -> Job | None:
        """Reserve host slots for ``blocks`` ((hash, token ids), in prefix order; none on this worker) and
        submit one peer → host job on the NIC channel. Stops at a block already here or being written, or
        when every host slot is busy. None if nothing was reserved."""
        ops: list[Op] = []
        fetched = 0
        for h, tokens in blocks:
            if self.host.get(h) is not None or (self.disk is not None and self.disk.get(h) is not None):
                break
            reserved = self.host.reserve(h, tokens)
            if reserved is None:
                break
            slot, victim = reserved
            if victim is not None:
                ops += self._evict_host(victim)
            ops.append(Op("fetch", h, tokens, host_slot=slot.slot_id))  # settles as a host write (no disk slot)
            fetched += 1
        if not fetched:
            return None
        job = Job(self._next_job_id, ops)
        self._next_job_id += 1
        self._jobs[job.job_id] = job
        self._peer_jobs.add(job.job_id)
        self.peer_fetches += 1
        self.peer_blocks += fetched
        self.mover.submit(job, "nic")
        return job

    def _settle(self, job: Job, done: Completion) -> None:
        super()._settle(job, done)
        if job.job_id in self._peer_jobs:
            self._peer_jobs.discard(job.job_id)
            self.peer_done.append(job)

    def holds(self, block_hash: int, token_ids: tuple[int, ...], *, disk: bool) -> bool:
        """A ready copy on the host tier (or, with ``disk``, on the disk tier)."""
        if self.host.lookup(block_hash, token_ids) is not None:
            return True
        return disk and self.disk is not None and self.disk.lookup(block_hash, token_ids) is not None


def tier_counters(tiers: Sequence[SimTierManager]) -> dict[str, int]:
    """A run's lower-tier counters, summed over its workers."""
    def total(get) -> int:
        return sum(get(t) for t in tiers)

    return {"peer_fetches": total(lambda t: t.peer_fetches), "peer_blocks": total(lambda t: t.peer_blocks),
            "tier_loads": total(lambda t: t.stats.loads),
            "tier_loaded_host_blocks": total(lambda t: t.stats.loaded_blocks["host"]),
            "tier_loaded_disk_blocks": total(lambda t: t.stats.loaded_blocks["disk"]),
            "tier_stored_host_blocks": total(lambda t: t.stats.stores["host"]),
            "tier_stored_disk_blocks": total(lambda t: t.stats.stores["disk"]),
            "tier_stores_skipped": total(lambda t: t.stats.stores_skipped),
            "tier_waits_on_load": total(lambda t: t.stats.waits_on_load),
            "copy_busy_ms": round(1e3 * total(lambda t: t.mover.busy_s["copy"])),
            "nic_busy_ms": round(1e3 * total(lambda t: t.mover.busy_s["nic"]))}


# ---- routing on a tier-blind index ----------------------------------------------------------------------

class TierFeed:
    """Per-tier events → events of a tier-blind ``PrefixIndex``: a worker holds a block while it holds it on
    some tier. (With a tier-aware index, ``forward`` passes everything through.)"""

    def __init__(self) -> None:
        self._tiers: dict[str, dict[int, set]] = {}  # worker -> hash -> tiers holding it

    def forward(self, events: Iterable[KVEvent]) -> list[KVEvent]:
        if INDEX_KNOWS_TIERS:
            return list(events)
        out: list[KVEvent] = []
        for e in events:
            held = self._tiers.setdefault(e.worker, {})
            if isinstance(e, BlockStored):
                new = []
                for h in e.block_hashes:
                    tiers = held.setdefault(h, set())
                    if not tiers:
                        new.append(h)
                    tiers.add(e.tier)
                if new:
                    out.append(BlockStored(e.worker, tuple(new), None))
            elif isinstance(e, BlockRemoved):
                out += self._drop(held, e.worker, e.block_hashes, e.tier)
            elif isinstance(e, AllCleared):  # the device tier was reset: the lower tiers keep theirs
                out += self._drop(held, e.worker, list(held), Tier.DEVICE)
        return out

    @staticmethod
    def _drop(held: dict[int, set], worker: str, hashes: Iterable[int], tier: Tier) -> list[KVEvent]:
        """``tier`` no longer holds ``hashes``: a removal for those no tier holds any more."""
        gone = []
        for h in hashes:
            tiers = held.get(h)
            if tiers is None:
                continue
            tiers.discard(tier)
            if not tiers:
                del held[h]
                gone.append(h)
        return [BlockRemoved(worker, tuple(gone))] if gone else []


def match_total(m) -> int:
    """A ``PrefixIndex.match`` value: an int (main) or a ``TierMatch`` (tiers-router)."""
    return m if isinstance(m, int) else m.total


def best_peer(decision, index, hashes: Sequence[int], worker: str) -> tuple[str | None, int]:
    """The peer the router's decision names for ``worker`` and how many leading blocks it holds beyond the
    worker's own: the decision's ``peer`` / ``peer_blocks`` when the policy computes them (tiers-router),
    else the other worker with the longest ``PrefixIndex.match``."""
    if hasattr(decision, "peer") and decision.worker == worker:
        return decision.peer, decision.peer_blocks
    matches = index.match(hashes)
    own = match_total(matches.get(worker, 0))
    best, best_n = None, own
    for w, m in matches.items():
        if w != worker and match_total(m) > best_n:
            best, best_n = w, match_total(m)
    return best, best_n - own if best is not None else 0


# ---- the global-LRU reference -----------------------------------------------------------------------------

def global_lru_hit_rate(prompts: Iterable[tuple[Sequence[int], Sequence[int]]], capacity_blocks: int,
                        block_size: int) -> float:
    """Prompt-token hit rate of one LRU cache of ``capacity_blocks`` serving every prompt in arrival order
    (bench/sim/trace_replay.py's pooled LRU: a real ``BlockPool``, blocks cached as soon as the prompt
    is seen). ``prompts`` = (token ids, block hashes). As the scheduler does, the block holding the last
    prompt token is never a hit (its logits must be computed)."""
    from bench.sim.trace_replay import acquire, release

    pool = BlockPool(capacity_blocks)
    hit = total = 0
    for tokens, hashes in prompts:
        full = list(hashes[: len(tokens) // block_size])
        hits, new = acquire(pool, full, tokens, block_size)
        hit += min(len(hits), (len(tokens) - 1) // block_size) * block_size
        total += len(tokens)
        release(pool, hits, new, full, tokens, block_size)
    return hit / total if total else 0.0
