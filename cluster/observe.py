"""What the autoscaler observes of the live cluster each interval (cluster/autoscaler.py's ``Observation``),
read from the worker registry (loads from the KV event plane, ``stats()`` snapshots), the router's latency
samples and its dispatch counters. bench/sim/autoscale.py builds the same observation in the simulator.

Per ready worker: its load (queued prefill tokens: the larger of its own report and the router's count of
prompt tokens sent there and not yet prefilled — a worker reports its load between engine steps, and one
long prefill step on a loaded CPU kept a 4k-token queue out of sight for 12 s); what its engine did in the interval
(differences of its EngineStats counters: busy seconds, prompt tokens computed, decode steps and tokens — a worker's
first observation counts zero); the decode backlog it holds (prefill: handed-off prompts and their blocks under a lease;
decode: handoffs waiting for free blocks). Per interval: TTFT and ITL samples and TTFT's parts from warm workers only,
prefill queue times from warm prefill workers' histograms, the uncached prompt tokens routed to prefill, what
the placed requests asked of decode and what the finished ones generated (router/routing/demand.py), and
the router's count of requests committed to decode workers (a bound on the decode backlog, whose parts are
snapshots of different ages: prefill's ``stats()`` polled each second, decode's load as events arrive).
"""
from __future__ import annotations

import collections

from cluster.autoscaler import AutoscalerConfig, Observation, WorkerSample
from router.routing.policy import Role
from router.workers.registry import WorkerState

WORK_COUNTERS = {"busy_s": "busy_s", "prefill_tokens": "num_prefill_tokens_computed",  # WorkerSample <- stats()
                 "decode_steps": "num_decode_steps", "decode_tokens": "num_decode_tokens"}


class PoolObserver:
    def __init__(self, registry, backend, metrics, auto: AutoscalerConfig) -> None:
        self.registry, self.backend, self.metrics, self.auto = registry, backend, metrics, auto
        self._queue_time_seen: dict[str, dict] = {}
        self._work_seen: dict[str, dict] = {}
        self._routed_seen = 0
        self._demand_seen: dict[str, int] | None = None

    def observe(self, now_s: float) -> Observation:
        """The interval since the last call, as the autoscaler reads it (cluster/autoscaler.py)."""
        warmup = self.auto.warmup_s

        tracker = getattr(self.backend, "tracker", None)

        def routed_queue(worker_id: str) -> int:  # prompt tokens the router sent there whose prefill has not completed
            return tracker.get(worker_id).queued_prefill_tokens if tracker is not None else 0

        def samples(role: Role) -> tuple[WorkerSample, ...]:
            out = []
            for rec in self.registry.ready(role):
                load, stats = rec.load, rec.stats
                did = self._work_done(rec.worker_id, stats)
                out.append(WorkerSample(
                    rec.worker_id, warm=rec.age_s(now_s) >= warmup,
                    running=load.running if load else 0, waiting=load.waiting if load else 0,
                    queued_prefill_tokens=max(load.queued_prefill_tokens if load else 0, routed_queue(rec.worker_id)),
                    kv_blocks_used=load.kv_blocks_used if load else 0,
                    kv_blocks_total=load.kv_blocks_total if load else 0, **did,
                    held_requests=stats.get("num_held", 0), held_blocks=stats.get("leases_held_blocks", 0),
                    handoffs_waiting=stats.get("waiting_for_blocks", 0)))
            return tuple(out)

        ready: dict[str, float | None] = {}  # one registry lookup per worker, not per sample (one per token)

        def warm_at(worker: str, t_s: float) -> bool:
            if worker not in ready:
                ready[worker] = self.registry.get(worker).ready_s if worker in self.registry else None
            return ready[worker] is not None and t_s - ready[worker] >= warmup

        latencies = self.metrics.take_samples() if self.metrics is not None else []
        warm, ttft_tokens = collections.defaultdict(list), []
        for s in latencies:
            if warm_at(s.worker, s.t_s):
                warm[s.kind].append(s.value_s)
                if s.kind == "ttft":
                    ttft_tokens.append(s.prompt_tokens)
        routed = self.backend.prefill_tokens_routed
        arrived, self._routed_seen = routed - self._routed_seen, routed
        return Observation(now_s, samples(Role.PREFILL), samples(Role.DECODE), ttft_s=tuple(warm["ttft"]),
                           ttft_prompt_tokens=tuple(ttft_tokens),
                           prefill_queue_s=self._queue_time_samples(now_s), itl_s=tuple(warm["itl"]),
                           prefill_tokens_arrived=arrived, decode_requests_inflight=self._decode_inflight(),
                           ttft_parts={p: tuple(warm[f"ttft_{p}"]) for p in ("queue", "compute", "router")},
                           **self._demand())

    def _demand(self) -> dict[str, int]:
        """What the interval's requests asked of decode and what the finished ones generated (differences of the
        router's counters, router/routing/demand.py); nothing when the backend does not count them."""
        demand = getattr(self.backend, "demand", None)
        if demand is None:
            return {}
        now = demand.counters()
        before, self._demand_seen = self._demand_seen or dict.fromkeys(now, 0), now
        return {k: v - before[k] for k, v in now.items()}

    def _decode_inflight(self) -> int | None:
        """Requests the router placed on decode workers (ready or draining) and not done: from arrival — the
        decode worker is chosen then — to the end; None when the backend does not count them."""
        inflight = getattr(self.backend, "inflight", None)
        if inflight is None:
            return None
        return sum(inflight.get(r.worker_id, 0) for r in self.registry.records(Role.DECODE, (WorkerState.READY,
                                                                                       WorkerState.DRAINING)))

    def _work_done(self, worker_id: str, stats: dict) -> dict:
        """What the worker's engine did since the last observation (differences of its EngineStats counters)."""
        now = {k: stats.get(f, 0) for k, f in WORK_COUNTERS.items()}
        before = self._work_seen.get(worker_id)
        self._work_seen[worker_id] = now
        if before is None:
            return {k: 0 for k in now}
        return {k: max(0, v - before[k]) for k, v in now.items()}

    def _queue_time_samples(self, now_s: float) -> tuple[float, ...]:
        """Prefill queue times of the interval, from the growth of warm prefill workers' queue-time histograms
        (each request counted at its bucket's upper bound: a conservative estimate)."""
        out: list[float] = []
        for rec in self.registry.ready(Role.PREFILL):
            snap = rec.stats.get("queue_time_s")
            if not snap:
                continue
            before = self._queue_time_seen.get(rec.worker_id)
            self._queue_time_seen[rec.worker_id] = snap
            if before is None or rec.age_s(now_s) < self.auto.warmup_s:
                continue
            bounds = [*snap["buckets"], snap["buckets"][-1]]
            for bound, now_n, was_n in zip(bounds, snap["counts"], before["counts"]):
                out.extend([bound] * max(0, now_n - was_n))
        return tuple(out)
