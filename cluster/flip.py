"""Role flips: when one pool has a worker too many and the other one too few, move a worker across in place.

The autoscaler's rebalancing (one role's target −1, the other's +1 in the same tick) and the admin API's
two writes at the same budget both produce that state. Drain + start would load the model a second time
(and, at the budget, need a spare device for the starting worker while the other drains). A flip instead:

    mark it draining (no new requests) ── wait until idle (drain_worker's rule) ── flip_role (in place,
    new id in the new role's numbering) ── handshake as the new role ── ready in the new pool

The decision is pure (``choose_flip``: counts in, (from, to) out; ``prefer_flip``: measured times in), the
act is ``RoleFlips.flip_worker``, a part of the PoolManager (cluster/pools.py). Rules:
- Flips need ``lifecycle.role_flip`` (default true) and pools that would build a worker the same way
  (``flip_blockers``: same engine config but the worker id — model, device, dtype, block size, KV sizes —
  and the same Ray placement: GPUs, CPUs, custom resources). Otherwise, and when the measured flips (from
  the decision to ready) have been slower than the measured cold starts (median of the last
  ``TIMES_KEPT`` each), the pools drain + start instead: a fallback, logged with its reason and counted
  (``flip_fallbacks``; ``duet_role_flips_total{outcome="fallback"}``).
- A worker that refuses the flip after its drain (its engine config is not the new pool's: a fallback) or
  fails it (an error, a timeout: ``flip_failures``) is stopped, as a drain ends; the reconcile then starts
  a worker for the pool that is short. A worker that is not idle yet is waited for, up to
  ``lifecycle.drain_timeout_s`` (then stopped anyway, as a drain that timed out: ``flip_failures``).
- Timing: ``flip_s`` runs from the worker idle to it ready in its new role (what the flip itself costs,
  the thing to compare with ``cold_start_s``, spawn to ready); ``total_s`` adds the drain wait.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayTaskError

from cluster.config import ClusterConfig
from cluster.handshake import shake_hands
from cluster.ray_client import RayWorkerClient
from cluster.spawn import worker_engine_config
from prefill_worker.base import FlipRefusedError, WorkerBusyError, reload_reason
from router.routing.policy import Role
from router.workers.registry import WorkerState

log = logging.getLogger(__name__)

TIMES_KEPT = 20
DRAIN_FLIP_GRACE_S = 1.0  # a drain stops its worker no sooner: time for the admin's second write to make it a flip
PREFER_WINDOW = 5  # flips vs cold starts: the medians of this many latest of each


@dataclass(frozen=True)
class PoolCounts:
    """One pool, as the reconcile sees it."""

    target: int
    active: int  # starting + ready
    ready: int
    draining: int
    acting: bool  # an action of this role (start, drain, flip) is in progress
    convertible: int = 0  # drains of this role still waiting for their worker to be idle, not yet decided


@dataclass(frozen=True)
class FlipMove:
    src: Role
    dst: Role
    convert: bool  # True: a drain of src in progress becomes the flip; False: a new flip (drain + flip)


def choose_flip(prefill: PoolCounts, decode: PoolCounts) -> FlipMove | None:
    """The flip that is both pools' next step, or None (each pool then reconciles on its own). The pool short
    of its target (fewer active workers than it, no action of its own) takes a worker from the other when
    that one has more ready workers than its target, no action and none draining (a new flip), or has a drain
    in progress whose worker is not idle yet (that drain becomes the flip: the admin API lowers one target,
    then raises the other)."""
    for src, dst, a, b in ((Role.PREFILL, Role.DECODE, prefill, decode), (Role.DECODE, Role.PREFILL, decode, prefill)):
        if b.acting or b.active >= b.target:
            continue
        if not a.acting and a.ready > a.target and not a.draining:
            return FlipMove(src, dst, convert=False)
        if a.convertible:
            return FlipMove(src, dst, convert=True)
    return None


def prefer_flip(flip_total_s: Sequence[float], cold_start_s: Sequence[float]) -> str | None:
    """None when a flip is the cheaper way to move a worker across; else why not. Without measurements of
    both, flip (it loads nothing). With both, compare the medians of the latest ``PREFER_WINDOW``: a flip
    (drain wait included: the new pool gets its worker only after it) against a cold start."""
    if not flip_total_s or not cold_start_s:
        return None
    flip = statistics.median(flip_total_s[-PREFER_WINDOW:])
    cold = statistics.median(cold_start_s[-PREFER_WINDOW:])
    if flip <= cold:
        return None
    return f"measured flips took {flip:.2f} s (median, drain included), cold starts {cold:.2f} s"


def flip_blockers(config: ClusterConfig) -> list[str]:
    """Why a worker of one pool cannot become a worker of the other in place (empty: it can)."""
    out = []
    reason = reload_reason(worker_engine_config(config, config.prefill), worker_engine_config(config, config.decode))
    if reason is not None:
        out.append(f"the pools' engine configs differ ({reason}): a reload")
    for key in ("num_gpus", "num_cpus", "resources"):
        a, b = getattr(config.prefill, key), getattr(config.decode, key)
        if a != b:
            out.append(f"{key} {a!r} (prefill) != {b!r} (decode): an actor keeps the placement it started with")
    return out


class RoleFlips:
    """The PoolManager's flips (a mixin: it uses the manager's registry, handles, handshake and counters)."""

    def _init_flips(self) -> None:
        self.flip_blockers = flip_blockers(self.config)
        # draining worker -> None (may still become a flip), the role it flips into, or "stop" (decided)
        self._drain_into: dict[str, Role | str | None] = {}
        self.flips: collections.deque[dict[str, Any]] = collections.deque(maxlen=TIMES_KEPT)
        self.cold_starts: collections.deque[dict[str, Any]] = collections.deque(maxlen=TIMES_KEPT)
        if self.config.lifecycle.role_flip and self.flip_blockers:
            log.warning("role flips are on but impossible between these pools (drain + start instead): %s",
                        "; ".join(self.flip_blockers))

    def _try_flip(self, counts: dict[Role, PoolCounts]) -> bool:
        """Start a flip (or turn a drain into one) when that is the pools' next step and flips are possible and
        cheaper; True if it did. A flip that is wanted but not done is a fallback: logged and counted once."""
        move = choose_flip(counts[Role.PREFILL], counts[Role.DECODE])
        if move is None or not self.config.lifecycle.role_flip:
            return False
        src, dst = move.src, move.dst
        why = "; ".join(self.flip_blockers) or prefer_flip([f["total_s"] for f in self.flips],
                                                             [c["cold_start_s"] for c in self.cold_starts])
        if move.convert:
            worker_id = next(w for w, into in self._drain_into.items()
                             if into is None and self.registry.get(w).role == src)
            self._drain_into[worker_id] = "stop" if why else dst
            if why:
                self._flip_outcome(src, dst, "fallback", f"{worker_id} drains and a new worker starts: {why}")
                return False
            log.info("the drain of %s becomes a flip to %s", worker_id, dst.value)
            self._actions[dst] = self._actions[src]
            return True
        if why:
            self._flip_outcome(src, dst, "fallback", f"drain + start instead: {why}")
            return False
        victim = self._pick_victim(src)
        task = asyncio.create_task(self.flip_worker(victim.worker_id, dst), name=f"flip-{victim.worker_id}")
        self._actions[src] = self._actions[dst] = task
        return True

    def _flip_grace_s(self) -> float:
        """How long a drain waits at least before stopping its worker: long enough for a second admin write to
        turn it into a flip, when flips are possible at all."""
        return DRAIN_FLIP_GRACE_S if self.config.lifecycle.role_flip and not self.flip_blockers else 0.0

    def _counts(self, role: Role) -> PoolCounts:
        action = self._actions.get(role)
        return PoolCounts(target=self.targets[role],
                          active=len(self.registry.records(role, (WorkerState.STARTING, WorkerState.READY))),
                          ready=len(self.registry.ready(role)),
                          draining=len(self.registry.records(role, (WorkerState.DRAINING,))),
                          acting=action is not None and not action.done(), convertible=self._convertible(role))

    def _convertible(self, role: Role) -> int:
        return sum(1 for w, into in self._drain_into.items() if into is None and self.registry.get(w).role == role)

    async def _drain_became_flip(self, rec, into: Role | str | None, idle: str, t0: float) -> bool:
        """A drain that was turned into a flip goes on as one (True), if its worker became idle; one that died or
        timed out first is a failed flip, and the drain ends as drains do (False)."""
        if not isinstance(into, Role):
            return False
        if idle != "idle":
            self._flip_outcome(rec.role, into, "failed", f"{rec.worker_id} was {idle} before its flip")
            return False
        await self._flip_drained(rec, into, t0)
        return True

    def _flip_outcome(self, src: Role, dst: Role, outcome: str, why: str = "") -> None:
        self.counters[{"ok": "flipped", "failed": "flip_failures", "fallback": "flip_fallbacks"}[outcome]] += 1
        if self.metrics is not None:
            self.metrics.role_flips.labels(src.value, dst.value, outcome).inc()
        if outcome != "ok":
            (log.warning if outcome == "fallback" else log.error)("flip %s -> %s: %s", src.value, dst.value, why)

    async def flip_worker(self, worker_id: str, to_role: Role) -> str | None:
        """Drain ``worker_id``, flip it into ``to_role`` under a new id and make it ready there; the new id,
        or None when it ended otherwise (stopped: the reconcile starts what is missing)."""
        rec = self.registry.mark_draining(worker_id, f"flipping to {to_role.value}")
        log.info("flipping %s to %s", worker_id, to_role.value)
        self._pull_first_soon(worker_id)
        try:
            return await self._flip_drained(rec, to_role, time.monotonic())
        finally:
            self.reconcile_soon()

    async def _flip_drained(self, rec, to_role: Role, t0: float) -> str | None:
        """The flip of a draining worker (``t0``: when its drain began), from waiting for it to be idle on."""
        worker_id, src, handle = rec.worker_id, rec.role, self.handles[rec.worker_id]
        deadline = t0 + self.config.lifecycle.drain_timeout_s
        new_id = None
        try:
            while True:
                idle = await self._wait_idle(rec, deadline)
                if idle != "idle":
                    return await self._flip_abandoned(worker_id, src, to_role, idle)
                t_idle = time.monotonic()
                self._cancel_feed(worker_id)  # the worker's events name its new id from the flip on
                new_id = new_id or self._new_worker_id(to_role)
                try:
                    info = await asyncio.wait_for(handle.flip_role.remote(*self._spawn.worker_args(to_role, new_id)),
                                                  self.config.lifecycle.start_timeout_s)
                    break
                except RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    if not isinstance(cause, FlipRefusedError):
                        raise
                    if isinstance(cause, WorkerBusyError) and time.monotonic() < deadline:
                        await asyncio.sleep(0.2)  # something arrived after the idle check: wait again
                        continue
                    return await self._flip_abandoned(worker_id, src, to_role, "refused", str(cause))
            await self._join(rec, to_role, new_id, info)
            now = time.monotonic()
            self.flips.append({"worker": worker_id, "as": new_id, "from": src.value, "to": to_role.value,
                               "drain_s": round(t_idle - t0, 3), "flip_s": round(now - t_idle, 3),
                               "total_s": round(now - t0, 3)})
            if self.metrics is not None:
                self.metrics.role_flip_time.labels(src.value, to_role.value).observe(now - t_idle)
            self._flip_outcome(src, to_role, "ok")
            log.info("worker %s is ready as %s (flip %.2f s after its drain of %.2f s)", worker_id, new_id,
                     now - t_idle, t_idle - t0)
            return new_id
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._flip_outcome(src, to_role, "failed", f"{worker_id} failed to flip: {type(e).__name__}: {e}")
            for wid in (worker_id, new_id):
                if wid is not None and wid in self.registry and self.registry.get(wid).state != WorkerState.DEAD:
                    self._end(wid, f"failed to flip: {type(e).__name__}: {e}", fault=True)  # killed
            return None

    async def _join(self, rec, to_role: Role, new_id: str, info) -> None:
        """The flipped worker leaves its old pool (as a drained worker does: the others forget a prefill agent) and
        joins the new one under ``new_id``: starting, the new role's handshake, ready, its event feed."""
        handle = self.handles[rec.worker_id]
        self._end(rec.worker_id, f"flipped to {to_role.value} as {new_id}", fault=False)
        self.registry.add(new_id, to_role, time.monotonic())
        self.handles[new_id] = handle
        rename = getattr(self._spawn, "rename", None)  # a tensor-parallel worker's ranks and group go with it
        if rename is not None:
            rename(rec.worker_id, new_id)
        client = RayWorkerClient(handle, info)
        async with self._handshake:
            await shake_hands(self.registry, client)
            async with self.backend.lora.joining(client):  # it kept its adapters; a load during the flip missed it
                self.backend.activate(client, pid=info.pid, node=info.node)
        if self._start_feed is not None:
            self.feeds[new_id] = self._start_feed(client)

    async def _flip_abandoned(self, worker_id: str, src: Role, dst: Role, why: str, detail: str = "") -> None:
        """The worker will not flip: it died, outlived the drain timeout, or refused (then it is drained and idle,
        and stopping it is exactly a drain's end: drain + start is the fallback)."""
        if why == "dead":
            return None
        if why == "timeout":
            self.counters["drain_timeouts"] += 1
            self._flip_outcome(src, dst, "failed", f"{worker_id} was not idle after "
                               f"{self.config.lifecycle.drain_timeout_s:.0f} s: stopping it with work left")
        else:
            self._flip_outcome(src, dst, "fallback", f"{worker_id} refused (stopped, a new worker starts): {detail}")
        await self._stop_worker(worker_id)
        self._end(worker_id, f"drained (flip to {dst.value} {why})", fault=False)
        return None

    def _record_cold_start(self, worker_id: str, role: Role, seconds: float) -> None:
        self.cold_starts.append({"worker": worker_id, "role": role.value, "cold_start_s": round(seconds, 3)})
        if self.metrics is not None:
            self.metrics.cold_start_time.labels(role.value).observe(seconds)

    def flips_view(self) -> dict[str, Any]:
        return {"enabled": self.config.lifecycle.role_flip, "blockers": list(self.flip_blockers),
                "flips": list(self.flips), "cold_starts": list(self.cold_starts),
                "flip_s": [f["flip_s"] for f in self.flips],
                "cold_start_s": [c["cold_start_s"] for c in self.cold_starts]}
