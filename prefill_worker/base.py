"""What every worker is, whatever its role: an engine on its own thread, a NIXL-registered KV cache, and
a publisher of KV events and load.

A worker is a plain Python object with async methods; the cluster wraps it in a Ray actor
(`ray.remote(...)(Worker)`, decode_worker/role_worker.py), and tests may drive it in-process. Threads inside one worker:
- the Ray actor's event loop (method calls: `prefill`, `decode`, `read_events`, ...);
- the engine thread (`AsyncEngine`): the only thread that touches the `Engine`. It also publishes KV
  events + load after every step (and every `publish_interval_s` when idle), so events leave in the
  order the block pool recorded them;
- the puller thread (prefill_worker/puller.py): the only user of the worker's reading NIXL agent (a decode
  worker pulls handed-off blocks with it, a prefill worker the prefix blocks a peer lends);
- a prefill worker's own agent (the one decode workers and peers read from) is used by the engine thread.

What a role does lives in a `WorkerRole` object (prefill_worker/worker.py `PrefillRole`, decode_worker/worker.py
`DecodeRole`); `flip_role` swaps it in place (decode_worker/role_worker.py documents the flip) while the engine —
weights, KV cache tensor, prefix cache, tiers — and the reading agent stay.

Events go to `sinks` chosen by the cluster (a `MemoryEventLog` that routers read through
`read_events`, and optionally a Redis stream); the worker only calls `sink.publish(worker, seq, data)`,
so it imports nothing of the router. `seq` grows by one per batch: a reader that sees a gap resyncs
from `snapshot_events()`.

Lives in prefill_worker/ and is shared by decode_worker/ (a decode worker is a worker that also
prefills short prompts itself), which keeps the package DAG: workers import engine and kvtransfer only.
The actor class of either role (`Worker`) is in decode_worker/role_worker.py, the top of that DAG.
"""
from __future__ import annotations

import asyncio
import logging
import os
import platform
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, TypeVar

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import DuetError
from engine.loading.weights_summary import WeightsSummary
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from kvtransfer import PeerInfo
from kvtransfer.leases import LEASE_CLOCK_MARGIN_S
from prefill_worker.engine_facts import block_store, engine_sections, hit_sources, kv_compat
from prefill_worker.event_sinks import EventSink
from prefill_worker.puller import Puller
from prefill_worker.tp_ranks import RankGroup
from proto.kv_codec import encode_batch

log = logging.getLogger(__name__)

R = TypeVar("R", bound="WorkerRole")


@dataclass(frozen=True)
class WorkerOptions:
    worker_id: str
    role: str  # "prefill" | "decode"
    lease_timeout_s: float = 60.0  # prefill: blocks held for a decode worker at most this long
    transfer_timeout_s: float = 30.0  # decode: one pull; keep well below the peers' lease timeout
    recompute_on_transfer_failure: bool = True  # decode: False ends the request with an error instead
    fault_pull_delay_s: float = 0.0  # fault injection (transfer.fault_pull_delay_s): wait before each pull (decode's
    # of a handoff, prefill's of a peer's blocks)
    publish_interval_s: float = 0.1  # load reports when nothing else happens
    full_state_interval_s: float | None = None  # publish the whole cached set this often (shared Redis
    # stream: routers that lost a batch resync in-band, identically); None: only on request (snapshot())
    torch_threads: int | None = None  # intra-op threads for this worker's engine (None: torch default)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")
        if self.transfer_timeout_s >= self.lease_timeout_s:
            raise ValueError("transfer_timeout_s must be shorter than lease_timeout_s (a lease could expire "
                             "under a transfer still landing)")
        if self.lease_timeout_s <= 2 * LEASE_CLOCK_MARGIN_S:
            raise ValueError(f"lease_timeout_s must exceed {2 * LEASE_CLOCK_MARGIN_S} s: a pull must end "
                             f"{LEASE_CLOCK_MARGIN_S} s before its lease does (prefill_worker/puller.py)")


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker states when it joins: identity, hashing contract, capacity, transfer endpoint."""

    worker_id: str
    role: str
    model_id: str
    hash_fingerprint: tuple  # BlockHasher.fingerprint: (version, block_size, seed, namespace)
    block_size: int
    max_model_len: int
    vocab_size: int
    num_blocks: int
    peer: PeerInfo
    pid: int
    node: str = ""  # host name (the pod's name on Kubernetes)
    weights: WeightsSummary | None = None  # what its engine holds and runs (engine/loading/resident.py)


class WorkerRole(ABC):
    """What one role adds to a worker. Built and closed on the engine thread (or before it runs), so the
    hooks below — called on the engine thread — never see it half set up."""

    name: str  # "prefill" | "decode"

    def __init__(self, worker: WorkerBase) -> None:
        self.worker = worker

    @abstractmethod
    def peer_info(self) -> PeerInfo:
        """The NIXL endpoint this role shows the other workers."""

    def on_output(self, out: RequestOutput) -> RequestOutput:
        return out

    def on_tick(self) -> None:
        """Engine thread, every loop: what the role retries or settles (nothing for a role without queues)."""

    def stats(self) -> dict[str, Any]:
        return {}

    def busy(self) -> str | None:
        """Why the role is not idle (work only it tracks), or None. Engine thread."""
        return None

    def close(self) -> None:
        """Let go of what only this role holds (engine thread, idle worker)."""


class WrongRoleError(DuetError):
    """A role's method was called on a worker of the other role."""


class FlipRefusedError(DuetError):
    """``flip_role`` refused (nothing changed): the worker already has that role, or the new one needs a reload."""


class WorkerBusyError(FlipRefusedError):
    """``flip_role`` refused because the worker is not idle (drain it first)."""


class WorkerBase(ABC):
    def __init__(self, engine_config: EngineConfig, options: WorkerOptions, sinks: Sequence[EventSink] = (),
                 ranks: Sequence = ()) -> None:
        """``ranks``: a tensor-parallel worker's ranks 1 .. N-1 (prefill_worker/tp_ranks.py ``TPRank`` actors, in
        this worker's placement group); this worker is rank 0."""
        if options.torch_threads:
            import torch

            torch.set_num_threads(options.torch_threads)
        self.options = options
        self.ranks = RankGroup(ranks)
        self.engine = Engine(replace(engine_config, worker_id=options.worker_id), tp=self.ranks.form_group(engine_config),
                             tier_mirror=self.ranks.tier_job if len(self.ranks) else None)
        self.compat = kv_compat(self.engine.config, self.engine.runner)
        self._sinks = list(sinks)
        self._seq = 0
        self._last_publish_s = 0.0
        self._last_full_state_s = time.monotonic()
        self._full_state_due = False  # a sink dropped a batch: send the whole cached set once it is back
        self.events_undelivered = 0  # batches some sink dropped (Redis down)
        self._started_s = time.time()
        host = self.engine.tiers.mover.host if self.engine.tiers is not None else None
        # the reading agent, kept for the worker's life whatever its role (a flip clears its peers)
        self.puller = Puller(self.engine.runner.kv_cache, self.compat, options.worker_id, options.transfer_timeout_s,
                             host=host, store_blocks=block_store(self.engine.runner))
        if options.fault_pull_delay_s > 0:
            log.warning("fault injection: every KV pull of %s waits %.2f s (transfer.fault_pull_delay_s)",
                        options.worker_id, options.fault_pull_delay_s)
        self.role = self._make_role(options.role)
        self.aengine = AsyncEngine(self.engine, on_output=self._on_output, on_tick=self._on_tick, tick_s=0.02,
                                   name=f"engine-{options.worker_id}", on_fatal=_exit_process)

    @abstractmethod
    def _make_role(self, name: str) -> WorkerRole:
        """The role object for ``name`` (engine thread, or before the engine thread runs)."""

    # ---- hooks (engine thread) -------------------------------------------------------------------
    def _on_output(self, out: RequestOutput) -> RequestOutput:
        return self.role.on_output(out)

    def _on_tick(self) -> None:
        self.role.on_tick()
        self._publish()

    def _publish(self, force_full: bool = False) -> None:
        events = self.engine.take_events()
        now = time.monotonic()
        every = self.options.full_state_interval_s
        full = force_full or (self._full_state_due and all(sink.available() for sink in self._sinks)) or (
            every is not None and now - self._last_full_state_s >= every)
        if full:
            events = self.engine.snapshot_events()  # subsumes the pending events
            self._last_full_state_s = now
        elif not events and now - self._last_publish_s < self.options.publish_interval_s:
            return
        self._last_publish_s = now
        self._seq += 1
        data = encode_batch(self.options.worker_id, self._seq, events, self.engine.load(self.options.role), time.time())
        delivered = True
        for sink in self._sinks:
            try:
                delivered = sink.publish(self.options.worker_id, self._seq, data) and delivered
            except Exception:  # a sink that is down (Redis restarting) must not stop the engine
                log.exception("KV event sink %r failed", sink)
                delivered = False
        if not delivered:
            # Readers of that sink see a seq gap and drop this worker from their index until a full state.
            self.events_undelivered += 1
            self._full_state_due = True
        elif full:
            self._full_state_due = False

    # ---- methods the cluster and routers call -------------------------------------------------------
    def peer_info(self) -> PeerInfo:
        """This worker's NIXL endpoint in its current role (a prefill worker's own agent, a decode worker's puller)."""
        return self.role.peer_info()

    def _as(self, role_cls: type[R]) -> R:
        role = self.role
        if not isinstance(role, role_cls):
            raise WrongRoleError(f"worker {self.options.worker_id} is a {role.name} worker, not {role_cls.name}")
        return role

    async def remove_peers(self, peer_names: Sequence[str]) -> list[str]:
        """Forget prefill workers that are gone (their NIXL metadata and connections); returns those it knew.

        Runs on the puller thread after the jobs already queued, so a pull in flight finishes (or fails)
        first; a handoff or a lent block naming a forgotten peer later fails with "no handshake" (recomputed).
        """
        known = await self.puller.remove_peers(peer_names)
        if len(self.ranks):
            await self.ranks.remove_peers(known)
        return known

    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(
            worker_id=self.options.worker_id, role=self.options.role, model_id=self.compat.model_id,
            hash_fingerprint=e.hasher.fingerprint,
            block_size=e.config.block_size, max_model_len=e.max_model_len, vocab_size=e.model_config.vocab_size,
            num_blocks=e.pool.num_blocks, peer=self.peer_info(), pid=os.getpid(), node=platform.node(),
            weights=e.runner.weights)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        """Prefill and decode here (colocated; a decode worker's conditional local prefill)."""
        async for out in self.aengine.generate(prompt_token_ids=prompt_token_ids, params=params,
                                               request_id=request_id):
            yield out

    async def abort(self, request_id: str) -> None:
        self.aengine.abort(request_id)

    async def read_events(self, after_seq: int, max_batches: int = 256,
                          wait_s: float = 0.0) -> tuple[list[bytes], int, bool]:
        """``(batches, last_seq, truncated)`` published after ``after_seq``, from the worker's in-memory log;
        waits up to ``wait_s`` for the first one (routers long-poll this). ``truncated``: the reader fell
        behind the log and must resync from ``snapshot()``."""
        reader = next((s for s in self._sinks if hasattr(s, "read")), None)
        if reader is None:
            raise RuntimeError("this worker has no readable event log")
        deadline = time.monotonic() + wait_s
        while True:
            batches, last_seq, truncated = reader.read(after_seq, max_batches)
            if batches or truncated or time.monotonic() >= deadline:
                return batches, last_seq, truncated
            await asyncio.sleep(0.01)

    async def snapshot(self) -> tuple[int, bytes]:
        """``(seq, batch)`` that rebuilds this worker's cached set from nothing: resync after a gap."""
        def take(engine: Engine) -> tuple[int, bytes]:
            self._last_publish_s = 0.0
            self._publish()  # pending events first, so the snapshot's seq covers them
            events = engine.snapshot_events()
            return self._seq, encode_batch(self.options.worker_id, self._seq, events,
                                           engine.load(self.options.role), time.time())

        return await _wrap(self.aengine.call(take))

    async def stats(self) -> dict[str, Any]:
        def take(engine: Engine) -> dict[str, Any]:
            pool = engine.pool
            pool.check()
            sched = engine.scheduler
            return {"worker_id": self.options.worker_id, "role": self.options.role, **asdict(engine.stats),
                    "kv_blocks_total": pool.num_blocks, "kv_blocks_used": pool.num_used_blocks,
                    "kv_blocks_cached": pool.num_cached_blocks, "running": len(sched.running),
                    "waiting": len(sched.waiting), "num_requests": len(engine.requests),
                    "num_held": len(engine.held), "num_preemptions": sched.num_preemptions,
                    "prefix_cache_queried_tokens": sched.num_prefix_queried_tokens,
                    "prefix_cache_hit_tokens": sched.num_prefix_hit_tokens, "queue_time_s": sched.queue_time.snapshot(),
                    "prefix_hit_tokens_by_source": hit_sources(engine),
                    "moe_tokens_per_expert": engine.runner.model.tokens_per_expert(),
                    "uptime_s": time.time() - self._started_s, "events_undelivered": self.events_undelivered,
                    "events_full_state_due": self._full_state_due, **engine_sections(engine),
                    **self._role_stats()}

        return await _wrap(self.aengine.call(take))

    def _role_stats(self) -> dict[str, Any]:
        return self.role.stats()

    async def flip_role(self, options: WorkerOptions, engine_config: EngineConfig) -> WorkerInfo:
        """Become a ``options.role`` worker named ``options.worker_id`` without reloading the model; returns the
        new ``info()``. FlipRefusedError (nothing changed) if the worker already has that role, if
        ``engine_config`` (the new pool's) differs from the loaded engine's in anything but the worker id, or if
        it is not idle: requests, blocks held for a decode worker, KV in flight, or what the role tracks
        (leases, handoffs waiting for blocks). Runs on the engine thread between steps, so nothing slips in
        between the idle check and the swap. Kept: the engine (weights, KV cache, prefix cache, tiers) and the
        reading agent (its peers are forgotten: the new role's handshake names its own). The old role lets
        go of what only it held (a prefill worker closes its own agent; the new one registers a fresh one).
        The event plane starts over under the new id: seq 1 is the whole cached set (AllCleared + every hash)."""
        old = self.options
        if options.role == old.role:
            raise FlipRefusedError(f"worker {old.worker_id} already is a {old.role} worker")
        reason = reload_reason(self.engine.config, engine_config)
        if reason is not None:
            raise FlipRefusedError(f"worker {old.worker_id} cannot become a {options.role} worker without reloading "
                                   f"its engine: {reason}")

        def flip(engine: Engine) -> None:
            why = self._busy(engine)
            if why is not None:
                raise WorkerBusyError(f"worker {old.worker_id} is busy ({why}): drain it before flipping its role")
            self.role.close()
            engine.take_events()  # the old id's: the router dropped that id's index entry when it retired it
            engine.rename(options.worker_id)
            self.options = options
            if options.torch_threads:
                import torch

                torch.set_num_threads(options.torch_threads)  # the engine thread's own OpenMP setting
            self.ranks.set_role(options.role)  # tensor parallel: the other ranks' agents follow (before the role)
            self.role = self._make_role(options.role)
            self._seq = 0
            for sink in self._sinks:
                if hasattr(sink, "restart"):
                    sink.restart()
            self._publish(force_full=True)

        await _wrap(self.aengine.call(flip))
        forgotten = await self.puller.forget_all()
        self.puller.reset_stats()
        log.info("worker %s is now %s (%s), without a reload; its puller forgot %d peer(s)", old.worker_id,
                 options.worker_id, options.role, len(forgotten))
        return self.info()

    def _busy(self, engine: Engine) -> str | None:
        """Why this worker is not idle, or None (engine thread)."""
        counts = {"requests": len(engine.requests), "requests held for a decode worker": len(engine.held),
                  "requests with KV in flight": len(engine.remote_pending)}
        why = [f"{n} {what}" for what, n in counts.items() if n]
        role_why = self.role.busy()
        if role_why:
            why.append(role_why)
        return ", ".join(why) or None

    async def health(self) -> dict[str, Any]:
        """Liveness: the engine thread runs — and, tensor parallel, every other rank answers and follows."""
        out = {"ok": self.aengine.is_alive, "worker_id": self.options.worker_id, "role": self.options.role}
        if out["ok"] and len(self.ranks):
            problem = await self.ranks.check()
            if problem is not None:
                out.update(ok=False, why=problem)
        return out

    def shutdown(self) -> None:
        self.puller.stop()
        self.aengine.shutdown()
        self.role.close()
        self.engine.close()


def reload_reason(current: EngineConfig, wanted: EngineConfig) -> str | None:
    """Why an engine built from ``current`` cannot stand in for one built from ``wanted`` (None: it can). Every
    engine setting but the worker id fixes what was loaded or sized (model, device, dtype, block size, KV
    blocks and tiers, kernels, ...): a difference in any of them means a reload, i.e. a fresh worker."""
    diff = [f"{f.name} {getattr(current, f.name)!r} != {getattr(wanted, f.name)!r}" for f in fields(current)
            if f.name != "worker_id" and getattr(current, f.name) != getattr(wanted, f.name)]
    return "; ".join(diff) or None


def _exit_process(error: Exception) -> None:
    """A tensor-parallel rank is gone: the worker ends as a whole, as a one-rank worker that died does — its actor
    dies, the router places its requests again or migrates them, the pool replaces it, its other ranks lose their
    connection to it and exit too."""
    log.critical("worker exits: %s", error)
    logging.shutdown()
    os._exit(1)


async def _wrap(future):
    return await asyncio.wrap_future(future)
