"""Leases: the prefill side's promise not to reuse blocks a decode worker is about to pull.

After prefill, the owner (the engine's block pool) keeps a request's blocks referenced and registers
them here under a lease id with a deadline. The lease ends exactly once, in one of three ways:

- `release(lease_id)`   the puller's completion notice arrived (ok) — the normal path;
- `release(..., ok=False)` the puller reported a failed transfer — counted in `counters.failed`;
- `expire_overdue()`     the deadline passed with no notice — counted in `counters.expired`.

Each way hands the lease's block ids to `on_release(block_ids)` once, so the owner drops its
references. Two leases may name the same block (two requests sharing a prefix): each lease is one
reference, released separately, so the owner's refcounts stay exact.

NIXL delivers the READ's notification only after the data has landed, so a release on notice is always
safe; an expiry is safe only if the puller has given up by then. The puller keeps that by the lease's deadline
(`deadline_unix_s`, carried in the handoff): it neither starts nor trusts a read that ends within a clock margin
of it (prefill_worker/puller.py) — a transfer timeout alone does not bound how long a handoff waited before its
read. A notice for a lease that is no longer held (it expired, or was already released) is counted in
`counters.late_notices` — a non-zero value means the lease timeout is too short for the pull path.

Pure Python with an injectable clock (`clock() -> seconds`, monotonic by default), so tests are exact.
Not thread-safe: one owner thread calls it (the worker loop that also polls notifications).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvtransfer.wire import ReleaseNotice

DEFAULT_LEASE_TIMEOUT_S = 60.0
# A pull must end this long before its owner's lease does (TransferRequest.deadline_unix_s, the owner's wall
# clock): what the hosts' clocks may disagree by (NTP keeps them within milliseconds) plus the time from the
# READ's last byte to the puller's check of the clock (prefill_worker/puller.py)
LEASE_CLOCK_MARGIN_S = 0.5


@dataclass(frozen=True)
class Lease:
    lease_id: str
    block_ids: tuple[int, ...]
    acquired_at_s: float
    expires_at_s: float


@dataclass
class LeaseCounters:
    """Monotonic counters; the cluster exports them (e.g. as Prometheus counters)."""

    acquired: int = 0
    released: int = 0  # ended by an ok notice
    failed: int = 0  # ended by a failure notice
    expired: int = 0  # ended by the deadline
    late_notices: int = 0  # notice for a lease that was no longer held


class LeaseTable:
    """Blocks pinned for in-flight pulls, keyed by lease id."""

    def __init__(
        self,
        on_release: Callable[[tuple[int, ...]], None],
        *,
        default_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if default_timeout_s <= 0:
            raise ValueError(f"default_timeout_s must be positive, got {default_timeout_s}")
        self._on_release = on_release
        self._default_timeout_s = default_timeout_s
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._deadlines: list[tuple[float, str]] = []  # min-heap; entries of ended leases are skipped
        self.counters = LeaseCounters()

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases

    @property
    def num_held_blocks(self) -> int:
        """Block references held (a block in two leases counts twice)."""
        return sum(len(lease.block_ids) for lease in self._leases.values())

    def get_lease(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def get_next_deadline_s(self) -> float | None:
        """Earliest expiry among held leases (clock time), so a caller can sleep until then."""
        self._drop_stale_deadlines()
        return self._deadlines[0][0] if self._deadlines else None

    def acquire(self, lease_id: str, block_ids: Sequence[int], *, timeout_s: float | None = None) -> Lease:
        """Pin `block_ids` under `lease_id` until released or `timeout_s` (default) from now."""
        if lease_id in self._leases:
            raise ValueError(f"lease {lease_id!r} is already held")
        timeout_s = self._default_timeout_s if timeout_s is None else timeout_s
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        now = self._clock()
        lease = Lease(lease_id, tuple(block_ids), acquired_at_s=now, expires_at_s=now + timeout_s)
        self._leases[lease_id] = lease
        heapq.heappush(self._deadlines, (lease.expires_at_s, lease_id))
        self.counters.acquired += 1
        return lease

    def deadline_unix_s(self, lease_id: str) -> float:
        """When the held lease ``lease_id`` runs out, on the wall clock (``time.time()``): what a puller in another
        process, or on another host, compares with its own clock (``TransferRequest.deadline_unix_s``)."""
        return time.time() + (self._leases[lease_id].expires_at_s - self._clock())

    def release(self, lease_id: str, *, ok: bool = True) -> bool:
        """End a lease on the puller's notice; False (and counted) if it was not held."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            self.counters.late_notices += 1
            return False
        if ok:
            self.counters.released += 1
        else:
            self.counters.failed += 1
        self._on_release(lease.block_ids)
        return True

    def apply_notices(self, notices: Iterable[ReleaseNotice]) -> int:
        """Release every lease named by `notices`; returns how many were held."""
        return sum(self.release(notice.lease_id, ok=notice.ok) for notice in notices)

    def expire_overdue(self) -> list[str]:
        """End every lease whose deadline has passed; returns their ids, earliest first."""
        now = self._clock()
        expired: list[str] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline_s, lease_id = heapq.heappop(self._deadlines)
            if not self._is_live(deadline_s, lease_id):
                continue
            lease = self._leases.pop(lease_id)
            self.counters.expired += 1
            expired.append(lease_id)
            self._on_release(lease.block_ids)
        return expired

    def _is_live(self, deadline_s: float, lease_id: str) -> bool:
        # A heap entry is stale once its lease ended; a re-acquired id has a new deadline.
        lease = self._leases.get(lease_id)
        return lease is not None and lease.expires_at_s == deadline_s

    def _drop_stale_deadlines(self) -> None:
        while self._deadlines and not self._is_live(*self._deadlines[0]):
            heapq.heappop(self._deadlines)
