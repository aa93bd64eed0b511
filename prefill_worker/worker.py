"""PrefillRole: a worker runs prompts, samples the first token, and lends the prompt's KV blocks to a decoder.

    out = await worker.prefill(request_id, prompt_token_ids, params)
    out.finished and out.handoff is None   -> the request ended at its first token (stop / length / error)
    out.handoff                            -> KVHandoff(source=<our NIXL agent>, lease_id=..., block_ids=...)

The engine (prefill role) pins the request's blocks when it hands off; this worker puts them under a
lease *on the engine thread, before the output is delivered*, so no decode worker can learn of blocks
that are not yet leased. The lease ends exactly once (kvtransfer.leases): on the puller's NIXL
notification (READ completed, or a failure notice), on `release()` from the router (the client left
before the decode worker pulled), or on its deadline — then `engine.release_held` unpins the blocks.
They stay in the prefix cache, so the next request with the same prefix still hits here.

The role is an object a worker holds (prefill_worker/base.py `WorkerRole`; the actor is decode_worker/role_worker.py
`Worker`), so a worker can flip to decode and back without reloading its model. The role's own NIXL agent
is created with the role (on the engine thread during a flip) and afterwards used only by the engine thread (its tick
polls notifications and expires leases): one thread owns a transport. The agent's own progress thread
serves the decode workers' READs of our memory without us. It registers the host KV tier too, so peers
can read blocks from either.

The cluster pool (DESIGN.md "KV tiers and the cluster pool"): prefill workers lend each other prefix blocks.
`export_blocks(hashes, token_ids, first_block)` pins the leading blocks of those we hold — on the device tier or
the host tier, token ids checked — under a lease like a handoff's, and returns `PeerBlocks` (or None).
The router passes that to the worker it chose (`prefill(..., peer=...)`), whose engine reads the blocks it
lacks with the worker's reading agent, owned by its `Puller` thread (prefill_worker/puller.py) instead of recomputing
them; a read that fails or times out is recomputed and counted (`num_peer_import_failures`). The lease ends
on the reader's notice or its deadline, as a handoff's does.
"""
from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.kv.handoff import PeerBlocks
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from kvtransfer import LeaseTable, NixlTransport, PeerInfo, ReleaseNotice, TransferRequest
from prefill_worker.base import WorkerRole, _wrap

if TYPE_CHECKING:
    from prefill_worker.base import WorkerBase

log = logging.getLogger(__name__)


class PrefillRole(WorkerRole):
    name = "prefill"

    def __init__(self, worker: WorkerBase) -> None:
        super().__init__(worker)
        engine, options = worker.engine, worker.options
        self._lease_by_request: dict[str, str] = {}
        self._request_by_lease: dict[str, str] = {}
        self.leases = LeaseTable(on_release=lambda block_ids: None, default_timeout_s=options.lease_timeout_s)
        self._exports: dict[str, tuple[list, list]] = {}  # lease id -> (device blocks, host slots) lent to a peer
        self.export_stats = {"exports": 0, "exported_blocks": 0}
        host = engine.tiers.mover.host if engine.tiers is not None else None
        self.transport = NixlTransport(engine.runner.kv_cache, worker.compat, host=host,
                                       agent_name=f"duet-{options.worker_id}-{uuid.uuid4().hex[:8]}")
        engine.scheduler.importer = _Importer(worker)
        self._rank_peers = worker.ranks.peer_infos() if len(worker.ranks) else ()  # tensor parallel: ranks 1 ..

    def peer_info(self) -> PeerInfo:
        return dataclasses.replace(self.transport.peer_info(), tp_ranks=self._rank_peers)

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      peer: PeerBlocks | None = None) -> RequestOutput:
        """Run the prompt; the returned output carries the first token and, unless the request already
        ended, the handoff. Cancelling this call aborts the request (its blocks are freed). ``peer``: prefix
        blocks another worker lent for it (``export_blocks``), read instead of recomputed."""
        last = None
        try:
            async for out in self.worker.aengine.generate(prompt_token_ids=prompt_token_ids, params=params,
                                                   request_id=request_id, remote_decode=True, peer=peer):
                last = out
        except InvalidRequestError:  # refused before the engine took it: end the peer's lease now
            if peer is not None:
                self.worker.puller.notify(peer.source, ReleaseNotice(peer.lease_id, ok=False).encode())
            raise
        return last

    async def add_import_peers(self, peers: list[PeerInfo]) -> list[str]:
        """Handshake our reading agent with other prefill workers, so we can read blocks they lend."""
        names = await self.worker.puller.add_peers(peers)
        if len(self.worker.ranks):
            await self.worker.ranks.add_peers(peers)
        return names

    async def export_blocks(self, block_hashes: list[int], token_ids: list[int],
                            first_block: int) -> PeerBlocks | None:
        """Lend the leading blocks of ``block_hashes`` (the request's blocks ``first_block, …``, whose tokens are
        ``token_ids[first_block * B:]``) that we hold on any readable tier, under a lease; None if we hold none."""
        return await _wrap(self.worker.aengine.call(lambda engine: self._export(block_hashes, token_ids, first_block, engine)))

    async def release(self, request_id: str) -> bool:
        """The router gave up on the handoff (client gone, decode worker refused it): unpin now."""
        return await _wrap(self.worker.aengine.call(lambda engine: self._end_lease(request_id, engine)))

    # ---- engine thread ------------------------------------------------------------------------------
    def on_output(self, out: RequestOutput) -> RequestOutput:
        if out.handoff is None:
            return out
        handoff = out.handoff
        lease_id = f"{handoff.request_id}/{uuid.uuid4().hex[:8]}"
        self.leases.acquire(lease_id, handoff.block_ids)
        self._lease_by_request[handoff.request_id] = lease_id
        self._request_by_lease[lease_id] = handoff.request_id
        out.handoff = replace(handoff, source=self.transport.agent_name, lease_id=lease_id,
                              lease_deadline_unix_s=self.leases.deadline_unix_s(lease_id))
        return out

    def on_tick(self) -> None:
        for notice in self.transport.poll_release_notices():
            if self.leases.release(notice.lease_id, ok=notice.ok):
                self._unpin(notice.lease_id)
        for lease_id in self.leases.expire_overdue():
            log.warning("lease %s expired: no decode worker pulled its blocks in time", lease_id)
            self._unpin(lease_id)

    def _export(self, block_hashes: list[int], token_ids: list[int], first_block: int,
                engine: Engine) -> PeerBlocks | None:
        B = engine.config.block_size
        tiers, n_cache = engine.tiers, engine.pool.num_blocks
        device, host, remote_ids = [], [], []
        for j, h in enumerate(block_hashes):
            tokens = token_ids[(first_block + j) * B:(first_block + j + 1) * B]
            block = engine.pool.get_cached_block(h, tokens)
            if block is not None:
                engine.pool.touch([block])
                device.append(block)
                remote_ids.append(block.block_id)
                continue
            slot = tiers.host.lookup(h, tokens) if tiers is not None else None
            if slot is None:
                break
            tiers.host.pin(slot)
            host.append(slot)
            remote_ids.append(n_cache + slot.slot_id)
        if not remote_ids:
            return None
        lease_id = f"export/{uuid.uuid4().hex[:12]}"
        self.leases.acquire(lease_id, tuple(remote_ids))
        self._exports[lease_id] = (device, host)
        self.export_stats["exports"] += 1
        self.export_stats["exported_blocks"] += len(remote_ids)
        return PeerBlocks(self.transport.agent_name, lease_id, first_block, tuple(block_hashes[:len(remote_ids)]),
                          tuple(remote_ids), self.leases.deadline_unix_s(lease_id))

    def _end_lease(self, request_id: str, engine: Engine) -> bool:
        lease_id = self._lease_by_request.get(request_id)
        if lease_id is None or not self.leases.release(lease_id, ok=False):
            return False
        self._unpin(lease_id)
        return True

    def _unpin(self, lease_id: str) -> None:
        lent = self._exports.pop(lease_id, None)
        if lent is not None:
            device, host = lent
            self.worker.engine.pool.free_blocks(reversed(device))
            for slot in host:
                self.worker.engine.tiers.host.unpin(slot)
            return
        request_id = self._request_by_lease.pop(lease_id, None)
        if request_id is not None:
            self._lease_by_request.pop(request_id, None)
            self.worker.engine.release_held(request_id)

    def stats(self) -> dict[str, Any]:
        puller = self.worker.puller
        with puller.lock:
            imports = {f"import_{k}": v for k, v in puller.stats.items()}
        return {"leases_held": len(self.leases), "leases_held_blocks": self.leases.num_held_blocks,
                **{f"leases_{k}": v for k, v in asdict(self.leases.counters).items()}, **self.export_stats, **imports,
                "import_peers": puller.num_peers}

    def busy(self) -> str | None:
        return f"{len(self.leases)} KV leases held" if len(self.leases) else None

    def close(self) -> None:
        self.worker.engine.scheduler.importer = None
        self.transport.close()


class _Importer:
    """The engine's ``PeerImporter`` (engine/sched/scheduler.py) for this worker: pulls on the importing agent."""

    def __init__(self, worker: WorkerBase) -> None:
        self.worker = worker

    def start(self, request_id, peer: PeerBlocks, remote_block_ids, local_block_ids) -> None:
        w = self.worker

        def done(error: str | None, _num_bytes: int) -> None:
            if error is not None:
                log.warning("reading %d prefix blocks of %s from peer %s failed (recomputing): %s",
                            len(local_block_ids), request_id, peer.source, error)
            w.aengine.call(lambda engine: engine.finish_import(request_id, error is None))

        request = TransferRequest(peer.source, peer.lease_id, remote_block_ids, local_block_ids,
                                  peer.lease_deadline_unix_s)
        w.puller.pull(request, done, delay_s=w.options.fault_pull_delay_s,  # fault injection, as decode's pulls
                      before=w.ranks.reads(request))

    def release(self, peer: PeerBlocks) -> None:
        self.worker.puller.notify(peer.source, ReleaseNotice(peer.lease_id, ok=True).encode())
