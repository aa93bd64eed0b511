"""DecodeRole: a worker that continues requests a prefill worker started, pulling only the KV blocks it lacks.

    async for out in worker.decode(handoff): ...   # tokens after the first (which the prefill worker sampled)

Path of one handoff (engine thread unless said otherwise):
1. `engine.reserve_remote(handoff)` re-hashes the prompt, reuses our own prefix hits, allocates the rest,
   and returns a `RemoteKVPlan`. If the pool is full right now the handoff waits (retried every tick;
   the prefill lease keeps the source blocks meanwhile — until its deadline, which the handoff carries: a
   pull that cannot end before it is not made, or its bytes are discarded, and the prompt is recomputed).
2. Transfer thread: `transport.pull(...)` READs the missing blocks straight into our cache tensor over
   NIXL (one descriptor per contiguous run); NIXL's completion notification releases the lease at the
   prefill worker. No missing blocks (a full prefix hit): just send the release notice.
3. Success: `engine.commit_remote` (the request joins the continuous batch). Failure (peer gone, timeout,
   bad ids): `engine.fail_remote` recomputes the prompt here (`num_remote_recomputes`) or, with
   `recompute_on_transfer_failure=False`, ends the request with the error (`num_remote_failures`).
   Never silent: both are counted and logged.

**A draining prefill worker's handoffs go first** (``pull_first``, told by the pool manager when a prefill worker
starts draining for a scale-down or a role flip: cluster/handshake.py). Its drain ends only when every lease it
holds is read, and on a full decode pool those handoffs wait for free blocks behind everyone else's, and new,
smaller handoffs take the blocks that free first: the simulator's flips into decode waited 40-60 s (docs/simulator.md
e). Its waiting handoffs are admitted before the others, and while one of them waits for room nothing overtakes
it, neither a waiting handoff nor a new one: the next blocks that free are its.

Leaving the stream early aborts the request; if its KV is in flight the blocks are freed when the
transfer settles (the engine's abort_pending rule), so landing bytes never hit a reused block.
The transfer thread (prefill_worker/puller.py) is the only user of this worker's NIXL agent: the worker's
reading agent, which it keeps across a role flip (decode_worker/role_worker.py).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.engine import Engine
from engine.kv.handoff import KVHandoff, RemoteKVPlan
from kvtransfer import PeerInfo, ReleaseNotice, TransferRequest
from prefill_worker.base import WorkerRole

if TYPE_CHECKING:
    from prefill_worker.base import WorkerBase

log = logging.getLogger(__name__)


class DecodeRole(WorkerRole):
    name = "decode"

    def __init__(self, worker: WorkerBase) -> None:
        super().__init__(worker)
        self._waiting: list[KVHandoff] = []  # engine thread: handoffs waiting for free blocks
        self._first: frozenset[str] = frozenset()  # draining prefill agents: their handoffs are admitted first
        self.handoffs_first = 0  # handoffs of a draining prefill worker admitted ahead of others (cumulative)
        self.transfers_skipped_full_hit = 0
        # made at start-up or by a flip into decode (engine thread, or before it runs): every CUDA-graph bucket
        # now, not on the first batch of each size (CUDA only; a no-op on a CPU)
        worker.engine.capture_decode_graphs()

    def peer_info(self) -> PeerInfo:
        return self.worker.puller.peer_info

    async def add_peers(self, peers) -> list[str]:
        """Handshake with prefill workers (KVCompatError if a peer's layout/model/dtype or tensor-parallel split
        differs); a tensor-parallel worker's ranks then shake hands with the peer's same-numbered ranks."""
        names = await self.worker.puller.add_peers(peers)
        if len(self.worker.ranks):
            await self.worker.ranks.add_peers(peers)
        return names

    async def pull_first(self, agent_names: Sequence[str]) -> None:
        """The handoffs of these prefill agents (draining) are admitted first from now on, until they are forgotten."""
        self._first = self._first | frozenset(agent_names)  # replaced, never mutated: the engine thread reads it

    def forget_first(self, agent_names: Sequence[str]) -> None:
        self._first = self._first - frozenset(agent_names)

    async def decode(self, handoff: KVHandoff):
        """Stream the request's outputs after its first token. InvalidRequestError if it can never fit."""
        async for out in self.worker.aengine.stream(handoff.request_id, lambda engine: self._admit(handoff, engine)):
            yield out

    # ---- engine thread ----------------------------------------------------------------------------------
    def _admit(self, handoff: KVHandoff, engine: Engine) -> bool:
        """Reserve the handoff's blocks and start its pull; False: it waits for free blocks (behind a draining
        prefill worker's handoff that waits, whatever room there is)."""
        first = self._first
        if first and handoff.source not in first and any(h.source in first for h in self._waiting):
            self._waiting.append(handoff)
            return False
        plan = engine.reserve_remote(handoff)
        if plan is None:
            self._waiting.append(handoff)
            return False
        self._start_transfer(handoff, plan, engine)
        return True

    def _start_transfer(self, handoff: KVHandoff, plan: RemoteKVPlan, engine: Engine) -> None:
        if not plan.remote_block_ids:
            self.transfers_skipped_full_hit += 1
            self.worker.puller.notify(handoff.source, ReleaseNotice(handoff.lease_id, ok=True).encode())
            engine.commit_remote(handoff.request_id)
            return
        request = TransferRequest(handoff.source, handoff.lease_id, plan.remote_block_ids, plan.local_block_ids,
                                  handoff.lease_deadline_unix_s)
        request_id = handoff.request_id
        # fault injection (transfer.fault_pull_delay_s): the blocks are reserved, the pull starts later
        w = self.worker
        w.puller.pull(request, lambda error, _: w.aengine.call(lambda e: self._settle(request_id, error)),
                      delay_s=w.options.fault_pull_delay_s, before=w.ranks.reads(request))

    def on_tick(self) -> None:
        if not self._waiting:
            return
        w, first = self.worker, self._first
        waiting, self._waiting = self._waiting, []
        if first:  # a draining prefill worker's handoffs first (stable: in arrival order within each group)
            waiting.sort(key=lambda h: h.source not in first)
        for i, handoff in enumerate(waiting):
            if not w.aengine.has_stream(handoff.request_id):  # the caller left while it waited
                w.puller.notify(handoff.source, ReleaseNotice(handoff.lease_id, ok=False).encode())
                continue
            try:
                admitted = self._admit(handoff, w.engine)
            except Exception as e:
                w.aengine.deliver(handoff.request_id, e)
                continue
            if handoff.source in first:
                if not admitted:  # it waits for room: the rest wait behind it
                    self._waiting += waiting[i + 1:]
                    return
                self.handoffs_first += 1

    def _settle(self, request_id: str, error: str | None) -> None:
        engine = self.worker.engine
        if error is None:
            engine.commit_remote(request_id)
            return
        recompute = self.worker.options.recompute_on_transfer_failure
        log.warning("KV transfer for %s failed (%s): %s", request_id, "recomputing" if recompute else "failing", error)
        engine.fail_remote(request_id, f"KV transfer failed: {error}", recompute=recompute)

    def stats(self) -> dict[str, Any]:
        p = self.worker.puller
        with p.lock:
            return {**p.stats, "transfers_skipped_full_hit": self.transfers_skipped_full_hit,
                    "waiting_for_blocks": len(self._waiting), "handoffs_first": self.handoffs_first,
                    "draining_sources": len(self._first), "peers": p.num_peers,
                    "remote_pending": len(self.worker.engine.remote_pending),
                    "transfer_time_s": p.xfer_time.snapshot(), "transfer_size_bytes": p.xfer_bytes.snapshot()}

    def busy(self) -> str | None:
        return f"{len(self._waiting)} handoffs waiting for free blocks" if self._waiting else None
