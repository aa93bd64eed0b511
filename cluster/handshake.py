"""Which workers exchange NIXL metadata: the handshake of a worker joining its pool, telling the decode workers
that a prefill worker is draining (its handoffs are admitted first: decode_worker/worker.py), and forgetting a
prefill worker that left (its agent, on every worker that could read from it). Used by cluster/pools.py for
started, draining, drained and dead workers and by cluster/flip.py for a worker that changes pools."""
from __future__ import annotations

import asyncio
import logging

from cluster.ray_client import RayWorkerClient
from router.routing.policy import Role
from router.workers.registry import WorkerRegistry, WorkerState

log = logging.getLogger(__name__)


async def shake_hands(registry: WorkerRegistry, client: RayWorkerClient) -> None:
    """A worker joining its pool meets the workers it exchanges KV with: a decode worker learns every ready
    prefill worker; a prefill worker is learnt by every live decode worker and trades NIXL metadata with the
    other live prefill workers (the cluster pool: they read each other's lent blocks)."""
    if client.info.role == Role.DECODE:
        peers = [r.client.info.peer for r in registry.ready(Role.PREFILL)]
        if peers:
            await client.handle.add_peers.remote(peers)
    else:
        live = (WorkerState.READY, WorkerState.DRAINING)
        decoders = [r.client for r in registry.records(Role.DECODE, live)]
        await asyncio.gather(*(d.handle.add_peers.remote([client.info.peer]) for d in decoders))
        # the cluster pool: the new prefill worker and the others read each other's lent prefix blocks
        others = [r.client for r in registry.records(Role.PREFILL, live) if r.worker_id != client.worker_id]
        if others:
            await client.handle.add_import_peers.remote([o.info.peer for o in others])
            await asyncio.gather(*(o.handle.add_import_peers.remote([client.info.peer]) for o in others))


def peer_of(rec):
    """A worker record's NIXL peer info (None: a client that reports none)."""
    return getattr(getattr(rec.client, "info", None), "peer", None)


async def _on_each(records, call, failed: str) -> list:
    """``call(record)`` on every record at once, 30 s each; the answers of those that answered. One that did not is
    logged (``failed`` says what it did not do) and left out: it is itself gone or stuck, its own problem."""
    async def one(rec):
        return await asyncio.wait_for(call(rec), 30)

    results = await asyncio.gather(*(one(rec) for rec in records), return_exceptions=True)
    answers = []
    for rec, result in zip(records, results):
        if isinstance(result, BaseException):
            log.warning("worker %s %s: %r", rec.worker_id, failed, result)
        else:
            answers.append(result)
    return answers


async def pull_first(registry: WorkerRegistry, worker_id: str) -> int:
    """Every live decode worker admits the draining prefill worker ``worker_id``'s handoffs before others' (its
    drain ends when its leases are read); returns how many were told. Best effort: a decode worker that does not
    answer is logged, and the drain goes on at its own pace there."""
    rec = registry.get(worker_id)
    peer = peer_of(rec)
    if rec.role != Role.PREFILL or peer is None:
        return 0
    decoders = registry.records(Role.DECODE, (WorkerState.READY, WorkerState.DRAINING))
    told = await _on_each(decoders, lambda d: d.client.handle.pull_first.remote([peer.agent_name]),
                          f"was not told that {worker_id} drains")
    return len(told)


async def forget_peer(registry: WorkerRegistry, worker_id: str, agent_name: str) -> int:
    """Every live decode worker, and every other prefill worker (which read its lent blocks), drops the
    ended prefill worker's NIXL metadata and connection; returns how many knew it."""
    live = (WorkerState.READY, WorkerState.DRAINING)
    readers = registry.records(Role.DECODE, live) + [
        r for r in registry.records(Role.PREFILL, live) if r.worker_id != worker_id]
    known = await _on_each(readers, lambda r: r.client.handle.remove_peers.remote([agent_name]),
                           f"could not forget {worker_id}")
    return sum(len(names) for names in known)
