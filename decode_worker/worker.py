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
The transfer thread (prefill_worker/puller.py) is the only user of this worker's NIXL agent.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.disagg import KVHandoff, RemoteKVPlan
from engine.engine import Engine
from kvtransfer import PeerInfo, ReleaseNotice, TransferRequest
from prefill_worker.base import EventSink, WorkerBase, WorkerOptions
from prefill_worker.puller import Puller

log = logging.getLogger(__name__)


class DecodeWorker(WorkerBase):
    def __init__(self, engine_config: EngineConfig, options: WorkerOptions, sinks: Sequence[EventSink] = ()) -> None:
        self._waiting: list[KVHandoff] = []  # engine thread: handoffs waiting for free blocks
        self.transfers_skipped_full_hit = 0
        super().__init__(engine_config, options, sinks)
        self.puller = Puller(self.engine.runner.kv_cache, self.compat, options.worker_id, options.transfer_timeout_s)
        if options.fault_pull_delay_s > 0:
            log.warning("fault injection: every KV pull of %s waits %.2f s (transfer.fault_pull_delay_s)",
                        options.worker_id, options.fault_pull_delay_s)

    def peer_info(self) -> PeerInfo:
        return self.puller.peer_info

    async def add_peers(self, peers: Sequence[PeerInfo]) -> list[str]:
        """Handshake with prefill workers (KVCompatError if a peer's layout/model/dtype differs)."""
        return await self.puller.add_peers(peers)

    async def remove_peers(self, peer_names: Sequence[str]) -> list[str]:
        """Forget prefill workers that are gone (their NIXL metadata and connections); returns those it knew.

        Runs on the transfer thread after the jobs already queued, so a pull in flight finishes (or fails)
        first; a handoff naming a forgotten peer later fails with "no handshake" and is recomputed or failed.
        """
        return await self.puller.remove_peers(peer_names)

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
            self.transfers_skipped_full_hit += 1
            self.puller.notify(handoff.source, ReleaseNotice(handoff.lease_id, ok=True).encode())
            engine.commit_remote(handoff.request_id)
            return
        request = TransferRequest(handoff.source, handoff.lease_id, plan.remote_block_ids, plan.local_block_ids)
        request_id = handoff.request_id
        # fault injection (transfer.fault_pull_delay_s): the blocks are reserved, the pull starts later
        self.puller.pull(request, lambda error, _: self.aengine.call(lambda e: self._settle(request_id, error)),
                         delay_s=self.options.fault_pull_delay_s)

    def _on_tick(self) -> None:
        if self._waiting:
            waiting, self._waiting = self._waiting, []
            for handoff in waiting:
                if not self.aengine.has_stream(handoff.request_id):  # the caller left while it waited
                    self.puller.notify(handoff.source, ReleaseNotice(handoff.lease_id, ok=False).encode())
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

    def _role_stats(self) -> dict[str, Any]:
        p = self.puller
        with p.lock:
            return {**p.stats, "transfers_skipped_full_hit": self.transfers_skipped_full_hit,
                    "waiting_for_blocks": len(self._waiting), "peers": p.num_peers,
                    "remote_pending": len(self.engine.remote_pending),
                    "transfer_time_s": p.xfer_time.snapshot(), "transfer_size_bytes": p.xfer_bytes.snapshot()}

    def shutdown(self) -> None:
        self.puller.stop()
        super().shutdown()
