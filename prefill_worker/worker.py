"""PrefillWorker: runs prompts, samples the first token, and lends the prompt's KV blocks to a decode worker.

    out = await worker.prefill(request_id, prompt_token_ids, params)
    out.finished and out.handoff is None   -> the request ended at its first token (stop / length / error)
    out.handoff                            -> KVHandoff(source=<our NIXL agent>, lease_id=..., block_ids=...)

The engine (prefill role) pins the request's blocks when it hands off; this worker puts them under a
lease *on the engine thread, before the output is delivered*, so no decode worker can learn of blocks
that are not yet leased. The lease ends exactly once (kvtransfer.leases): on the puller's NIXL
notification (READ completed, or a failure notice), on `release()` from the router (the client left
before the decode worker pulled), or on its deadline — then `engine.release_held` unpins the blocks.
They stay in the prefix cache, so the next request with the same prefix still hits here.

The NIXL agent is created in the constructor and afterwards used only by the engine thread (its tick
polls notifications and expires leases): one thread owns a transport. The agent's own progress thread
serves the decode workers' READs of our memory without us.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from engine.config import EngineConfig
from engine.engine import Engine
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from kvtransfer import LeaseTable, NixlTransport, PeerInfo
from prefill_worker.base import EventSink, WorkerBase, WorkerOptions, _wrap

log = logging.getLogger(__name__)


class PrefillWorker(WorkerBase):
    def __init__(self, engine_config: EngineConfig, options: WorkerOptions, sinks: Sequence[EventSink] = ()) -> None:
        self._lease_by_request: dict[str, str] = {}
        self._request_by_lease: dict[str, str] = {}
        self.leases = LeaseTable(on_release=lambda block_ids: None, default_timeout_s=options.lease_timeout_s)
        super().__init__(engine_config, options, sinks)

    def _attach(self) -> None:
        self.transport = NixlTransport(self.engine.runner.kv_cache, self.compat,
                                       agent_name=f"duet-{self.options.worker_id}-{uuid.uuid4().hex[:8]}")

    def peer_info(self) -> PeerInfo:
        return self.transport.peer_info()

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestOutput:
        """Run the prompt; the returned output carries the first token and, unless the request already
        ended, the handoff. Cancelling this call aborts the request (its blocks are freed)."""
        last = None
        async for out in self.aengine.generate(prompt_token_ids=prompt_token_ids, params=params,
                                               request_id=request_id, remote_decode=True):
            last = out
        return last

    async def release(self, request_id: str) -> bool:
        """The router gave up on the handoff (client gone, decode worker refused it): unpin now."""
        return await _wrap(self.aengine.call(lambda engine: self._end_lease(request_id, engine)))

    # ---- engine thread ------------------------------------------------------------------------------
    def _on_output(self, out: RequestOutput) -> RequestOutput:
        if out.handoff is None:
            return out
        handoff = out.handoff
        lease_id = f"{handoff.request_id}/{uuid.uuid4().hex[:8]}"
        self.leases.acquire(lease_id, handoff.block_ids)
        self._lease_by_request[handoff.request_id] = lease_id
        self._request_by_lease[lease_id] = handoff.request_id
        out.handoff = replace(handoff, source=self.transport.agent_name, lease_id=lease_id)
        return out

    def _on_tick(self) -> None:
        for notice in self.transport.poll_release_notices():
            if self.leases.release(notice.lease_id, ok=notice.ok):
                self._unpin(notice.lease_id)
        for lease_id in self.leases.expire_overdue():
            log.warning("lease %s expired: no decode worker pulled its blocks in time", lease_id)
            self._unpin(lease_id)
        super()._on_tick()

    def _end_lease(self, request_id: str, engine: Engine) -> bool:
        lease_id = self._lease_by_request.get(request_id)
        if lease_id is None or not self.leases.release(lease_id, ok=False):
            return False
        self._unpin(lease_id)
        return True

    def _unpin(self, lease_id: str) -> None:
        request_id = self._request_by_lease.pop(lease_id, None)
        if request_id is not None:
            self._lease_by_request.pop(request_id, None)
            self.engine.release_held(request_id)

    def _role_stats(self) -> dict[str, Any]:
        return {"leases_held": len(self.leases), "leases_held_blocks": self.leases.num_held_blocks,
                **{f"leases_{k}": v for k, v in asdict(self.leases.counters).items()}}

    def shutdown(self) -> None:
        super().shutdown()
        self.transport.close()
