"""Puller: the thread that owns a worker's pulling NIXL agent and runs its jobs in order.

A decode worker pulls the prompt blocks a prefill worker handed off; a prefill worker pulls the prefix blocks a
peer lent it (the router named the peer). Both use this: one thread (``kv-<worker>``), one ``NixlTransport``
(one thread owns a transport), a queue of jobs — handshakes, forgetting peers, notices, pulls — run in
submission order, so a pull queued before a ``remove_peers`` finishes (or fails) first. A pull's outcome goes
to the callback it was queued with (on this thread): ``done(error or None, bytes moved)``. Every job is
guarded: whatever one does, the thread lives on.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import torch

from engine.histogram import NIXL_BYTES_BUCKETS, NIXL_XFER_BUCKETS_S, Histogram
from kvtransfer import KVCompat, KVTransferError, NixlTransport, PeerInfo, ReleaseNotice, TransferRequest
from kvtransfer.convert_reader import StoreBlocks
from kvtransfer.leases import LEASE_CLOCK_MARGIN_S
from prefill_worker.sources import Sources

log = logging.getLogger(__name__)

PullDone = Callable[[str | None, int], None]


class Puller:
    def __init__(self, kv: torch.Tensor, compat: KVCompat, worker_id: str, transfer_timeout_s: float,
                 host: torch.Tensor | None = None, store_blocks: StoreBlocks | None = None) -> None:
        """``store_blocks``: how a peer's blocks of another KV dtype are stored into this cache
        (prefill_worker/sources.py)."""
        self._kv, self._compat, self._host, self._store_blocks = kv, compat, host, store_blocks
        self.worker_id = worker_id
        self.transfer_timeout_s = transfer_timeout_s
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self.lock = threading.Lock()  # this thread writes the stats, stats() readers take them
        self.reset_stats()
        self.num_peers = 0
        self._thread = threading.Thread(target=self._loop, name=f"kv-{worker_id}", daemon=True)
        self._thread.start()
        self.peer_info: PeerInfo = self._ready.result(timeout=60)

    # ---- any thread ---------------------------------------------------------------------------------
    async def add_peers(self, peers: Sequence[PeerInfo]) -> list[str]:
        """Handshake with owners (KVCompatError if a peer's layout/model/dtype differs)."""
        futures = []
        for peer in peers:
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._jobs.put(("add_peer", peer, future))
            futures.append(asyncio.wrap_future(future))
        return list(await asyncio.gather(*futures))

    async def remove_peers(self, peer_names: Sequence[str] | None) -> list[str]:
        """Forget owners that are gone (their NIXL metadata and connections; None: every one); returns those it
        knew."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put(("remove_peers", None if peer_names is None else tuple(peer_names), future))
        return await asyncio.wrap_future(future)

    async def forget_all(self) -> list[str]:
        """Forget every peer (a role flip: the new role's handshake adds its own); returns those it knew."""
        return await self.remove_peers(None)

    def reset_stats(self) -> None:
        """Counters from zero (a role flip: the worker's new id starts its own series)."""
        with self.lock:
            self.stats = {"transfers_ok": 0, "transfers_failed": 0, "transfer_bytes": 0, "transfer_s": 0.0,
                          # pulls not started, or their bytes discarded, because the owner's lease ran out
                          "transfers_past_lease": 0}
            self.xfer_time = Histogram(NIXL_XFER_BUCKETS_S)  # per successful pull (vllm:nixl_xfer_time_seconds)
            self.xfer_bytes = Histogram(NIXL_BYTES_BUCKETS)  # (vllm:nixl_bytes_transferred)

    def notify(self, peer_name: str, payload: bytes) -> None:
        self._jobs.put(("notify", peer_name, payload))

    def pull(self, request: TransferRequest, done: PullDone, delay_s: float = 0.0,
             before: Callable[[], str | None] | None = None) -> None:
        """Queue a pull; ``done(error, num_bytes)`` runs on this thread when it ends. ``delay_s`` (fault
        injection) queues it that much later. ``before`` (a tensor-parallel worker's other ranks reading their
        parts) runs first on this thread: its error fails the pull (the owner's lease is released as failed)."""
        job = ("pull", request, done, before)
        if delay_s > 0:
            timer = threading.Timer(delay_s, self._jobs.put, args=(job,))
            timer.daemon = True
            timer.start()
        else:
            self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(("stop",))
        self._thread.join(5)

    # ---- the puller thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            transport = NixlTransport(self._kv, self._compat, host=self._host,
                                      agent_name=f"duet-{self.worker_id}-{uuid.uuid4().hex[:8]}")
        except Exception as e:
            self._ready.set_exception(e)
            return
        self._sources = Sources(self._kv, self._compat, 0, transport.agent_name, reader=transport,
                                store_blocks=self._store_blocks)
        self._ready.set_result(transport.peer_info())
        with transport:
            while True:
                job = self._jobs.get()
                if job[0] == "stop":
                    return
                try:
                    self._run(transport, job)
                except Exception:  # keep the thread alive whatever one job does
                    log.exception("transfer job %s failed", job[0])
            self._sources.close()

    def _run(self, transport: NixlTransport, job: tuple) -> None:
        kind = job[0]
        if kind == "add_peer":
            _, peer, future = job
            try:
                future.set_result(self._sources.add(peer))
            except Exception as e:
                future.set_exception(e)
            self.num_peers = len(self._sources.names)
        elif kind == "remove_peers":
            _, names, future = job
            known = [n for n in (self._sources.names if names is None else names) if self._sources.knows(n)]
            for name in known:
                try:
                    self._sources.remove([name])
                except Exception:  # the binding may complain about a peer whose process is gone; it is forgotten
                    log.warning("removing peer %s", name, exc_info=True)
            self.num_peers = len(self._sources.names)
            future.set_result(known)
        elif kind == "notify":
            _, peer_name, payload = job
            try:
                self._sources.notify(peer_name, payload)
            except Exception:
                log.warning("could not notify %s", peer_name, exc_info=True)
        elif kind == "pull":
            _, request, done, before = job
            self._pull(transport, request, done, before)

    def _notify_failed(self, request: TransferRequest) -> None:
        try:
            self._sources.notify(request.peer_name, ReleaseNotice(request.lease_id, ok=False).encode())
        except Exception:  # the owner may be gone; its lease then expires
            log.warning("could not notify %s", request.peer_name, exc_info=True)

    def _pull(self, transport: NixlTransport, request: TransferRequest, done: PullDone,
              before: Callable[[], str | None] | None = None) -> None:
        t0 = time.perf_counter()
        error, num_bytes, past_lease = None, 0, False
        try:
            if not self._sources.knows(request.peer_name):
                raise KVTransferError(f"unknown peer {request.peer_name!r} (no handshake)")
            timeout_s = self.transfer_timeout_s
            if request.deadline_unix_s is not None:
                left = request.deadline_unix_s - LEASE_CLOCK_MARGIN_S - time.time()
                if left <= 0:  # waited too long (for free blocks, in this queue): the owner may reuse them now
                    past_lease = True
                    self._notify_failed(request)
                    raise KVTransferError(f"the owner's lease {request.lease_id} runs out in "
                                          f"{left + LEASE_CLOCK_MARGIN_S:.2f} s: too late to start the read")
                timeout_s = min(timeout_s, left)
            failed = before() if before is not None else None
            if failed is not None:
                self._notify_failed(request)
                raise KVTransferError(f"a tensor-parallel rank's read failed: {failed}")
            if self._sources.is_staged(request.peer_name):  # another split or KV dtype: staged reads
                try:
                    num_bytes = self._sources.read(request.peer_name, request.remote_block_ids,
                                                   request.local_block_ids, timeout_s,
                                                   notif=ReleaseNotice(request.lease_id, ok=True).encode())
                except Exception:
                    self._notify_failed(request)
                    raise
            else:
                num_bytes = transport.pull(request, timeout_s=timeout_s).num_bytes
            if request.deadline_unix_s is not None and time.time() > request.deadline_unix_s - LEASE_CLOCK_MARGIN_S:
                # the bytes landed, but maybe after the owner could reuse the blocks: NIXL reports a READ of
                # reused memory as a success, so they cannot be trusted (the caller recomputes or fails)
                past_lease = True
                raise KVTransferError(f"the read of lease {request.lease_id} ended "
                                      f"{time.time() - request.deadline_unix_s:+.2f} s from the owner's deadline, "
                                      f"within the {LEASE_CLOCK_MARGIN_S} s margin or past it: the blocks may have "
                                      "been reused, the bytes are discarded")
        except KVTransferError as e:
            error = str(e)
        except Exception as e:  # nixl binding errors
            error = f"{type(e).__name__}: {e}"
        elapsed_s = time.perf_counter() - t0
        with self.lock:
            self.stats["transfer_s"] += elapsed_s
            if error is None:
                self.stats["transfers_ok"] += 1
                self.stats["transfer_bytes"] += num_bytes
                self.xfer_time.observe(elapsed_s)
                self.xfer_bytes.observe(num_bytes)
            else:
                self.stats["transfers_failed"] += 1
                self.stats["transfers_past_lease"] += past_lease
        if past_lease:
            log.warning("pull from %s: %s", request.peer_name, error)
        done(error, num_bytes)
