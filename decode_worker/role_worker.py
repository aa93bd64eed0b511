"""Worker: the Ray actor of either role, able to flip between prefill and decode without reloading its model.

    worker = Worker(engine_config, WorkerOptions(worker_id="prefill-0", role="prefill"), sinks)
    await worker.prefill(...)                                   # a prefill worker's verbs (prefill_worker/worker.py)
    info = await worker.flip_role(WorkerOptions(worker_id="decode-3", role="decode"), decode_pool_engine_config)
    async for out in worker.decode(handoff): ...                # now a decode worker's (decode_worker/worker.py)

Everything role-specific lives in the role object (`PrefillRole` / `DecodeRole`, prefill_worker/base.py
`WorkerRole`); this class only routes each actor method to the role that owns it and refuses the other
role's methods (WrongRoleError), so a call that reaches a worker after its flip fails loudly instead of
doing the wrong thing. It lives in decode_worker/ because that package already imports prefill_worker
(the DAG: prefill_worker ← decode_worker ← cluster), and the launcher spawns it for both pools.

LoRA adapters (``load_lora`` / ``unload_lora`` / ``lora_adapters``) are either role's: the router gives every worker
the same set (router/lora_adapters.py), and a flip keeps the engine, so it keeps its adapters.

The flip itself (`WorkerBase.flip_role`, prefill_worker/base.py) keeps the engine — weights, the KV cache
tensor, the prefix cache and its lower tiers — and the reading NIXL agent, and refuses unless the worker
is idle and the new pool's engine config is the loaded one. What changes with the role:
- NIXL: prefill → decode closes the prefill role's own agent (the one decode workers and peers read from;
  the pool manager has them forget it) and the reading agent forgets its import peers; decode → prefill
  registers a fresh agent for the cache and host tier. The peer info reported after the flip is the new
  role's (``info().peer``); the new role's handshake is the one a started worker gets.
- The worker id: a flip gives the worker a new id in the new role's numbering (``prefill-0`` → ``decode-3``),
  never keeps it. The router's registry, index, load tracker, metrics and event readers are all keyed by
  id, and each of them already handles "a worker left" (retire: out of the index and the tracker, record
  kept as dead with its reason) and "a worker joined" (starting → ready, a fresh event stream from seq 1).
  Keeping the id would have needed a backwards registry transition (draining → ready) and a role change
  under the same id in every one of those consumers. The cost: the flipped worker's cached prefixes reach
  the index again through its first batch under the new id, which is the whole cached set (AllCleared +
  every hash), so a flipped worker is routed to for what it holds at once; its engine counters (tokens,
  prefix hits) carry on from where they were, under the new id's series.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from decode_worker.worker import DecodeRole
from engine.errors import InvalidRequestError
from engine.kv.handoff import KVHandoff, PeerBlocks
from engine.request import SamplingParams
from kvtransfer import PeerInfo
from prefill_worker.base import WorkerBase, WorkerRole
from prefill_worker.worker import PrefillRole

UNLOAD_WAIT_S = 30.0  # an unload retries this long while requests of this worker still use the adapter

ROLES: dict[str, type[WorkerRole]] = {"prefill": PrefillRole, "decode": DecodeRole}


class Worker(WorkerBase):
    def _make_role(self, name: str) -> WorkerRole:
        return ROLES[name](self)

    # ---- prefill ---------------------------------------------------------------------------------
    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      peer: PeerBlocks | None = None):
        return await self._as(PrefillRole).prefill(request_id, prompt_token_ids, params, peer)

    async def export_blocks(self, block_hashes: list[int], token_ids: list[int], first_block: int) -> PeerBlocks | None:
        return await self._as(PrefillRole).export_blocks(block_hashes, token_ids, first_block)

    async def release(self, request_id: str) -> bool:
        return await self._as(PrefillRole).release(request_id)

    async def add_import_peers(self, peers: list[PeerInfo]) -> list[str]:
        return await self._as(PrefillRole).add_import_peers(peers)

    # ---- decode ----------------------------------------------------------------------------------
    async def add_peers(self, peers: Sequence[PeerInfo]) -> list[str]:
        return await self._as(DecodeRole).add_peers(peers)

    async def decode(self, handoff: KVHandoff):
        async for out in self._as(DecodeRole).decode(handoff):
            yield out

    async def pull_first(self, agent_names: Sequence[str]) -> None:
        await self._as(DecodeRole).pull_first(agent_names)

    async def remove_peers(self, peer_names: Sequence[str]) -> list[str]:
        known = await super().remove_peers(peer_names)
        if isinstance(self.role, DecodeRole):  # a forgotten prefill worker's drain is over
            self.role.forget_first(peer_names)
        return known

    # ---- LoRA adapters (either role; the router keeps every worker's set the same: router/lora_adapters.py) -------
    async def load_lora(self, name: str, path: str, pinned: bool = False) -> str:
        return await self.aengine.load_lora(name, path, pinned)

    async def unload_lora(self, name: str, wait_s: float = UNLOAD_WAIT_S) -> None:
        """Forget adapter ``name``. While a request of this worker still uses it (an abort on its way after the
        router's last request with it ended) the unload is retried, up to ``wait_s``; then its error is raised."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return await self.aengine.unload_lora(name)
            except InvalidRequestError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.05)

    async def lora_adapters(self) -> dict[str, str]:
        return await self.aengine.lora_adapters()
