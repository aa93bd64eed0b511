"""Router-side predicted load per worker: what this router dispatched and has not yet seen finish, merged
with the workers' latest ``WorkerLoad`` reports.

Reports lag (they are published once per engine step or on a timer, and travel), so a router that waited
for them would send a burst of requests to the same "idle" worker. The router therefore counts its own
traffic exactly and uses reports only for what it cannot see — load put there by other router replicas:

    own(w)      = sum over this router's in-flight dispatches to w   (updated on dispatch / finish)
    foreign(w)  = max(0, reported(w) - own(w) at the moment the report arrived)
    predicted(w) = own(w) now + foreign(w)

``foreign`` is held constant until the next report. Its error is the churn of one report's transit time:
work this router dispatched after the worker built the report is not in it (foreign is clamped at 0, so
this only hides other routers' load), work finished meanwhile is still in it (foreign is overstated until
the next report). With one router, foreign is ~0 and the prediction is
this router's own bookkeeping, exact up to the worker's internal state (prefix hits it found that the
router did not predict, preemptions). Per field:

  * ``queued_prefill_tokens`` — prompt tokens dispatched whose prefill has not completed (``prefill_done``),
    counting only the tokens the router expected to be uncached on that worker. Report: same field.
  * ``running_seqs`` — dispatched sequences not yet finished. Report: ``running + waiting``.
  * ``kv_blocks_used`` — KV blocks the dispatched sequences hold (the count given at dispatch; growth
    during decode is not tracked). Report: ``kv_blocks_used``.

Units are in the names: tokens, sequences, blocks. Pure Python, no clock: callers say when things happen.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.kv.events import WorkerLoad


@dataclass(frozen=True)
class LoadEstimate:
    queued_prefill_tokens: int = 0
    running_seqs: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int | None = None  # from the latest report; None before any report


@dataclass(frozen=True)
class _Dispatch:
    num_prefill_tokens: int
    num_kv_blocks: int


IDLE = LoadEstimate()  # a worker nothing is known about


class _Counts:
    __slots__ = ("prefill_tokens", "seqs", "kv_blocks")

    def __init__(self) -> None:
        self.prefill_tokens = 0
        self.seqs = 0
        self.kv_blocks = 0


class LoadTracker:
    def __init__(self) -> None:
        self._inflight: dict[tuple[str, str], _Dispatch] = {}  # (request_id, worker) -> dispatch
        self._prefilling: set[tuple[str, str]] = set()  # dispatches whose prefill tokens still count
        self._own: dict[str, _Counts] = {}
        self._foreign: dict[str, _Counts] = {}
        self._kv_blocks_total: dict[str, int] = {}
        self._estimates: dict[str, LoadEstimate] = {}  # cache of get(); dropped when a worker's counts change

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def workers(self) -> list[str]:
        return list(self._own)

    def get(self, worker: str) -> LoadEstimate:
        """Predicted load of ``worker`` (all zeros for a worker never seen). Cached until it changes."""
        est = self._estimates.get(worker)
        if est is not None:
            return est
        own = self._own.get(worker)
        if own is None:
            return IDLE
        foreign = self._foreign[worker]
        est = self._estimates[worker] = LoadEstimate(
            queued_prefill_tokens=own.prefill_tokens + foreign.prefill_tokens,
            running_seqs=own.seqs + foreign.seqs,
            kv_blocks_used=own.kv_blocks + foreign.kv_blocks,
            kv_blocks_total=self._kv_blocks_total.get(worker),
        )
        return est

    def estimates(self, workers: Iterable[str]) -> dict[str, LoadEstimate]:
        return {w: self.get(w) for w in workers}

    def num_inflight(self, worker: str | None = None) -> int:
        if worker is None:
            return len(self._inflight)
        return sum(1 for (_, w) in self._inflight if w == worker)

    def requests_on(self, worker: str) -> list[str]:
        """The ids of the requests in flight on ``worker``."""
        return [rid for (rid, w) in self._inflight if w == worker]

    # ---- bookkeeping -----------------------------------------------------------------------------
    def add_worker(self, worker: str) -> None:
        if worker not in self._own:
            self._own[worker] = _Counts()
            self._foreign[worker] = _Counts()

    def remove_worker(self, worker: str) -> list[str]:
        """Forget a worker; returns the ids of requests that were in flight on it (the caller fails or
        re-dispatches them)."""
        lost = [rid for (rid, w) in self._inflight if w == worker]
        for rid in lost:
            del self._inflight[(rid, worker)]
            self._prefilling.discard((rid, worker))
        self._own.pop(worker, None)
        self._estimates.pop(worker, None)
        self._foreign.pop(worker, None)
        self._kv_blocks_total.pop(worker, None)
        return lost

    def dispatch(self, request_id: str, worker: str, *, num_prefill_tokens: int, num_kv_blocks: int) -> None:
        """The router sent ``request_id`` to ``worker``: ``num_prefill_tokens`` to compute there (0 for a
        decode worker that receives its KV), ``num_kv_blocks`` it will hold."""
        key = (request_id, worker)
        if key in self._inflight:
            raise ValueError(f"request {request_id!r} already dispatched to {worker!r}")
        if num_prefill_tokens < 0 or num_kv_blocks < 0:
            raise ValueError("negative load")
        self.add_worker(worker)
        self._estimates.pop(worker, None)
        self._inflight[key] = _Dispatch(num_prefill_tokens, num_kv_blocks)
        own = self._own[worker]
        own.seqs += 1
        own.kv_blocks += num_kv_blocks
        if num_prefill_tokens:
            own.prefill_tokens += num_prefill_tokens
            self._prefilling.add(key)

    def prefill_done(self, request_id: str, worker: str) -> bool:
        """The request's prefill finished on ``worker`` (its tokens leave the queue; the sequence stays
        until ``finish``). Returns False if there was nothing to do (unknown or already done)."""
        key = (request_id, worker)
        if key not in self._prefilling:
            return False
        self._prefilling.discard(key)
        self._estimates.pop(worker, None)
        self._own[worker].prefill_tokens -= self._inflight[key].num_prefill_tokens
        return True

    def finish(self, request_id: str, worker: str) -> bool:
        """The request left ``worker`` (finished, handed off, aborted or failed). Idempotent: returns False
        for a request not in flight there."""
        key = (request_id, worker)
        dispatch = self._inflight.pop(key, None)
        if dispatch is None:
            return False
        self._estimates.pop(worker, None)
        own = self._own[worker]
        if key in self._prefilling:  # finished (or aborted) before its prefill was reported done
            self._prefilling.discard(key)
            own.prefill_tokens -= dispatch.num_prefill_tokens
        own.seqs -= 1
        own.kv_blocks -= dispatch.num_kv_blocks
        return True

    def report(self, load: WorkerLoad) -> None:
        """Merge a worker's own report: whatever it counts beyond this router's in-flight work is
        attributed to other routers and held until the next report."""
        self.add_worker(load.worker)
        self._estimates.pop(load.worker, None)
        own = self._own[load.worker]
        foreign = self._foreign[load.worker]
        foreign.prefill_tokens = max(0, load.queued_prefill_tokens - own.prefill_tokens)
        foreign.seqs = max(0, load.running + load.waiting - own.seqs)
        foreign.kv_blocks = max(0, load.kv_blocks_used - own.kv_blocks)
        self._kv_blocks_total[load.worker] = load.kv_blocks_total
