"""A discrete-event simulation of a duet cluster: the real router pieces and block pools, simulated time.

    result = ClusterSim(deployment, hardware, workload, autoscaler=None).run()

What is real (duet's own code, called as the serving path calls it): ``router.routing.policy.route`` with the
``PrefixIndex`` fed by every worker's ``BlockPool`` events and the ``LoadTracker`` fed by dispatches,
finishes and the workers' load reports; per worker the engine's ``Scheduler`` + ``BlockPool``
(bench/sim/engine.py: continuous batching, chunked prefill under ``max_num_batched_tokens``, prefix hits,
preemption); ``cluster.autoscaler.decide`` on observations built as cluster/pools.py builds them.

What is modelled: the forward pass (``Hardware.step_model``), the KV handoff (``Hardware.transfer``: one
transfer thread per decode worker, pulls run one after another), a one-way router↔worker message delay
(``net_s``), a new worker's start-up (``startup_s``). Events and load reports reach the router at once.
With ``Hardware.tiers`` every worker also has lower KV tiers (the real ``TierManager``, copies timed by
bench/sim/tiers.py's ``SimMover``; an idle engine is woken when a copy lands) and, with ``tiers.peers``,
fetches the longer prefix a peer holds before computing a prompt.

The request path is router/dispatch/cluster_backend.py's: route D; if D would compute at most
``local_prefill_max_tokens`` of the prompt (or there is no prefill worker: colocated), D runs it all; else route P, P
prefills and samples the first token (TTFT), its blocks stay pinned under a lease; D reserves blocks (or waits for
them), pulls what it lacks, P's blocks are released, D decodes. A lease that expires before the pull
started makes D recompute the prompt (counted). Workers run their engine loop as AsyncEngine does:
inbox, tick (decode: retry handoffs waiting for blocks), one step, repeat while there is work.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import asdict, dataclass

from bench.sim.autoscale import Autoscaling
from bench.sim.engine import Sampled, SimEngine
from bench.sim.handoff import HandoffMixin
from bench.sim.records import Flight, SimResult, SimWorker
from bench.sim.step_model import StepModel, TransferModel
from bench.sim.tiers import TierFeed, TierSpec, best_peer, tier_counters
from cluster.autoscaler import AutoscalerConfig
from engine.kv.hashing import BlockHasher
from router.routing.demand import DecodeDemand
from router.routing.index import PrefixIndex
from router.routing.load import LoadTracker
from router.routing.policy import DEFAULT_ALPHA, NO_PEER_FETCH, Role, TierWeights, make_policy, route

__all__ = ["ClusterSim", "Deployment", "Flight", "Hardware", "SimResult", "SimWorker"]

HORIZON_S = 1e5  # a run that has not finished this long after its last arrival has stalled: stop it


@dataclass(frozen=True)
class Deployment:
    """What runs: pool sizes and routing (the benchmark JSON's ``config``)."""

    name: str
    prefill: int
    decode: int
    prefill_policy: str = "cache_aware"
    decode_policy: str = "cache_aware"
    local_prefill_max_tokens: int = 0  # `make run`'s setting: every prompt with an uncached part is disaggregated
    alpha: float = DEFAULT_ALPHA
    tier_weights: TierWeights = NO_PEER_FETCH  # the simulated workers have one tier and never fetch from a peer

    @property
    def kind(self) -> str:
        return "duet-colocated" if self.prefill == 0 else "duet-disagg"

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "prefill": self.prefill, "decode": self.decode,
                "prefill_policy": self.prefill_policy, "decode_policy": self.decode_policy,
                "local_prefill_max_tokens": self.local_prefill_max_tokens, "alpha": self.alpha,
                "tier_weights": asdict(self.tier_weights), "simulated": True}


@dataclass(frozen=True)
class Hardware:
    """How one worker runs (every worker alike) and what moving KV and starting a worker cost."""

    name: str
    step_model: StepModel
    transfer: TransferModel
    block_size: int
    num_blocks: int  # KV blocks per worker
    max_num_seqs: int
    max_num_batched_tokens: int
    net_s: float = 0.0005  # one-way router <-> worker message
    startup_s: float = 20.0  # a worker the autoscaler adds is ready this long after it was asked for
    flip_s: float | None = 5.0  # a drained worker changes role in this long (None: no flips, drain + start)
    lease_timeout_s: float = 60.0
    tiers: TierSpec | None = None  # lower KV tiers per worker (block bytes: ``transfer.bytes_per_block``)

    def describe(self) -> dict:
        return {"name": self.name, "step_model": self.step_model.describe(), "transfer": self.transfer.describe(),
                "block_size": self.block_size, "num_blocks": self.num_blocks, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens, "net_s": self.net_s,
                "startup_s": self.startup_s, "flip_s": self.flip_s, "lease_timeout_s": self.lease_timeout_s,
                "tiers": self.tiers.describe() if self.tiers is not None else None}


class ClusterSim(HandoffMixin):
    def __init__(self, deployment: Deployment, hardware: Hardware, workload, autoscaler: AutoscalerConfig | None = None):
        self.dep, self.hw = deployment, hardware
        self.index, self.tracker = PrefixIndex(), LoadTracker()
        self.feed = TierFeed()  # per-tier events -> the index (bench/sim/tiers.py)
        self.policies = {role: make_policy(name, hardware.block_size, alpha=deployment.alpha,
                                           tier_weights=deployment.tier_weights)
                         for role, name in ((Role.PREFILL, deployment.prefill_policy),
                                            (Role.DECODE, deployment.decode_policy))}
        self.workers: dict[str, SimWorker] = {}  # registry order = the routing tie-break order
        self.engines: list[SimEngine] = []
        self.inflight: dict[str, int] = {}
        self.next_index = {Role.PREFILL: 0, Role.DECODE: 0}
        self._events: list = []
        self._seq = itertools.count()
        self.itl_s: list[float] = []
        self.prefill_tokens_arrived = 0  # uncached prompt tokens of requests that needed a prefill (the autoscaler's)
        self.demand = DecodeDemand(hardware.block_size)  # what requests ask of decode (the autoscaler's forecast)
        self.counters = {"disaggregated": 0, "local_prefill": 0, "lease_expired": 0, "handoff_waits": 0,
                         "transferred_blocks": 0, "decode_hit_blocks": 0, "preemptions": 0}
        hasher = BlockHasher(hardware.block_size)  # the router's: the engine's exact hash chain
        self.flights = [Flight(i, r.arrival_s or 0.0, r.prompt, r.output_len, hasher(r.prompt))
                        for i, r in enumerate(workload)]
        self.by_rid = {f.rid: f for f in self.flights}
        for role, n in ((Role.PREFILL, deployment.prefill), (Role.DECODE, deployment.decode)):
            for _ in range(n):
                self.add_worker(role, float("-inf"))
        self.autoscaling = Autoscaling(self, autoscaler) if autoscaler is not None else None
        self._open = len(self.flights)

    # ---- the event loop -----------------------------------------------------------------------------
    def at(self, t_s: float, fn, *args) -> None:
        heapq.heappush(self._events, (t_s, next(self._seq), fn, args))

    def run(self) -> SimResult:
        for f in self.flights:
            self.at(f.arrival_s, self._arrive, f)
        if self.autoscaling is not None:
            self.autoscaling.start(min((f.arrival_s for f in self.flights), default=0.0))
        horizon = max((f.arrival_s for f in self.flights), default=0.0) + HORIZON_S
        while self._events and self._open:
            t, _, fn, args = heapq.heappop(self._events)
            if t > horizon:
                break
            fn(t, *args)
        for f in self.flights:
            if f.done_s is None and f.error is None:
                f.error = "not finished (the simulated cluster stalled)"
        self.counters["preemptions"] = sum(e.scheduler.num_preemptions for e in self.engines)
        for e in self.engines:
            e.drain_tiers()
        if self.hw.tiers is not None:
            self.counters.update(tier_counters([e.tiers for e in self.engines]))
        return SimResult(self.flights, self.itl_s, self.engines, self.counters, self.autoscaling)

    # ---- workers -------------------------------------------------------------------------------------
    def add_worker(self, role: Role, ready_s: float, state: str = "ready") -> SimWorker:
        name = f"{role.value}-{self.next_index[role]}"
        self.next_index[role] += 1
        hw = self.hw
        engine = SimEngine(name, block_size=hw.block_size, num_blocks=hw.num_blocks, max_num_seqs=hw.max_num_seqs,
                           max_num_batched_tokens=hw.max_num_batched_tokens, tiers=hw.tiers,
                           bytes_per_block=hw.transfer.bytes_per_block)
        w = self.workers[name] = SimWorker(name, role, engine, state, ready_s)
        self.engines.append(engine)
        self.inflight[name] = 0
        if state == "ready":
            self.activate(w, ready_s)
        return w

    def activate(self, w: SimWorker, now: float) -> None:
        w.state, w.ready_s = "ready", now
        self.tracker.add_worker(w.name)
        self.index.add_worker(w.name)

    def retire(self, w: SimWorker) -> None:
        w.state = "dead"
        self.index.remove_worker(w.name)
        self.tracker.remove_worker(w.name)

    def ready(self, role: Role) -> list[str]:
        return [w.name for w in self.workers.values() if w.role == role and w.state == "ready"]

    def send(self, now: float, w: SimWorker, fn) -> None:
        """A message to the worker's engine thread, arriving ``net_s`` later."""
        self.at(now + self.hw.net_s, self._deliver, w, fn)

    def _deliver(self, now: float, w: SimWorker, fn) -> None:
        w.inbox.append(fn)
        if not w.busy:
            self._iterate(now, w)

    def _iterate(self, now: float, w: SimWorker) -> None:
        """One pass of the engine thread's loop: inbox, tick, and a step if there is work."""
        inbox, w.inbox = w.inbox, []
        for fn in inbox:
            fn(now)
        if w.waiting_handoffs and w.handoff_retry_sig != self._pool_sig(w):
            waiting, w.waiting_handoffs = w.waiting_handoffs, []
            waiting.sort(key=lambda f: not self.drains(f))  # a draining prefill worker's first (decode_worker/)
            for i, f in enumerate(waiting):
                self._admit(now, w, f)
                if self.drains(f) and w.waiting_handoffs and w.waiting_handoffs[-1] is f:
                    w.waiting_handoffs += waiting[i + 1:]  # it waits for room: the rest wait behind it
                    break
            w.handoff_retry_sig = self._pool_sig(w) if w.waiting_handoffs else None
        engine = w.engine
        engine.sync_tiers(now)
        sched = None
        if engine.has_work():
            sched, shape = engine.begin_step(now)
            if sched.is_empty:
                sched = None
        self._publish(w)
        if sched is None:
            w.busy = False
            self._wake_for_copies(w)
            self._check_drained(now, w)
            return
        w.busy = True
        step_s = self.hw.step_model.step_time_s(shape)
        engine.count_step(step_s, shape)
        self.at(now + step_s, self._step_done, w, sched)

    @staticmethod
    def _pool_sig(w: SimWorker) -> tuple[int, int]:
        """Handoffs waiting for blocks are retried every loop (as DecodeWorker's tick does) but only when the
        pool changed since they last failed: free and cached block counts (a cheap stand-in that misses
        only a simultaneous evict-and-store of equal size)."""
        return w.engine.pool.num_free_blocks, w.engine.pool.num_cached_blocks

    def _wake_for_copies(self, w: SimWorker) -> None:
        """An idle engine with copies in flight looks at them when the next one lands (the real loop waits
        on the mover: ``Engine.step``'s ``sync_tiers(wait_s)``, the publisher's ``take_events``)."""
        t = w.engine.next_wake_s()
        if t is not None and t != w.wake_s:
            w.wake_s = t
            self.at(t, self._wake, w)

    def _wake(self, now: float, w: SimWorker) -> None:
        if w.wake_s == now:
            w.wake_s = float("inf")
        if not w.busy and w.state != "dead":
            self._iterate(now, w)

    def _step_done(self, now: float, w: SimWorker, sched) -> None:
        outputs = w.engine.end_step(sched, now)
        for out in outputs:
            self._on_output(now, w, out)
        self._iterate(now, w)

    def _publish(self, w: SimWorker) -> None:
        events = w.engine.take_events()
        if w.state in ("ready", "draining"):
            self.index.apply_all(self.feed.forward(events))
            self.tracker.report(w.engine.load(w.role.value))

    def _check_drained(self, now: float, w: SimWorker) -> None:
        if w.state == "draining" and not w.busy and not self.inflight[w.name] and w.engine.is_idle() \
                and not w.waiting_handoffs and not w.inbox:
            if w.flip_to is not None:  # a role flip: the engine (weights, prefix cache) stays, as in cluster/
                w.role, w.state, w.flip_to = w.flip_to, "starting", None
                self.at(now + self.hw.flip_s, self._flipped, w)
            else:
                self.retire(w)
            if self.autoscaling is not None:
                self.autoscaling.reconcile(now)

    def _flipped(self, now: float, w: SimWorker) -> None:
        w.state, w.ready_s = "ready", now
        self.counters["flips"] = self.counters.get("flips", 0) + 1
        self._publish(w)
        if self.autoscaling is not None:
            self.autoscaling.reconcile(now)

    # ---- the router ---------------------------------------------------------------------------------
    def _arrive(self, now: float, f: Flight) -> None:
        B, n = self.hw.block_size, len(f.prompt)
        decode, prefill = self.ready(Role.DECODE), self.ready(Role.PREFILL)
        if not decode:
            f.error = "no decode worker"
            self._close(now, f)
            return
        d = route(self.policies[Role.DECODE], self.index, self.tracker, Role.DECODE, decode, f.hashes, n)
        uncached_d = n - d.overlap_blocks * B
        total_blocks = -(-(n + f.output_len) // B)
        if not prefill and uncached_d > self.dep.local_prefill_max_tokens:
            self.prefill_tokens_arrived += uncached_d  # what a prefill pool would have computed
        f.decode_worker = d.worker
        self.demand.placed(n, f.output_len)  # a simulated request's max_tokens is its output length
        wd = self.workers[d.worker]
        if not prefill or uncached_d <= self.dep.local_prefill_max_tokens:
            self.inflight[d.worker] += 1
            f.at_decode = True
            self.counters["local_prefill"] += 1
            self.tracker.dispatch(f.rid, d.worker, num_prefill_tokens=uncached_d, num_kv_blocks=total_blocks)
            peer = self._peer(d, f)
            self.send(now, wd, lambda t: self._start(t, wd, f, remote_decode=False, peer=peer))
            return
        self.counters["disaggregated"] += 1
        p = route(self.policies[Role.PREFILL], self.index, self.tracker, Role.PREFILL, prefill, f.hashes, n)
        self.prefill_tokens_arrived += n - p.overlap_blocks * B
        f.prefill_worker = p.worker
        self.tracker.dispatch(f.rid, d.worker, num_prefill_tokens=0, num_kv_blocks=total_blocks)
        self.tracker.dispatch(f.rid, p.worker, num_prefill_tokens=n - p.overlap_blocks * B, num_kv_blocks=-(-n // B))
        self.inflight[p.worker] += 1
        wp = self.workers[p.worker]
        peer = self._peer(p, f)
        self.send(now, wp, lambda t: self._start(t, wp, f, remote_decode=True, peer=peer))

    def _peer(self, decision, f: Flight) -> SimWorker | None:
        """The peer to fetch the longer prefix from (bench/sim/tiers.py), when the workers fetch from peers."""
        if self.hw.tiers is None or not self.hw.tiers.peers:
            return None
        name, num_blocks = best_peer(decision, self.index, f.hashes, decision.worker)
        return self.workers[name] if name is not None and num_blocks > 0 else None

    def _start(self, now: float, w: SimWorker, f: Flight, remote_decode: bool, peer: SimWorker | None = None) -> None:
        """Engine thread: the request enters the engine (after a peer fetch, if the router named a peer), or
        is refused (it could never fit the KV cache)."""
        try:
            if peer is not None and peer.state != "dead":
                w.engine.start_after_peer_fetch(f.rid, f.prompt, f.output_len, now, remote_decode, f.hashes,
                                                peer.engine)
            else:
                w.engine.add(f.rid, f.prompt, f.output_len, now, remote_decode=remote_decode)
        except ValueError as e:
            self._fail(now, f, str(e))

    def _fail(self, now: float, f: Flight, error: str) -> None:
        f.error = error
        for name in (f.prefill_worker, f.decode_worker):
            if name is not None and self.tracker.finish(f.rid, name) and (name != f.decode_worker or f.at_decode):
                self._leave(now, self.workers[name])
        self._close(now, f)

    def _on_output(self, now: float, w: SimWorker, out: Sampled) -> None:
        """A token reached the router (``net_s`` after the step that made it ended)."""
        f = self.by_rid[out.request_id]
        t = now + self.hw.net_s
        if out.num_output_tokens == 1 and f.first_s is None:
            f.first_s = f.last_s = t
            if self.autoscaling is not None:
                self.autoscaling.sample("ttft", t, w.name, t - f.arrival_s, len(f.prompt))
            if w.name == f.prefill_worker:  # the prefill call returned
                self.tracker.finish(f.rid, w.name)
                self._leave(now, w)
                if out.handoff:
                    self.at(now + self.hw.lease_timeout_s, self._expire_lease, w, f)
                    self._redirect(f)
                    self.inflight[f.decode_worker] += 1  # it reaches D now: a drain of D waits for it from here
                    f.at_decode = True
                    wd = self.workers[f.decode_worker]
                    self.send(t, wd, lambda t2: self._admit(t2, wd, f))
                    return
                self.tracker.finish(f.rid, f.decode_worker)  # ended at its first token: it never reached D
                f.done_s = t
                self._close(now, f)
                return
            else:
                self.tracker.prefill_done(f.rid, w.name)
        else:
            self.itl_s.append(t - f.last_s)
            if self.autoscaling is not None:
                self.autoscaling.sample("itl", t, w.name, t - f.last_s)
            f.last_s = t
        if out.finished:
            self.tracker.finish(f.rid, w.name)
            f.done_s = t
            self._leave(now, w)
            self._close(now, f)

    def _leave(self, now: float, w: SimWorker) -> None:
        self.inflight[w.name] -= 1
        self._check_drained(now, w)

    def _close(self, now: float, f: Flight) -> None:
        self._open -= 1
        if f.error is None and f.done_s is not None:  # it generated what it asked for
            self.demand.finished(f.output_len, f.output_len)
