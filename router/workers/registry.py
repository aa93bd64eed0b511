"""The one registry of workers, owned by the router process (DESIGN.md, "Operating the cluster").

Every worker the cluster runs has one record here: id, role, state, pid/node, when it started and became
ready, its client (how the router acts on it), its latest load report and stats. Dispatch routes only to
``ready`` workers; ``/admin/*``, ``/metrics``, the autoscaler and the dashboard all read this registry,
and nothing else keeps a list of workers.

    starting ──ready()──▶ ready ──drain()──▶ draining ──dead()──▶ dead
        └──────────────────────┴───────────────────────────────────────▲  (a fault, from any live state)

Transitions are methods (a state never goes backwards; a dead record stays, with its reason, for the
operator to see, until ``forget_dead`` trims the history). Pure Python, no clock: callers pass the time.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.kv.events import Tier, WorkerLoad
from router.routing.policy import Role


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


LIVE_STATES = (WorkerState.STARTING, WorkerState.READY, WorkerState.DRAINING)
_NEXT = {
    WorkerState.STARTING: {WorkerState.READY, WorkerState.DEAD},
    WorkerState.READY: {WorkerState.DRAINING, WorkerState.DEAD},
    WorkerState.DRAINING: {WorkerState.DEAD},
    WorkerState.DEAD: set(),
}


@dataclass
class WorkerRecord:
    worker_id: str
    role: Role
    state: WorkerState
    started_s: float
    client: Any = None  # router.dispatch.cluster_backend.WorkerClient once the worker answered (None while starting)
    pid: int | None = None
    node: str | None = None
    ready_s: float | None = None
    ended_s: float | None = None
    reason: str = ""  # why it is draining or dead
    fault: bool = False  # dead because it failed (not drained)
    load: WorkerLoad | None = None  # latest report (KV event plane)
    load_s: float | None = None
    stats: dict[str, Any] = field(default_factory=dict)  # latest stats() snapshot
    stats_s: float | None = None

    def age_s(self, now_s: float) -> float:
        """Time since the worker became ready (0 before): what warm-up exclusion looks at."""
        return 0.0 if self.ready_s is None else max(0.0, now_s - self.ready_s)

    def summary(self, now_s: float) -> dict[str, Any]:
        """The operator's view (GET /admin/workers)."""
        stats, load = self.stats, self.load
        return {
            "worker_id": self.worker_id, "role": self.role.value, "state": self.state.value, "pid": self.pid,
            "node": self.node, "reason": self.reason or None, "fault": self.fault,
            "uptime_s": None if self.ready_s is None else round(now_s - self.ready_s, 3),
            "running": load.running if load else stats.get("running"),
            "waiting": load.waiting if load else stats.get("waiting"),
            "queued_prefill_tokens": load.queued_prefill_tokens if load else None,
            "kv_blocks_used": load.kv_blocks_used if load else stats.get("kv_blocks_used"),
            "kv_blocks_total": load.kv_blocks_total if load else stats.get("kv_blocks_total"),
            "kv_tiers": tier_usage(load) if load else None,
            "load_age_s": None if self.load_s is None else round(now_s - self.load_s, 3),
            "stats": stats,
        }


def tier_usage(load: WorkerLoad) -> dict[str, dict[str, int]]:
    """Each KV tier's size from a load report: ``{tier: {"blocks_total", "blocks_used"}}``, the device tier
    first (it is ``kv_blocks_*``), then the lower tiers the worker reported."""
    out = {Tier.DEVICE.value: {"blocks_total": load.kv_blocks_total, "blocks_used": load.kv_blocks_used}}
    for usage in load.tiers:
        out[usage.tier.value] = {"blocks_total": usage.blocks_total, "blocks_used": usage.blocks_used}
    return out


class RegistryError(ValueError):
    """An unknown worker or a transition the lifecycle does not allow."""


class WorkerRegistry:
    def __init__(self, max_dead: int = 64) -> None:
        self._records: dict[str, WorkerRecord] = {}
        self.max_dead = max_dead

    # ---- queries --------------------------------------------------------------------------------
    def get(self, worker_id: str) -> WorkerRecord:
        try:
            return self._records[worker_id]
        except KeyError:
            raise RegistryError(f"unknown worker {worker_id!r}") from None

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._records

    def records(self, role: Role | None = None, states: Iterable[WorkerState] | None = None) -> list[WorkerRecord]:
        wanted = None if states is None else set(states)
        return [r for r in self._records.values()
                if (role is None or r.role == role) and (wanted is None or r.state in wanted)]

    def ready(self, role: Role) -> list[WorkerRecord]:
        return self.records(role, (WorkerState.READY,))

    def live(self, role: Role | None = None) -> list[WorkerRecord]:
        return self.records(role, LIVE_STATES)

    def counts(self) -> dict[tuple[Role, WorkerState], int]:
        out = {(role, state): 0 for role in Role for state in WorkerState}
        for r in self._records.values():
            out[(r.role, r.state)] += 1
        return out

    # ---- transitions ----------------------------------------------------------------------------
    def add(self, worker_id: str, role: Role, now_s: float, *, client: Any = None, pid: int | None = None,
            node: str | None = None) -> WorkerRecord:
        if worker_id in self._records and self._records[worker_id].state != WorkerState.DEAD:
            raise RegistryError(f"worker {worker_id!r} is already registered")
        rec = WorkerRecord(worker_id, Role(role), WorkerState.STARTING, now_s, client=client, pid=pid, node=node)
        self._records[worker_id] = rec
        return rec

    def mark_ready(self, worker_id: str, now_s: float, *, client: Any = None, pid: int | None = None,
                   node: str | None = None) -> WorkerRecord:
        rec = self._move(worker_id, WorkerState.READY)
        rec.ready_s = now_s
        rec.client = client if client is not None else rec.client
        rec.pid = pid if pid is not None else rec.pid
        rec.node = node if node is not None else rec.node
        return rec

    def mark_draining(self, worker_id: str, reason: str) -> WorkerRecord:
        rec = self._move(worker_id, WorkerState.DRAINING)
        rec.reason = reason
        return rec

    def mark_dead(self, worker_id: str, reason: str, now_s: float, *, fault: bool) -> WorkerRecord | None:
        """A worker ended (``fault``: it failed; else it was drained or stopped). None if it was already dead."""
        rec = self.get(worker_id)
        if rec.state == WorkerState.DEAD:
            return None
        self._move(worker_id, WorkerState.DEAD)
        rec.reason, rec.ended_s, rec.fault = reason, now_s, fault
        self._trim_dead()
        return rec

    def update_load(self, load: WorkerLoad, now_s: float) -> None:
        rec = self._records.get(load.worker)
        if rec is not None and rec.state != WorkerState.DEAD:
            rec.load, rec.load_s = load, now_s

    def update_stats(self, worker_id: str, stats: dict[str, Any], now_s: float) -> None:
        rec = self._records.get(worker_id)
        if rec is not None and rec.state != WorkerState.DEAD:
            rec.stats, rec.stats_s = stats, now_s

    def _move(self, worker_id: str, state: WorkerState) -> WorkerRecord:
        rec = self.get(worker_id)
        if state not in _NEXT[rec.state]:
            raise RegistryError(f"worker {worker_id!r} cannot go from {rec.state.value} to {state.value}")
        rec.state = state
        return rec

    def _trim_dead(self) -> None:
        dead = sorted((r for r in self._records.values() if r.state == WorkerState.DEAD), key=lambda r: r.ended_s or 0)
        for rec in dead[: max(0, len(dead) - self.max_dead)]:
            del self._records[rec.worker_id]
