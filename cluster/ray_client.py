"""RayWorkerClient: the router's `WorkerClient` for a worker that is a Ray actor (the "act" half).

Streams use Ray's streaming generators (an async-generator actor method returns an
`ObjectRefGenerator`; each yielded `RequestOutput` is one small object). Leaving a stream early sends
`abort` to the actor (fire and forget), which ends the request there and frees its blocks. An error
the worker raised on purpose (InvalidRequestError) is re-raised as itself, so the front doors answer
4xx; anything else (actor died, ...) propagates and the dispatcher turns it into an error output.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

import ray
from ray.exceptions import RayTaskError

from engine.errors import DuetError
from engine.kv.handoff import KVHandoff, PeerBlocks
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from prefill_worker.base import WorkerInfo
from router.routing.policy import Role
from router.workers.client import WorkerClient, WorkerDescriptor


def _unwrap(e: RayTaskError) -> BaseException:
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, DuetError) else e


class RayWorkerClient(WorkerClient):
    def __init__(self, handle: ray.actor.ActorHandle, info: WorkerInfo) -> None:
        self.handle = handle
        self.info = info
        self.why_not: str | None = None  # what its last health answer said was wrong
        self.descriptor = WorkerDescriptor(info.worker_id, Role(info.role), tuple(info.hash_fingerprint),
                                           info.max_model_len, info.weights)

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      peer: PeerBlocks | None = None) -> RequestOutput:
        try:
            return await self.handle.prefill.remote(request_id, prompt_token_ids, params, peer)
        except RayTaskError as e:
            raise _unwrap(e) from None

    async def export_blocks(self, block_hashes: list[int], token_ids: list[int], first_block: int) -> PeerBlocks | None:
        if self.descriptor.role != Role.PREFILL:
            return None  # decode workers do not lend blocks (yet): router/dispatch/cluster_backend.py names prefill peers only
        try:
            return await self.handle.export_blocks.remote(block_hashes, token_ids, first_block)
        except RayTaskError as e:
            raise _unwrap(e) from None

    def decode(self, handoff: KVHandoff) -> AsyncIterator[RequestOutput]:
        return self._stream(self.handle.decode.remote(handoff), handoff.request_id)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        return self._stream(self.handle.generate.remote(request_id, prompt_token_ids, params), request_id)

    async def _stream(self, refs, request_id: str) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            async for ref in refs:
                try:
                    out = await ref
                except RayTaskError as e:
                    finished = True
                    raise _unwrap(e) from None
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.handle.abort.remote(request_id)

    async def abort(self, request_id: str) -> None:
        await self.handle.abort.remote(request_id)

    async def release(self, request_id: str) -> None:
        if self.descriptor.role == Role.PREFILL:
            await self.handle.release.remote(request_id)

    async def load_lora(self, name: str, path: str, pinned: bool = False) -> str:
        try:
            return await self.handle.load_lora.remote(name, path, pinned)
        except RayTaskError as e:
            raise _unwrap(e) from None

    async def unload_lora(self, name: str) -> None:
        try:
            await self.handle.unload_lora.remote(name)
        except RayTaskError as e:
            raise _unwrap(e) from None

    async def lora_adapters(self) -> dict[str, str]:
        return await self.handle.lora_adapters.remote()

    async def alive(self) -> bool:
        """Whether its engine runs (and a tensor-parallel worker's other ranks answer); a worker Ray cannot reach
        raises Ray's error (the caller's reason). ``why_not`` keeps what the worker said when it is not."""
        health = await self.handle.health.remote()
        self.why_not = health.get("why")
        return bool(health["ok"])

    async def stats(self) -> dict:
        return await self.handle.stats.remote()
