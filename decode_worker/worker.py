"""DecodeWorker: continues requests a prefill worker started, pulling only the KV blocks it lacks.

    async for out in worker.decode(handoff): ...   # tokens after the first (which the prefill worker sampled)

Path of one handoff (engine thread unless said otherwise):
1. `engine.reserve_remote(handoff)` re-hashes the prompt, reuses our own prefix hits, allocates the rest,
   and returns a `RemoteKVPlan`. If the pool is full right now the handoff waits (retried every tick;
   the prefill lease keeps the source blocks meanwhile).
2. Transfer thread: `transport.pull(...)` READs the missing blocks straight into our cache tensor over
   NIXL (one descriptor per contiguous run); NIXL's completion notification releases the lease at the
   prefill worker. No missing blocks (a full prefix hit): just send the release notice.
3. Success: `engine.commit_remote` (the request joins the continuous batch). Failure (peer gone, timeout,
   bad ids): `engine.fail_remote` recomputes the prompt here (`num_remote_recomputes`) or, with
   `recompute_on_transfer_failure=False`, ends the request with the error (`num_remote_failures`).
   Never silent: both are counted and logged.

Leaving the stream early aborts the request; if its KV is in flight the blocks are freed when the
transfer settles (the engine's abort_pending rule), so landing bytes never hit a reused block.
The transfer thread is the only user of this worker's NIXL agent (one thread owns a transport).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.disagg import KVHandoff, RemoteKVPlan
from engine.engine import Engine
from engine.histogram import NIXL_BYTES_BUCKETS, NIXL_XFER_BUCKETS_S, Histogram
from kvtransfer import KVTransferError, NixlTransport, PeerInfo, ReleaseNotice, TransferRequest
from prefill_worker.base import EventSink, WorkerBase, WorkerOptions

log = logging.getLogger(__name__)


class DecodeWorker(WorkerBase):
    def __init__(self, engine_config: EngineConfig, options: WorkerOptions, sinks: Sequence[EventSink] = ()) -> None:
        self._waiting: list[KVHandoff] = []  # engine thread: handoffs waiting for free blocks
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self.transfer_stats = {"transfers_ok": 0, "transfers_failed": 0, "transfer_bytes": 0, "transfer_s": 0.0,
                               "transfers_skipped_full_hit": 0}
        self._xfer_time = Histogram(NIXL_XFER_BUCKETS_S)  # per successful pull (vllm:nixl_xfer_time_seconds)
        self._xfer_bytes = Histogram(NIXL_BYTES_BUCKETS)  # (vllm:nixl_bytes_transferred)
        self._stats_lock = threading.Lock()  # the transfer thread writes these, stats() reads them
        self._num_peers = 0  # prefill workers handshaken with (written by the transfer thread)
        super().__init__(engine_config, options, sinks)
        self._transfer_thread = threading.Thread(target=self._transfer_loop, name=f"kv-{options.worker_id}", daemon=True)
        self._transfer_thread.start()
        self._peer_info: PeerInfo = self._ready.result(timeout=60)
        if options.fault_pull_delay_s > 0:
            log.warning("fault injection: every KV pull of %s waits %.2f s (transfer.fault_pull_delay_s)",
                        options.worker_id, options.fault_pull_delay_s)

    def peer_info(self) -> PeerInfo:
        return self._peer_info

    async def add_peers(self, peers: Sequence[PeerInfo]) -> list[str]:
        """Handshake with prefill workers (KVCompatError if a peer's layout/model/dtype differs)."""
        futures = []
        for peer in peers:
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._jobs.put(("add_peer", peer, future))
            futures.append(asyncio.wrap_future(future))
        return list(await asyncio.gather(*futures))

    async def remove_peers(self, peer_names: Sequence[str]) -> list[str]:
        """Forget prefill workers that are gone (their NIXL metadata and connections); returns those it knew.

        Runs on the transfer thread after the jobs already queued, so a pull in flight finishes (or fails)
        first; a handoff naming a forgotten peer later fails with "no handshake" and is recomputed or failed.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put(("remove_peers", tuple(peer_names), future))
        return await asyncio.wrap_future(future)

    async def decode(self, handoff: KVHandoff):
        """Stream the request's outputs after its first token. InvalidRequestError if it can never fit."""
        async for out in self.aengine.stream(handoff.request_id, lambda engine: self._admit(handoff, engine)):
            yield out

    # ---- engine thread ----------------------------------------------------------------------------------
    def _admit(self, handoff: KVHandoff, engine: Engine) -> None:
        plan = engine.reserve_remote(handoff)
        if plan is None:
            self._waiting.append(handoff)
        else:
            self._start_transfer(handoff, plan, engine)

    def _start_transfer(self, handoff: KVHandoff, plan: RemoteKVPlan, engine: Engine) -> None:
        if not plan.remote_block_ids:
            self.transfer_stats["transfers_skipped_full_hit"] += 1
            self._jobs.put(("notify", handoff.source, ReleaseNotice(handoff.lease_id, ok=True).encode()))
            engine.commit_remote(handoff.request_id)
            return
        request = TransferRequest(handoff.source, handoff.lease_id, plan.remote_block_ids, plan.local_block_ids)
        delay_s = self.options.fault_pull_delay_s
        if delay_s > 0:  # fault injection: the blocks are reserved, the pull starts later (pulls do not queue)
            timer = threading.Timer(delay_s, self._jobs.put, args=(("pull", request, handoff.request_id),))
            timer.daemon = True
            timer.start()
        else:
            self._jobs.put(("pull", request, handoff.request_id))

    def _on_tick(self) -> None:
        if self._waiting:
            waiting, self._waiting = self._waiting, []
            for handoff in waiting:
                if not self.aengine.has_stream(handoff.request_id):  # the caller left while it waited
                    self._jobs.put(("notify", handoff.source, ReleaseNotice(handoff.lease_id, ok=False).encode()))
                    continue
                try:
                    self._admit(handoff, self.engine)
                except Exception as e:
                    self.aengine.deliver(handoff.request_id, e)
        super()._on_tick()

    def _settle(self, request_id: str, error: str | None) -> None:
        if error is None:
            self.engine.commit_remote(request_id)
            return
        recompute = self.options.recompute_on_transfer_failure
        log.warning("KV transfer for %s failed (%s): %s", request_id, "recomputing" if recompute else "failing", error)
        self.engine.fail_remote(request_id, f"KV transfer failed: {error}", recompute=recompute)

    # ---- transfer thread ---------------------------------------------------------------------------------
    def _transfer_loop(self) -> None:
        try:
            transport = NixlTransport(self.engine.runner.kv_cache, self.compat,
                                      agent_name=f"duet-{self.options.worker_id}-{uuid.uuid4().hex[:8]}")
        except Exception as e:
            self._ready.set_exception(e)
            return
        self._ready.set_result(transport.peer_info())
        with transport:
            while True:
                job = self._jobs.get()
                if job[0] == "stop":
                    return
                try:
                    self._run_job(transport, job)
                except Exception:  # keep the thread alive whatever one job does
                    log.exception("transfer job %s failed", job[0])

    def _run_job(self, transport: NixlTransport, job: tuple) -> None:
        kind = job[0]
        if kind == "add_peer":
            _, peer, future = job
            try:
                future.set_result(transport.add_peer(peer))
            except Exception as e:
                future.set_exception(e)
            self._num_peers = transport.num_peers
        elif kind == "remove_peers":
            _, names, future = job
            known = [name for name in names if transport.has_peer(name)]
            for name in known:
                try:
                    transport.remove_peer(name)
                except Exception:  # the binding may complain about a peer whose process is gone; it is forgotten
                    log.warning("removing peer %s", name, exc_info=True)
            self._num_peers = transport.num_peers
            future.set_result(known)
        elif kind == "notify":
            _, peer_name, payload = job
            try:
                transport.send_notif(peer_name, payload)
            except Exception:
                log.warning("could not notify %s", peer_name, exc_info=True)
        elif kind == "pull":
            _, request, request_id = job
            self._pull(transport, request, request_id)

    def _pull(self, transport: NixlTransport, request: TransferRequest, request_id: str) -> None:
        t0 = time.perf_counter()
        error, num_bytes = None, 0
        try:
            if not transport.has_peer(request.peer_name):
                raise KVTransferError(f"unknown prefill worker {request.peer_name!r} (no handshake)")
            num_bytes = transport.pull(request, timeout_s=self.options.transfer_timeout_s).num_bytes
        except KVTransferError as e:
            error = str(e)
        except Exception as e:  # nixl binding errors
            error = f"{type(e).__name__}: {e}"
        elapsed_s = time.perf_counter() - t0
        with self._stats_lock:
            self.transfer_stats["transfer_s"] += elapsed_s
            if error is None:
                self.transfer_stats["transfers_ok"] += 1
                self.transfer_stats["transfer_bytes"] += num_bytes
                self._xfer_time.observe(elapsed_s)
                self._xfer_bytes.observe(num_bytes)
            else:
                self.transfer_stats["transfers_failed"] += 1
        self.aengine.call(lambda engine: self._settle(request_id, error))

    def _role_stats(self) -> dict[str, Any]:
        with self._stats_lock:
            return {**self.transfer_stats, "waiting_for_blocks": len(self._waiting), "peers": self._num_peers,
                    "remote_pending": len(self.engine.remote_pending),
                    "transfer_time_s": self._xfer_time.snapshot(), "transfer_size_bytes": self._xfer_bytes.snapshot()}

    def shutdown(self) -> None:
        self._jobs.put(("stop",))
        self._transfer_thread.join(5)
        super().shutdown()
