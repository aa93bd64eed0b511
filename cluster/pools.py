"""PoolManager: the act half of operating the cluster — workers started, drained and replaced on Ray so that
each pool matches its target; the autoscaler (cluster/autoscaler.py, pure) and the admin API set targets.

Loops (tasks on the router's event loop):
- health (cluster/health.py), every ``lifecycle.health_interval_s``: probe every live worker; one that fails
  ``lifecycle.health_misses`` probes in a row is dead (one slow answer on a loaded machine is not a death): it
  leaves the registry's live set, the index and the load tracker (its requests behave as
  router/dispatch/cluster_backend.py documents), and the reconcile below replaces it.
- stats, every ``lifecycle.stats_interval_s``: each worker's ``stats()`` into the registry (metrics, admin
  API, drain checks, the autoscaler's queue-time signal). Load reports reach the registry as they arrive
  on the KV event plane.
- autoscaler, every ``autoscaler.interval_s`` when enabled: observe (warm/cold workers, loads, the
  router's latency samples of the interval), ``decide``, record every decision, apply new targets.
- reconcile (after each of the above and after every target change): at most one action per role at a
  time. Below target: start a worker (``starting`` until it loaded its model, registered its NIXL agent, shook
  hands with the other role and holds the LoRA adapters served now; then ``ready`` and routed to). Above target:
  drain the least-loaded ready worker (``draining``: no new requests; it finishes its requests and its KV leases,
  then stops).
  No request fails because of a scale-down; a drain that outlives ``lifecycle.drain_timeout_s`` is stopped
  anyway and logged.
  One pool over its target while the other is under (a rebalance): flip a worker across in place instead,
  without reloading its model (cluster/flip.py; ``lifecycle.role_flip``, a counted fallback when it cannot).
Handshakes run under one lock, so a prefill and a decode worker starting together still meet.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from cluster.autoscaler import AutoscalerConfig, Decision, Observation, PoolState, decide, history_kept
from cluster.config import ClusterConfig
from cluster.flip import RoleFlips
from cluster.handshake import forget_peer, peer_of, pull_first, shake_hands
from cluster.health import HealthChecks
from cluster.observe import PoolObserver
from cluster.ray_client import RayWorkerClient
from cluster.spawn import Spawner
from cluster.start_wait import await_info
from engine.errors import InvalidRequestError
from router.dispatch.cluster_backend import ClusterBackend
from router.http.admin import Operator
from router.metrics.collector import RouterMetrics
from router.routing.policy import Role
from router.workers.registry import WorkerRecord, WorkerState

log = logging.getLogger(__name__)

DECISIONS_KEPT = 50


class PoolManager(RoleFlips, HealthChecks, Operator):
    def __init__(self, config: ClusterConfig, backend: ClusterBackend, spawn: Spawner, *,
                 handles: dict[str, Any], start_feed: Callable[[RayWorkerClient], asyncio.Task] | None = None,
                 metrics: RouterMetrics | None = None) -> None:
        self.config = config
        self.backend = backend
        self.registry = backend.registry
        self.auto: AutoscalerConfig = config.autoscaler
        self.metrics = metrics
        self._spawn = spawn  # (role, worker_id) -> Ray actor handle; .worker_args(role, worker_id) for flips
        self._start_feed = start_feed
        self.handles = dict(handles)  # worker_id -> actor handle (every worker this manager knows)
        self.feeds: dict[str, asyncio.Task] = {}
        self.initial = {Role.PREFILL: config.prefill.num_workers, Role.DECODE: config.decode.num_workers}
        self.targets = dict(self.initial)
        self.pinned = {Role.PREFILL: False, Role.DECODE: False}
        # (wall-clock time, decision): changes only / the latest per role, holds included
        self.decisions: collections.deque[tuple[float, Decision]] = collections.deque(maxlen=DECISIONS_KEPT)
        self.last_decision: dict[Role, tuple[float, Decision]] = {}
        self.history: collections.deque[Observation] = collections.deque(maxlen=history_kept(self.auto))
        self.counters = collections.Counter()  # started, start_failures, drained, drain_timeouts, replaced, flip*,
        # drain_pull_first (decode workers told to admit a draining prefill worker's handoffs first)
        self._actions: dict[Role, asyncio.Task] = {}
        self._handshake = asyncio.Lock()
        self._forgets: set[asyncio.Task] = set()  # workers told of a prefill worker that drains or is gone
        self.stopped = False
        self._probe_misses: collections.Counter[str] = collections.Counter()  # consecutive failed probes
        self._loops: list[asyncio.Task] = []
        self._next_index = {role: n for role, n in self.initial.items()}
        self.observer = PoolObserver(self.registry, backend, metrics, self.auto)
        self.timeline_series = None  # cluster.dashboard.Timeline once started (needs metrics)
        self._init_flips()

    # ---- lifecycle of the manager ----------------------------------------------------------------
    def start(self) -> None:
        lc = self.config.lifecycle
        self._loops = [asyncio.create_task(self._every(lc.health_interval_s, self.check_health), name="pools-health"),
                       asyncio.create_task(self._every(lc.stats_interval_s, self.poll_stats), name="pools-stats")]
        if self.auto.enabled:
            self._loops.append(asyncio.create_task(self._every(self.auto.interval_s, self.autoscale),
                                                   name="pools-autoscaler"))
        if self.metrics is not None:
            from cluster.dashboard import Timeline

            self.timeline_series = Timeline(self, self.metrics)
            self._loops.append(asyncio.create_task(self.timeline_series.run(), name="dashboard-timeline"))

    async def stop(self) -> None:
        self.stopped = True  # no start, drain or flip after this: a cancelled start's reconcile would begin another
        tasks = (*self._loops, *self._actions.values(), *self.feeds.values(), *self._forgets)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rec in self.registry.records(states=(WorkerState.STARTING,)):  # a start cancelled before it ran
            self._end(rec.worker_id, "cancelled while starting", fault=False, kill=True)

    async def _every(self, interval_s: float, step) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad round must not end the loop
                log.exception("%s failed", getattr(step, "__name__", step))

    # ---- targets ---------------------------------------------------------------------------------
    def bounds(self, role: Role) -> tuple[int, int]:
        lo, hi = self.auto.bounds(role)
        if self.auto.enabled:
            return lo, hi
        return min(lo, self.initial[role]), max(hi, self.initial[role])  # never narrower than the start size

    def set_target(self, role: Role, target: int | None = None, pin: bool | None = None) -> dict[str, Any]:
        """The admin API's write: a new target inside the bounds, and/or pin (the autoscaler leaves it)."""
        role = Role(role)
        if target is not None:
            lo, hi = self.bounds(role)
            if isinstance(target, bool) or not isinstance(target, int) or not lo <= target <= hi:
                raise InvalidRequestError(f"{role.value} target must be an integer in [{lo}, {hi}], got {target!r}")
            other = self.targets[Role.DECODE if role == Role.PREFILL else Role.PREFILL]
            if self.auto.enabled and target + other > self.auto.budget:
                raise InvalidRequestError(f"{role.value} target {target} + {other} exceeds the budget of "
                                          f"{self.auto.budget} workers")
            self.targets[role] = target
        if pin is not None:
            self.pinned[role] = bool(pin)
        log.info("admin: %s target %d%s", role.value, self.targets[role], " (pinned)" if self.pinned[role] else "")
        self.reconcile()
        return self.pool_view(role)

    # ---- reconcile ---------------------------------------------------------------------------------
    def reconcile(self) -> None:
        if self.stopped:
            return
        counts = {role: self._counts(role) for role in (Role.PREFILL, Role.DECODE)}
        if self._try_flip(counts):  # one flip is both pools' next step (cluster/flip.py)
            return
        for role, c in counts.items():
            if c.acting:
                continue
            if c.active < c.target:
                worker_id = self._new_worker_id(role)
                self.registry.add(worker_id, role, time.monotonic())  # visible as "starting" at once
                self._actions[role] = asyncio.create_task(self.add_worker(role, worker_id), name=f"start-{worker_id}")
            elif c.ready > c.target and not c.draining:
                victim = self._pick_victim(role)
                self._actions[role] = asyncio.create_task(self.drain_worker(victim.worker_id, "scale-down"),
                                                          name=f"drain-{victim.worker_id}")

    def _pick_victim(self, role: Role) -> WorkerRecord:
        """The ready worker to give up: the least busy; among equals the youngest (older ones have warmer caches)."""
        return min(self.registry.ready(role), key=lambda r: (self.backend.inflight[r.worker_id], -(r.ready_s or 0)))

    def _new_worker_id(self, role: Role) -> str:
        worker_id = f"{role.value}-{self._next_index[role]}"
        self._next_index[role] += 1
        return worker_id

    async def add_worker(self, role: Role, worker_id: str) -> str | None:
        """Start ``worker_id`` (already in the registry as ``starting``) and make it ready."""
        t0 = time.monotonic()
        try:
            handle = self._spawn(role, worker_id)
            self.handles[worker_id] = handle
            asks = getattr(self._spawn, "asks", None)
            info = await await_info(worker_id, handle, self.config.lifecycle.start_timeout_s,
                                    asks(role) if asks is not None else None,
                                    lambda: self.counters.update(["start_waits_for_room"]))
            client = RayWorkerClient(handle, info)
            async with self._handshake:
                await shake_hands(self.registry, client)
                async with self.backend.lora.joining(client):  # the LoRA adapters served now, before it is routed to
                    self.backend.activate(client, pid=info.pid, node=info.node)
            if self._start_feed is not None:
                self.feeds[worker_id] = self._start_feed(client)
            self.counters["started"] += 1
            self._record_cold_start(worker_id, role, time.monotonic() - t0)
            log.info("worker %s is ready (cold start %.2f s)", worker_id, time.monotonic() - t0)
            return worker_id
        except asyncio.CancelledError:  # the cluster stops: the half-started worker is not left running
            self._end(worker_id, "cancelled while starting", fault=False, kill=True)
            raise
        except Exception as e:
            self.counters["start_failures"] += 1
            log.error("worker %s failed to start: %r", worker_id, e)
            self._end(worker_id, f"failed to start: {type(e).__name__}: {e}", fault=True)
            return None
        finally:
            self.reconcile_soon()

    async def drain_worker(self, worker_id: str, reason: str) -> None:
        """Stop routing to the worker, wait until it holds no request and no KV lease, then stop it — or flip it,
        if the other pool fell short meanwhile (cluster/flip.py)."""
        rec = self.registry.mark_draining(worker_id, reason)
        log.info("draining %s (%s)", worker_id, reason)
        t0 = time.monotonic()
        self._pull_first_soon(worker_id)
        self._drain_into[worker_id] = None
        try:
            idle = await self._wait_idle(rec, t0 + self.config.lifecycle.drain_timeout_s, t0 + self._flip_grace_s())
            if await self._drain_became_flip(rec, self._drain_into.pop(worker_id, None), idle, t0):
                return
            if idle == "dead":  # died while draining: the health loop took care of it
                return
            if idle == "timeout":
                self.counters["drain_timeouts"] += 1
                log.error("drain of %s timed out after %.0f s: stopping it with work left", worker_id,
                          self.config.lifecycle.drain_timeout_s)
            await self._stop_worker(worker_id)
            self.counters["drained"] += 1
            self._end(worker_id, f"drained ({reason})", fault=False)
        finally:
            self._drain_into.pop(worker_id, None)
            self.reconcile_soon()

    async def _wait_idle(self, rec: WorkerRecord, deadline_s: float, not_before_s: float = 0.0) -> str:
        """Wait until a draining worker is idle (and ``not_before_s`` passed): "idle", "dead" (the health loop
        took care of it) or "timeout"."""
        while not await self._is_idle(rec) or time.monotonic() < not_before_s:
            if rec.state == WorkerState.DEAD:
                return "dead"
            if time.monotonic() > deadline_s:
                return "timeout"
            await asyncio.sleep(0.2)
        return "dead" if rec.state == WorkerState.DEAD else "idle"

    async def _is_idle(self, rec: WorkerRecord) -> bool:
        if self.backend.inflight[rec.worker_id]:
            return False
        try:
            stats = await asyncio.wait_for(rec.client.stats(), 10)
        except Exception:
            return rec.state == WorkerState.DEAD
        busy = ("num_requests", "num_held", "leases_held", "remote_pending", "waiting_for_blocks")
        return not any(stats.get(key) for key in busy)

    async def _stop_worker(self, worker_id: str) -> None:
        handle = self.handles.get(worker_id)
        self._cancel_feed(worker_id)
        if handle is None:
            return
        try:
            await asyncio.wait_for(handle.shutdown.remote(), 10)
        except Exception as e:
            log.debug("worker %s did not shut down cleanly: %r", worker_id, e)
        ray.kill(handle)
        self._release(worker_id)

    def _release(self, worker_id: str) -> None:
        release = getattr(self._spawn, "release", None)  # a tensor-parallel worker's other ranks and its group
        if release is not None:
            try:
                release(worker_id)
            except Exception as e:
                log.warning("releasing %s's ranks: %r", worker_id, e)

    def _cancel_feed(self, worker_id: str) -> None:
        feed = self.feeds.pop(worker_id, None)
        if feed is not None:
            feed.cancel()

    def _end(self, worker_id: str, reason: str, *, fault: bool, kill: bool | None = None) -> None:
        """The worker leaves the pools: its feed stops, the others forget its NIXL agent, dispatch retires it;
        its actor (and a tensor-parallel worker's ranks) is killed if ``kill`` (default: if it is a fault)."""
        self._cancel_feed(worker_id)
        rec = self.registry.get(worker_id) if worker_id in self.registry else None
        peer = peer_of(rec) if rec is not None else None
        if rec is not None and rec.role == Role.PREFILL and peer is not None:
            self._in_background(self._forget(worker_id, peer.agent_name))
        if worker_id in self.registry and self.registry.get(worker_id).state != WorkerState.DEAD:
            self.backend.retire(worker_id, reason, fault=fault)
        handle = self.handles.pop(worker_id, None)
        if (fault if kill is None else kill) and handle is not None:
            try:
                ray.kill(handle)
            except Exception as e:
                log.debug("kill %s: %r", worker_id, e)
            self._release(worker_id)

    def _pull_first_soon(self, worker_id: str) -> None:
        """A draining prefill worker's handoffs go first on every decode worker (cluster/handshake.py)."""
        async def tell() -> None:
            self.counters["drain_pull_first"] += await pull_first(self.registry, worker_id)

        self._in_background(tell())

    def _in_background(self, coro) -> None:
        """Run ``coro`` on the event loop, kept (and cancelled at close) with the others."""
        task = asyncio.get_running_loop().create_task(coro)
        self._forgets.add(task)
        task.add_done_callback(self._forgets.discard)

    async def _forget(self, worker_id: str, agent_name: str) -> None:
        self.counters["peers_forgotten"] += await forget_peer(self.registry, worker_id, agent_name)

    def reconcile_soon(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a task closed with its loop gone (a process exiting): nothing is left to reconcile
            return
        loop.call_soon(self.reconcile)

    # ---- loops -----------------------------------------------------------------------------------
    async def poll_stats(self) -> None:
        live = self.registry.records(states=(WorkerState.READY, WorkerState.DRAINING))
        results = await asyncio.gather(*(asyncio.wait_for(r.client.stats(), 10) for r in live), return_exceptions=True)
        now = time.monotonic()
        for rec, stats in zip(live, results):
            if isinstance(stats, dict):
                self.registry.update_stats(rec.worker_id, stats, now)

    async def autoscale(self) -> None:
        now = time.monotonic()
        self.history.append(self.observe(now))
        pools = {role: self.pool_state(role) for role in (Role.PREFILL, Role.DECODE)}
        wall_s = time.time()
        for role, d in decide(self.history, pools, self.auto).items():
            self.last_decision[role] = (wall_s, d)
            if d.direction == "hold" or d.target == self.targets[role]:
                continue
            log.info("autoscaler: %s %s -> %d (%s)", role.value, d.direction, d.target, d.reason)
            self.targets[role] = d.target
            self.decisions.append((wall_s, d))
            if self.metrics is not None:
                self.metrics.autoscaler.labels(role.value, d.direction, d.code).inc()
        self.reconcile()

    def observe(self, now_s: float) -> Observation:
        return self.observer.observe(now_s)

    # ---- views (admin API, dashboard) ------------------------------------------------------------
    def pool_state(self, role: Role) -> PoolState:
        counts = self.registry.counts()
        return PoolState(target=self.targets[role], ready=counts[(role, WorkerState.READY)],
                         starting=counts[(role, WorkerState.STARTING)], draining=counts[(role, WorkerState.DRAINING)],
                         pinned=self.pinned[role])

    def pool_view(self, role: Role) -> dict[str, Any]:
        lo, hi = self.bounds(role)
        state = self.pool_state(role)
        return {"role": role.value, "target": state.target, "min": lo, "max": hi, "pinned": state.pinned,
                "ready": state.ready, "starting": state.starting, "draining": state.draining}

    def timeline(self, since_s: float) -> list[dict[str, Any]]:
        return self.timeline_series.since(since_s) if self.timeline_series is not None else []

    def autoscaler_view(self) -> dict[str, Any]:
        a = self.auto
        return {
            "enabled": a.enabled, "interval_s": a.interval_s, "budget": a.budget, "role_flip": self.flips_view(),
            "slo": {"ttft_s": a.ttft_slo_s, "ttft_per_token_s": a.ttft_slo_per_token_s, "itl_s": a.itl_slo_s},
            "pools": {role.value: self.pool_view(role) for role in (Role.PREFILL, Role.DECODE)},
            "last": {role.value: _decision_view(at, d) for role, (at, d) in self.last_decision.items()},
            "decisions": [_decision_view(at, d) for at, d in reversed(self.decisions)],
            "counters": dict(self.counters),
        }


def _decision_view(at_s: float, d: Decision) -> dict[str, Any]:
    return {"at": round(at_s, 3), "role": d.role.value, "direction": d.direction, "target": d.target,
            "reason": d.reason, "code": d.code, "signals": dict(d.signals)}
