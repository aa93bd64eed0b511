"""ClusterBackend: the router's `Backend` over prefill and decode pools (decide, then act).

Deciding is router.routing.policy (pure: index + predicted load -> worker); acting is a `WorkerClient` per
worker (cluster.ray_client talks to Ray actors; tests may bring their own). One request:

    hashes = hasher(prompt, params.hash_salt)      # full blocks only, the engine's exact hash chain (salted)
    D = route(decode policy)                       # where it will decode
    uncached on D <= local_prefill_max_tokens?     # conditional disaggregation: D prefills it itself
        -> stream D.generate(...)
    P = route(prefill policy)                      # (prefill_hasher's hashes: a pool of another KV dtype)
    first = await P.prefill(...)                   # first token + KVHandoff (blocks leased on P)
    yield first                                    # TTFT: the client has its first token now
    stream D.decode(handoff)                       # D pulls the blocks it lacks over NIXL, decodes

Workers come from the one `WorkerRegistry` (router/workers/registry.py): only `ready` ones are routed to; a
`draining` one finishes what it holds. ``inflight[worker]`` counts the requests placed on a worker and
not yet done with it (a decode worker from the moment it is chosen, before its prefill ran elsewhere), which
is what a drain waits for. With `metrics`, every output is timed as the client sees it (router/metrics/collector.py)
and attributed to the worker that produced it; routing outcomes are counted.

The router's `LoadTracker` counts every dispatch at once (prefill tokens the router expects to be
uncached, sequences, KV blocks) and forgets it when the request leaves the worker, so back-to-back
decisions do not wait for workers' load reports. Leaving early (client gone) aborts on every worker
involved and releases a lease the decode worker never claimed, so no block stays pinned.
Faults (router/dispatch/faults.py): a worker call that raises is followed by a liveness probe. A dead worker leaves
the pools (and the index and load tracker); a request it held is placed again on the remaining workers if the client
has seen nothing yet (prefill failed, or a local prefill failed before its first token), otherwise it is
continued elsewhere from where the client is (router/dispatch/migration.py: the prompt plus the tokens sent, the
engine resuming exactly), at most ``MAX_MIGRATIONS`` times; then it ends with ``finish_reason="error"``.
A live worker's failure is an error output, never retried blindly.
Bad input raises InvalidRequestError before anything runs.
LoRA adapters (router/lora_adapters.py, ``lora``): every worker holds the served set, so any worker can take any
request; a request's adapter is counted from admission to its end, which is what an unload waits for. A request
for an adapter is routed among the workers of each pool whose device slots can run it now, when there are any
(router/routing/lora_slots.py: placement by slot budget, counted in ``lora_ready`` / ``lora_all_busy``).

Pools of two KV dtypes (mixed precision: a prefill pool at the model dtype, a quantized decode pool) hash in two
namespaces (engine/kv/hashing.py ``kv_namespace``): ``hasher`` is the decode pool's, ``prefill_hasher`` the prefill
pool's; each worker's fingerprint is checked against its own pool's, and a request's prefill is routed on the
prefill pool's hashes.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence

from engine.errors import ConfigError
from engine.kv.handoff import PeerBlocks
from engine.kv.hashing import BlockHasher
from engine.outputs import RequestOutput
from engine.request import SamplingParams, admit_rope_factors
from engine.text.tokenizer import Tokenizer
from router.backend import Backend, Health, ModelCard
from router.dispatch.faults import WorkerFaults, _Lost, _quietly
from router.dispatch.migration import MAX_MIGRATIONS, SentSoFar, with_seed
from router.lora_adapters import LoraAdapters, ServedAdapter
from router.lora_resolver import LoraResolver
from router.metrics.collector import RequestTiming, RouterMetrics
from router.routing.demand import DecodeDemand
from router.routing.index import PrefixIndex
from router.routing.load import LoadTracker
from router.routing.lora_slots import ready_workers
from router.routing.policy import CacheAwarePolicy, NoWorkersError, Role, RoutingPolicy, route
from router.workers.client import WorkerClient, check_fingerprints
from router.workers.registry import WorkerRegistry, WorkerState

log = logging.getLogger(__name__)

MAX_PLACEMENTS = 3  # a request whose worker died before the client saw anything is placed again
PEER_EXPORT_TIMEOUT_S = 2.0  # asking a peer to lend blocks; past it the prefill worker computes them


class ClusterBackend(WorkerFaults, Backend):
    def __init__(
        self,
        card: ModelCard,
        tokenizer: Tokenizer,
        hasher: BlockHasher,
        prefill: Sequence[WorkerClient] = (),
        decode: Sequence[WorkerClient] = (),
        *,
        registry: WorkerRegistry | None = None,
        index: PrefixIndex | None = None,
        tracker: LoadTracker | None = None,
        prefill_policy: RoutingPolicy | None = None,
        decode_policy: RoutingPolicy | None = None,
        local_prefill_max_tokens: int = 0,
        metrics: RouterMetrics | None = None,
        prefill_hasher: BlockHasher | None = None,
        lora_modules: Sequence[ServedAdapter] = (),
        lora_resolver: LoraResolver | None = None,
    ) -> None:
        self.card = card
        self.tokenizer = tokenizer
        self.hasher = hasher  # the decode pool's block hashes
        self.prefill_hasher = prefill_hasher or hasher  # the prefill pool's (another namespace: another KV dtype)
        self.registry = registry or WorkerRegistry()
        self.index = index or PrefixIndex()
        self.tracker = tracker or LoadTracker()
        self.prefill_policy = prefill_policy or CacheAwarePolicy(hasher.block_size)
        self.decode_policy = decode_policy or CacheAwarePolicy(hasher.block_size)
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.metrics = metrics
        self.counters = {"disaggregated": 0, "local_prefill": 0, "decode_redirected": 0, "errors": 0, "aborted": 0,
                         "replaced": 0, "migrated": 0, "lora_ready": 0, "lora_all_busy": 0}
        # blocks borrowed from a peer for a prefill: lent, not held any more, asking failed (computed instead)
        self.peer_fetches = {"lent": 0, "gone": 0, "failed": 0}
        self.prefill_tokens_routed = 0  # uncached prompt tokens of requests that needed a prefill (cumulative)
        self.demand = DecodeDemand(hasher.block_size)  # what the requests ask of decode (cumulative)
        self.inflight: collections.Counter[str] = collections.Counter()  # worker -> requests placed, not done
        self.lora = LoraAdapters(self._lora_targets, lora_modules, lora_resolver)  # the same adapters on every worker
        for client in (*prefill, *decode):
            self.registry.add(client.worker_id, client.descriptor.role, time.monotonic())
            self.activate(client)
        if not self.registry.live(Role.DECODE):
            raise ConfigError("a cluster needs at least one decode worker")

    # ---- the pools (views of the registry) -----------------------------------------------------
    @property
    def prefill(self) -> dict[str, WorkerClient]:
        return {r.worker_id: r.client for r in self.registry.ready(Role.PREFILL)}

    @property
    def decode(self) -> dict[str, WorkerClient]:
        return {r.worker_id: r.client for r in self.registry.ready(Role.DECODE)}

    @property
    def lost(self) -> dict[str, str]:
        """Workers removed after a fault -> why."""
        return {r.worker_id: r.reason for r in self.registry.records(states=(WorkerState.DEAD,)) if r.fault}

    def activate(self, client: WorkerClient, pid: int | None = None, node: str | None = None) -> None:
        """A started worker (already in the registry as ``starting``) joins its pool: routed to from now on."""
        check_fingerprints(self.hasher_of(client.descriptor.role), [client.descriptor])
        if client.descriptor.max_model_len < self.card.max_model_len:  # it would refuse requests the card allows
            raise ConfigError(f"worker {client.worker_id} holds {client.descriptor.max_model_len} tokens of context, "
                              f"the model is served with {self.card.max_model_len}: give it a larger KV cache")
        self.tracker.add_worker(client.worker_id)
        self.registry.mark_ready(client.worker_id, time.monotonic(), client=client, pid=pid, node=node)

    def _lora_targets(self) -> list[WorkerClient]:
        """Where a LoRA adapter is loaded or unloaded: every worker that runs or finishes requests."""
        return [r.client for r in self.registry.records(states=(WorkerState.READY, WorkerState.DRAINING))]

    def hasher_of(self, role: Role) -> BlockHasher:
        """How the workers of ``role``'s pool hash their blocks."""
        return self.prefill_hasher if role == Role.PREFILL else self.hasher

    def retire(self, worker_id: str, reason: str, *, fault: bool) -> bool:
        """A worker leaves for good (drained, or found dead): out of the registry's live set, the index and
        the load tracker. False if it had already left."""
        if self.registry.mark_dead(worker_id, reason, time.monotonic(), fault=fault) is None:
            return False
        self.index.remove_worker(worker_id)
        self.tracker.remove_worker(worker_id)
        return True

    def health(self) -> Health:
        return Health(ok=bool(self.decode), detail={
            "prefill_workers": sorted(self.prefill), "decode_workers": sorted(self.decode),
            "lost_workers": sorted(self.lost), **self.counters})

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self.check_request(prompt_token_ids, params)
        # the seed and LongRoPE's factor set are fixed here, so every worker and a migration see the same ones,
        # and the router hashes the blocks in the factor set's namespace as the workers do
        params = admit_rope_factors(with_seed(params), len(prompt_token_ids), self.card.longrope_original_len)
        sent = SentSoFar(list(prompt_token_ids))
        timing = self.metrics.request(len(sent.prompt_token_ids)) if self.metrics is not None else None
        self.demand.placed(len(prompt_token_ids), params.max_tokens)
        placements = migrations = 0
        ended = None  # the finish reason the client got
        await self.lora.admit(params.lora)  # an unload waits for the requests of its adapter admitted before it
        try:
            for attempt in itertools.count():
                n_prior = len(sent.token_ids)
                ids, attempt_params = (sent.continuation(params) if n_prior
                                       else (sent.prompt_token_ids, params))
                rid = request_id if attempt == 0 else f"{request_id}~{attempt}"  # fresh on every worker
                try:
                    stream = self._place(rid, ids, self.hasher(ids, attempt_params.hash_salt), attempt_params, timing,
                                         again=attempt > 0)
                except NoWorkersError as e:
                    if not sent.token_ids:
                        raise  # before any output: the front door answers 503 / UNAVAILABLE
                    yield self._timed(timing, None, self._error_output(request_id, None, e))
                    return
                lost = None
                async with contextlib.aclosing(stream):
                    async for out in stream:
                        if isinstance(out, _Lost):  # its worker died: place again, or continue elsewhere
                            lost = out
                            break
                        out = sent.as_original(out, n_prior)
                        sent.record(out)
                        ended = out.finish_reason if out.finished else None
                        yield out
                if lost is None:
                    return
                if not sent.token_ids:  # nothing reached the client: place the request again
                    placements += 1
                    self.counters["replaced"] += 1
                    if placements >= MAX_PLACEMENTS:
                        break
                    continue
                migrations += 1
                if migrations > MAX_MIGRATIONS:
                    break
                self.counters["migrated"] += 1
                if self.metrics is not None:
                    self.metrics.migrations.labels(lost.role).inc()
                log.warning("request %s: worker %s died after %d tokens were sent; continuing it elsewhere "
                            "(migration %d)", request_id, lost.worker_id, len(sent.token_ids), migrations)
            yield self._timed(timing, None, self._error_output(request_id, None, RuntimeError(
                f"workers kept failing ({placements} placements, {migrations} migrations)")))
        finally:
            self.lora.end(params.lora)
            if ended in ("stop", "length"):  # how long its output ran, of what it asked (the autoscaler's forecast)
                self.demand.finished(len(sent.token_ids), params.max_tokens)
            if timing is not None:
                timing.finish("abort")  # no-op when the request already finished

    def _place(self, rid: str, ids: list[int], hashes: list[int], params: SamplingParams,
               timing: RequestTiming | None, again: bool):
        B = self.hasher.block_size
        decode, prefill = self.decode, self.prefill
        if params.lora is not None:  # placement by slot budget: workers that can run the adapter now, if any
            decode, prefill = self._slot_ready(Role.DECODE, decode, params.lora), \
                self._slot_ready(Role.PREFILL, prefill, params.lora)
        try:
            d = route(self.decode_policy, self.index, self.tracker, Role.DECODE, list(decode), hashes, len(ids),
                      peers=())  # a decode worker's local prefill reads no peer's blocks
        except NoWorkersError:
            self._count_route(Role.DECODE, "no_workers")
            raise
        uncached_on_d = len(ids) - d.overlap_blocks * B
        total_blocks = -(-(len(ids) + params.max_tokens) // B)
        if not prefill and uncached_on_d > self.local_prefill_max_tokens:
            self.prefill_tokens_routed += uncached_on_d  # what a prefill pool would compute (the autoscaler's demand)
        if not prefill or uncached_on_d <= self.local_prefill_max_tokens:
            self.counters["local_prefill"] += 1
            self._count_route(Role.DECODE, "placed_again" if again else "local_prefill")
            return self._local(rid, ids, params, decode[d.worker], uncached_on_d, total_blocks, timing)
        self.counters["disaggregated"] += 1
        p_hashes = hashes if self.prefill_hasher is self.hasher else self.prefill_hasher(ids, params.hash_salt)
        p = route(self.prefill_policy, self.index, self.tracker, Role.PREFILL, list(prefill), p_hashes, len(ids),
                  peers=set(prefill))  # prefill workers lend each other blocks
        self._count_route(Role.PREFILL, "placed_again" if again else "disaggregated")
        self.prefill_tokens_routed += len(ids) - p.overlap_blocks * B
        borrow = None
        if p.peer is not None and p.peer in prefill:  # the cluster pool: read what the peer holds, not compute it
            borrow = (prefill[p.peer], p_hashes[:p.overlap_blocks + p.peer_blocks])
        return self._disaggregated(rid, ids, params, prefill[p.worker], decode[d.worker],
                                   len(ids) - p.overlap_blocks * B, total_blocks, timing, borrow, hashes)

    def _slot_ready(self, role: Role, pool: dict[str, WorkerClient], adapter: str) -> dict[str, WorkerClient]:
        """``pool`` narrowed to the workers whose LoRA slots can run ``adapter`` now (all when none can)."""
        if not pool:
            return pool
        ids, outcome = ready_workers({r.worker_id: r.stats for r in self.registry.ready(role) if r.worker_id in pool},
                                     adapter)
        self.counters[f"lora_{outcome}"] += 1
        if self.metrics is not None:
            self.metrics.lora_placements.labels(role.value, outcome).inc()
        return {w: pool[w] for w in ids}

    def _count_route(self, role: Role, outcome: str) -> None:
        if self.metrics is not None:
            policy = self.prefill_policy if role == Role.PREFILL else self.decode_policy
            self.metrics.routing.labels(role.value, policy.name, outcome).inc()

    @staticmethod
    def _timed(timing: RequestTiming | None, worker: WorkerClient | None, out: RequestOutput) -> RequestOutput:
        if timing is not None and not isinstance(out, _Lost):
            timing.observe(worker.worker_id if worker else "", worker.descriptor.role.value if worker else "", out)
        return out

    async def _local(self, rid, ids, params, d: WorkerClient, uncached: int, total_blocks: int,
                     timing: RequestTiming | None):
        self.tracker.dispatch(rid, d.worker_id, num_prefill_tokens=uncached, num_kv_blocks=total_blocks)
        self.inflight[d.worker_id] += 1
        try:
            first = True
            async for out in self._guard(d.generate(rid, ids, params), rid, d):
                if first and not isinstance(out, _Lost):
                    self.tracker.prefill_done(rid, d.worker_id)
                    first = False
                yield self._timed(timing, d, out)
        finally:
            self.tracker.finish(rid, d.worker_id)
            self.inflight[d.worker_id] -= 1

    async def _borrow(self, peer: WorkerClient, hashes: list[int], ids: list[int]) -> PeerBlocks | None:
        """Ask ``peer`` to lend the prefix blocks it holds; None (counted) when it holds none now or cannot
        answer in time — the prefill worker then computes them."""
        try:
            lent = await asyncio.wait_for(peer.export_blocks(list(hashes), ids, 0), PEER_EXPORT_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a dead or slow peer costs this request its shortcut only
            log.warning("peer %s could not lend %d blocks: %r", peer.worker_id, len(hashes), e)
            self.peer_fetches["failed"] += 1
            return None
        self.peer_fetches["lent" if lent is not None else "gone"] += 1
        return lent

    async def _disaggregated(self, rid, ids, params, p: WorkerClient, d: WorkerClient, uncached: int,
                             total_blocks: int, timing: RequestTiming | None, borrow=None, hashes=()):
        # D is committed to this request from now: its predicted load counts it (so requests arriving together
        # spread over the decode pool) and a drain must wait for it
        self.inflight[d.worker_id] += 1
        self.tracker.dispatch(rid, d.worker_id, num_prefill_tokens=0, num_kv_blocks=total_blocks)
        try:
            self.tracker.dispatch(rid, p.worker_id, num_prefill_tokens=uncached,
                                  num_kv_blocks=-(-len(ids) // self.hasher.block_size))
            self.inflight[p.worker_id] += 1
            try:
                lent = await self._borrow(*borrow, ids) if borrow is not None else None
                call = p.prefill(rid, ids, params) if lent is None else p.prefill(rid, ids, params, peer=lent)
                first = await self._call(call, rid, p)
            finally:
                self.tracker.finish(rid, p.worker_id)
                self.inflight[p.worker_id] -= 1
            if isinstance(first, _Lost):
                yield first
                return
            handoff = first.handoff
            if handoff is None:  # ended at its first token (or failed)
                yield self._timed(timing, p, first)
                return
            yield self._timed(timing, p, dataclasses.replace(first, finished=False, finish_reason=None, handoff=None))
            d = self._redirect(rid, d, hashes, len(ids), total_blocks)
            done = False
            try:
                async for out in self._guard(d.decode(handoff), rid, d):
                    if isinstance(out, _Lost):
                        yield out
                        return
                    done = out.finished
                    out.num_cached_tokens = first.num_cached_tokens  # each output is this stream's own object
                    yield self._timed(timing, d, out)
            finally:
                if not done:  # D refused it or the client left: make sure P's blocks do not wait for the lease
                    await _quietly(p.release(rid))
        finally:
            self.tracker.finish(rid, d.worker_id)
            self.inflight[d.worker_id] -= 1

    def _redirect(self, rid: str, d: WorkerClient, hashes, num_tokens: int, total_blocks: int) -> WorkerClient:
        """The decode worker chosen at arrival began draining (a scale-down, or a role flip) while the prompt was
        prefilled: nothing runs there yet, so the handoff goes to a ready decode worker instead (counted)."""
        decode = self.decode
        if d.worker_id in decode or not decode:
            return d
        new = decode[route(self.decode_policy, self.index, self.tracker, Role.DECODE, list(decode), list(hashes),
                           num_tokens, peers=()).worker]
        self.tracker.finish(rid, d.worker_id)
        self.inflight[d.worker_id] -= 1
        self.inflight[new.worker_id] += 1
        self.tracker.dispatch(rid, new.worker_id, num_prefill_tokens=0, num_kv_blocks=total_blocks)
        self.counters["decode_redirected"] += 1
        log.info("%s: decode worker %s is draining; the handoff goes to %s", rid, d.worker_id, new.worker_id)
        return new
