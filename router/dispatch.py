"""ClusterBackend: the router's `Backend` over prefill and decode pools (decide, then act).

Deciding is router.policy (pure: index + predicted load -> worker); acting is a `WorkerClient` per
worker (cluster.ray_client talks to Ray actors; tests may bring their own). One request:

    hashes = hasher(prompt)                        # full blocks only, the engine's exact hash chain
    D = route(decode policy)                       # where it will decode
    uncached on D <= local_prefill_max_tokens?     # conditional disaggregation: D prefills it itself
        -> stream D.generate(...)
    P = route(prefill policy)
    first = await P.prefill(...)                   # first token + KVHandoff (blocks leased on P)
    yield first                                    # TTFT: the client has its first token now
    stream D.decode(handoff)                       # D pulls the blocks it lacks over NIXL, decodes

The router's `LoadTracker` counts every dispatch at once (prefill tokens the router expects to be
uncached, sequences, KV blocks) and forgets it when the request leaves the worker, so back-to-back
decisions do not wait for workers' load reports. Leaving early (client gone) aborts on every worker
involved and releases a lease the decode worker never claimed, so no block stays pinned.
A worker that fails mid-request (actor died, transfer error reported as an error output) ends the
request with ``finish_reason="error"``; bad input raises InvalidRequestError before anything runs.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from engine.disagg import KVHandoff
from engine.errors import ConfigError, InvalidRequestError
from engine.hashing import BlockHasher
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from engine.tokenizer import Tokenizer
from router.backend import Backend, Health, ModelCard
from router.index import PrefixIndex
from router.load import LoadTracker
from router.policy import CacheAwarePolicy, Role, RoutingPolicy, route

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerDescriptor:
    """What the router must know of a worker before routing to it."""

    worker_id: str
    role: Role
    hash_fingerprint: tuple  # BlockHasher.fingerprint (version, block_size, seed, namespace)
    max_model_len: int


class WorkerClient(ABC):
    """Acting on one worker. Every method may raise the transport's errors (actor gone, ...)."""

    descriptor: WorkerDescriptor

    @property
    def worker_id(self) -> str:
        return self.descriptor.worker_id

    @abstractmethod
    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestOutput: ...

    @abstractmethod
    def decode(self, handoff: KVHandoff) -> AsyncIterator[RequestOutput]: ...

    @abstractmethod
    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]: ...

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abstractmethod
    async def release(self, request_id: str) -> None: ...

    @abstractmethod
    async def alive(self) -> bool: ...


def check_fingerprints(hasher: BlockHasher, workers: Sequence[WorkerDescriptor]) -> None:
    """Refuse workers whose block hashing differs from the router's: their KV events would never match
    our hashes and prefix routing would silently do nothing (the anchors' most-reported routing bug)."""
    ours = hasher.fingerprint
    names = ("hash version", "block size", "hash seed", "hash namespace")
    for w in workers:
        theirs = tuple(w.hash_fingerprint)
        if theirs != ours:
            diff = [f"{n} {a!r} (router) != {b!r} (worker)" for n, a, b in zip(names, ours, theirs) if a != b]
            raise ConfigError(f"worker {w.worker_id} hashes KV blocks differently: {'; '.join(diff)}")


class ClusterBackend(Backend):
    def __init__(
        self,
        card: ModelCard,
        tokenizer: Tokenizer,
        hasher: BlockHasher,
        prefill: Sequence[WorkerClient],
        decode: Sequence[WorkerClient],
        *,
        index: PrefixIndex | None = None,
        tracker: LoadTracker | None = None,
        prefill_policy: RoutingPolicy | None = None,
        decode_policy: RoutingPolicy | None = None,
        local_prefill_max_tokens: int = 0,
    ) -> None:
        if not decode:
            raise ConfigError("a cluster needs at least one decode worker")
        check_fingerprints(hasher, [c.descriptor for c in (*prefill, *decode)])
        self.card = card
        self.tokenizer = tokenizer
        self.hasher = hasher
        self.prefill = {c.worker_id: c for c in prefill}
        self.decode = {c.worker_id: c for c in decode}
        self.index = index or PrefixIndex()
        self.tracker = tracker or LoadTracker()
        for w in (*self.prefill, *self.decode):
            self.tracker.add_worker(w)
        self.prefill_policy = prefill_policy or CacheAwarePolicy(hasher.block_size)
        self.decode_policy = decode_policy or CacheAwarePolicy(hasher.block_size)
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.counters = {"disaggregated": 0, "local_prefill": 0, "errors": 0, "aborted": 0}

    def health(self) -> Health:
        return Health(ok=True, detail={"prefill_workers": sorted(self.prefill), "decode_workers": sorted(self.decode),
                                       **self.counters})

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self.check_request(prompt_token_ids, params)
        ids = list(prompt_token_ids)
        hashes = self.hasher(ids)
        B = self.hasher.block_size
        d = route(self.decode_policy, self.index, self.tracker, Role.DECODE, list(self.decode), hashes, len(ids))
        uncached_on_d = len(ids) - d.overlap_blocks * B
        total_blocks = -(-(len(ids) + params.max_tokens) // B)
        if not self.prefill or uncached_on_d <= self.local_prefill_max_tokens:
            self.counters["local_prefill"] += 1
            stream = self._local(request_id, ids, params, self.decode[d.worker], uncached_on_d, total_blocks)
        else:
            self.counters["disaggregated"] += 1
            p = route(self.prefill_policy, self.index, self.tracker, Role.PREFILL, list(self.prefill), hashes, len(ids))
            stream = self._disaggregated(request_id, ids, params, self.prefill[p.worker], self.decode[d.worker],
                                         len(ids) - p.overlap_blocks * B, total_blocks)
        async for out in stream:
            yield out

    async def _local(self, rid, ids, params, d: WorkerClient, uncached: int, total_blocks: int):
        self.tracker.dispatch(rid, d.worker_id, num_prefill_tokens=uncached, num_kv_blocks=total_blocks)
        try:
            first = True
            async for out in self._guard(d.generate(rid, ids, params), rid, d):
                if first:
                    self.tracker.prefill_done(rid, d.worker_id)
                    first = False
                yield out
        finally:
            self.tracker.finish(rid, d.worker_id)

    async def _disaggregated(self, rid, ids, params, p: WorkerClient, d: WorkerClient, uncached: int,
                             total_blocks: int):
        self.tracker.dispatch(rid, p.worker_id, num_prefill_tokens=uncached, num_kv_blocks=-(-len(ids) // self.hasher.block_size))
        try:
            first = await self._call(p.prefill(rid, ids, params), rid, p)
        finally:
            self.tracker.finish(rid, p.worker_id)
        handoff = first.handoff
        if handoff is None:  # ended at its first token (or failed)
            yield first
            return
        yield dataclasses.replace(first, finished=False, finish_reason=None, handoff=None)
        self.tracker.dispatch(rid, d.worker_id, num_prefill_tokens=0, num_kv_blocks=total_blocks)
        done = False
        try:
            async for out in self._guard(d.decode(handoff), rid, d):
                done = out.finished
                yield dataclasses.replace(out, num_cached_tokens=first.num_cached_tokens)
        finally:
            self.tracker.finish(rid, d.worker_id)
            if not done:  # D refused it or the client left: make sure P's blocks do not wait for the lease
                await _quietly(p.release(rid))

    async def _call(self, coro, rid: str, worker: WorkerClient) -> RequestOutput:
        try:
            return await coro
        except asyncio.CancelledError:
            await _quietly(worker.abort(rid))
            self.counters["aborted"] += 1
            raise
        except InvalidRequestError:
            raise
        except Exception as e:
            return self._error_output(rid, worker, e)

    async def _guard(self, stream: AsyncIterator[RequestOutput], rid: str, worker: WorkerClient):
        """Yield a worker's stream; on early exit abort there; a worker fault becomes an error output."""
        finished = False
        try:
            async for out in stream:
                finished = out.finished
                yield out
        except InvalidRequestError:
            finished = True
            raise
        except Exception as e:
            finished = True
            yield self._error_output(rid, worker, e)
        finally:
            if not finished:
                self.counters["aborted"] += 1
                await _quietly(worker.abort(rid))
            await _quietly(stream.aclose())

    def _error_output(self, rid: str, worker: WorkerClient, e: BaseException) -> RequestOutput:
        self.counters["errors"] += 1
        log.error("request %s failed on worker %s: %s", rid, worker.worker_id, e)
        return RequestOutput(request_id=rid, new_token_ids=[], new_text="", finished=True, finish_reason="error",
                             error=f"worker {worker.worker_id} failed: {type(e).__name__}: {e}")


async def _quietly(awaitable) -> None:
    """Best-effort cleanup: a dead worker must not turn a cleanup into a second failure."""
    try:
        await asyncio.shield(asyncio.ensure_future(awaitable))
    except BaseException as e:  # noqa: BLE001 - includes CancelledError of the shielding task
        log.debug("cleanup call failed: %r", e)
