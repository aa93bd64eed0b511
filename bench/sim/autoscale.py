"""The autoscaler in the simulator: the real ``cluster.autoscaler.decide`` on observations built from the
simulated cluster the way cluster/pools.py builds them from the live one, and its act half (reconcile:
start one worker or drain one, per role, one action at a time) applied to the simulated pools.

Observation, every ``interval_s`` from the first arrival:
- ``WorkerSample`` per ready worker from its engine's load (running, waiting, queued prefill tokens, KV
  blocks used / total); ``warm`` = ready for at least ``warmup_s``. The initial workers count as warm
  (a cluster that was up before the benchmark).
- TTFT samples (attributed to the worker that produced the first token) and ITL samples (to the decode
  worker) of the interval, from workers that were warm when the sample was taken.
- prefill queue times of the interval from warm prefill workers, each rounded up to its histogram
  bucket's upper bound (``LATENCY_BUCKETS_S``), skipping a worker's first observation — as
  ``PoolManager._queue_time_samples`` reads them from the workers' histogram snapshots.

Acting: a worker asked for becomes ready ``Hardware.startup_s`` later; a drained worker takes no new
requests and leaves once it holds none (the least busy, among equals the youngest, as PoolManager picks).
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import TYPE_CHECKING

from cluster.autoscaler import AutoscalerConfig, Observation, PoolState, WorkerSample, decide, history_kept
from engine.histogram import LATENCY_BUCKETS_S
from router.routing.policy import Role

if TYPE_CHECKING:
    from bench.sim.cluster import ClusterSim, SimWorker


class Autoscaling:
    def __init__(self, sim: ClusterSim, config: AutoscalerConfig) -> None:
        self.sim, self.cfg = sim, config
        self.targets = {Role.PREFILL: sim.dep.prefill, Role.DECODE: sim.dep.decode}
        self.history: deque[Observation] = deque(maxlen=history_kept(config))
        # (kind, t_s, worker, value, prompt tokens: a TTFT's target) since the last tick
        self._samples: list[tuple[str, float, str, float, int]] = []
        self._queue_seen: dict[str, int] = {}
        self._work_seen: dict[str, dict] = {}  # per worker: its work counters at the last observation
        self._arrived_seen = 0
        self._demand_seen = dict.fromkeys(sim.demand.counters(), 0)
        self.decisions: list[dict] = []
        self.timeline: list[dict] = []  # per tick: ready/starting/draining per role, targets
        self.t0_s = 0.0

    def start(self, t0_s: float) -> None:
        self.t0_s = t0_s
        self.sim.at(t0_s + self.cfg.interval_s, self._tick)

    def sample(self, kind: str, t_s: float, worker: str, value_s: float, prompt_tokens: int = 0) -> None:
        self._samples.append((kind, t_s, worker, value_s, prompt_tokens))

    # ---- observe + decide ------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        self.history.append(self.observe(now))
        for role, d in decide(self.history, {r: self.pool_state(r) for r in Role}, self.cfg).items():
            if d.direction != "hold" and d.target != self.targets[role]:
                self.targets[role] = d.target
                self.decisions.append({"t_s": now - self.t0_s, "role": role.value, "direction": d.direction,
                                       "target": d.target, "code": d.code, "reason": d.reason})
        if sum(self.targets.values()) > self.cfg.budget:  # the policy's contract; a run past it measures nothing
            raise AssertionError(f"the autoscaler's targets {self.targets} exceed its budget of {self.cfg.budget} "
                                 f"at t = {now - self.t0_s:g} s")
        self.reconcile(now)
        self.timeline.append({"t_s": now - self.t0_s, **{f"{r.value}_{k}": v for r in Role
                                                         for k, v in self._counts(r).items()}})
        self.sim.at(now + self.cfg.interval_s, self._tick)

    def observe(self, now: float) -> Observation:
        warmup = self.cfg.warmup_s
        workers = self.sim.workers

        def samples(role: Role) -> tuple[WorkerSample, ...]:
            out = []
            for w in workers.values():
                if w.role == role and w.state == "ready":
                    load = w.engine.load(role.value)
                    work, before = dict(w.engine.work), self._work_seen.get(w.name)
                    self._work_seen[w.name] = work
                    did = {k: v - before[k] for k, v in work.items()} if before is not None else {k: 0 for k in work}
                    out.append(WorkerSample(
                        w.name, now - w.ready_s >= warmup, load.running, load.waiting, load.queued_prefill_tokens,
                        load.kv_blocks_used, load.kv_blocks_total, busy_s=did["busy_s"],
                        prefill_tokens=did["prefill_tokens"], decode_steps=did["decode_steps"],
                        decode_tokens=did["decode_tokens"], held_requests=len(w.engine.held),
                        held_blocks=w.engine.held_blocks(), handoffs_waiting=len(w.waiting_handoffs)))
            return tuple(out)

        taken, self._samples = self._samples, []
        warm = [(k, v, n) for k, t, name, v, n in taken if t - workers[name].ready_s >= warmup]
        arrived, self._arrived_seen = self.sim.prefill_tokens_arrived - self._arrived_seen, self.sim.prefill_tokens_arrived
        now_demand = self.sim.demand.counters()
        demand, self._demand_seen = {k: v - self._demand_seen[k] for k, v in now_demand.items()}, now_demand
        return Observation(now, samples(Role.PREFILL), samples(Role.DECODE),
                           ttft_s=tuple(v for k, v, _ in warm if k == "ttft"),
                           ttft_prompt_tokens=tuple(n for k, _, n in warm if k == "ttft"),
                           prefill_queue_s=self._queue_times(now), itl_s=tuple(v for k, v, _ in warm if k == "itl"),
                           prefill_tokens_arrived=arrived, **demand)

    def _queue_times(self, now: float) -> tuple[float, ...]:
        bounds = LATENCY_BUCKETS_S
        out: list[float] = []
        for w in self.sim.workers.values():
            if w.role != Role.PREFILL or w.state != "ready":
                continue
            times = w.engine.queue_times
            seen = self._queue_seen.get(w.name)
            self._queue_seen[w.name] = len(times)
            if seen is None or now - w.ready_s < self.cfg.warmup_s:
                continue
            for _, q in times[seen:]:
                out.append(bounds[min(bisect.bisect_left(bounds, q), len(bounds) - 1)])
        return tuple(out)

    def _counts(self, role: Role) -> dict[str, int]:
        states = [w.state for w in self.sim.workers.values() if w.role == role]
        return {"ready": states.count("ready"), "starting": states.count("starting"),
                "draining": states.count("draining"), "target": self.targets[role]}

    def pool_state(self, role: Role) -> PoolState:
        c = self._counts(role)
        return PoolState(target=self.targets[role], ready=c["ready"], starting=c["starting"], draining=c["draining"])

    # ---- act ----------------------------------------------------------------------------------------
    def reconcile(self, now: float) -> None:
        for role in Role if self.sim.hw.flip_s is not None else ():  # flips first: a rebalance's surplus
            other = Role.DECODE if role == Role.PREFILL else Role.PREFILL  # workers change role, together
            while True:  # counted afresh each time: a drain that ends at once reconciles (recursively) too
                c, o = self._counts(role), self._counts(other)
                coming = sum(1 for w in self.sim.workers.values() if w.flip_to == role)  # draining to become one
                if min(self.targets[role] - c["ready"] - c["starting"] - coming, o["ready"] - self.targets[other]) <= 0:
                    break
                self._drain(now, other, flip_to=role)
        for role in Role:
            c = self._counts(role)
            if c["starting"] or c["draining"] or any(w.flip_to == role for w in self.sim.workers.values()):
                continue  # one start or drain per role at a time; a worker flipping into the role is starting
            if c["ready"] < self.targets[role]:
                w = self.sim.add_worker(role, now, state="starting")
                self.sim.at(now + self.sim.hw.startup_s, self._started, w)
            elif c["ready"] > self.targets[role]:
                self._drain(now, role)

    def _drain(self, now: float, role: Role, flip_to: Role | None = None) -> None:
        """As PoolManager: the least busy ready worker, among equals the youngest."""
        ready = [w for w in self.sim.workers.values() if w.role == role and w.state == "ready"]
        victim = min(ready, key=lambda w: (self.sim.inflight[w.name], -w.ready_s))
        victim.state, victim.flip_to = "draining", flip_to
        self.sim._check_drained(now, victim)

    def _started(self, now: float, w: SimWorker) -> None:
        self.sim.activate(w, now)
        self.reconcile(now)

    # ---- report -----------------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Time-averaged pool sizes (provisioned = ready + starting + draining: what the hardware costs)."""
        ticks = self.timeline or [{"t_s": 0.0, **{f"{r.value}_{k}": v for r in Role  # no tick yet: as started
                                                  for k, v in self._counts(r).items()}}]
        mean = lambda key: sum(t[key] for t in ticks) / len(ticks)  # noqa: E731  (ticks are evenly spaced)
        prov = lambda r: sum(t[f"{r}_ready"] + t[f"{r}_starting"] + t[f"{r}_draining"] for t in ticks) / len(ticks)  # noqa: E731
        return {"mean_prefill_ready": mean("prefill_ready"), "mean_decode_ready": mean("decode_ready"),
                "mean_workers_provisioned": prov("prefill") + prov("decode"),
                "final": {r.value: self.targets[r] for r in Role}, "decisions": self.decisions,
                "timeline": self.timeline}
