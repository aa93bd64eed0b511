"""Scheduler: continuous batching with chunked prefill under a token budget, preemption by recompute.

One step's budget is ``max_num_batched_tokens`` tokens across at most ``max_num_seqs`` running requests.

1. Running requests, oldest first, each get ``num_tokens - num_computed_tokens`` tokens (1 while decoding,
   the rest of a prompt while prefilling), cut to the remaining budget (a chunk). If the pool cannot hold
   a request's new tokens, the newest running request is preempted (blocks freed, recomputed later) until
   it can — possibly the request itself.
2. Waiting requests, oldest (and previously preempted) first, are admitted while budget, sequence slots
   and blocks last — unless this step preempted, since then memory is short. On admission, leading full
   blocks already in the prefix cache are reused; at least one token is always computed (the last prompt
   token's logits are needed), so a fully cached prompt recomputes its final token. Requests that must
   compute their prompt are admitted first-come first-served; requests whose KV is already in place
   (received from a prefill worker) never wait behind one of those that does not fit.
   With lower KV tiers (engine/kv/tiers.py), a prefix that continues past the device hits on the host or
   disk tier — or on the peer worker the router lent it from (``Request.peer_blocks``) — is loaded back: the request
   gets device blocks for it, leaves the queue while the mover copies (``loading``; no budget spent) and returns to the
   front with its KV in place. A request whose prefix reaches a block another request is loading waits for that load
   without holding up anyone behind it.
3. If nothing runs and nothing waiting fits, the blocks are held by waiting requests with received KV:
   the newest of them gives its blocks back and will recompute (else the engine would wait forever).
LoRA adapters (``lora``, a ``LoraGate``): a request of an adapter enters the running batch only holding its adapter's
device slot, and gives it back when it leaves the batch (finished, preempted, handed off), so a batch mixes at most
``max_loras`` adapters. One whose adapter gets no slot (all held by other adapters' running requests) stays waiting
without blocking the requests behind it (vLLM's rule); nothing running means no slot is held, so it never waits alone.
Passed over by a batch's worth of other adapters' requests, it reserves the next slot that goes idle, so a stream of
requests on the adapters holding the slots cannot keep it waiting for good (engine/sched/lora_pass.py).

Bookkeeping only (no torch): the engine runs the model on the ``SchedulerOutput`` and then calls
``on_step_computed``; sampling and stop checks are the engine's.
"""
from __future__ import annotations

import time
from collections import deque

from engine.histogram import LATENCY_BUCKETS_S, Histogram
from engine.kv.block_pool import BlockPool
from engine.kv.handoff import PeerBlocks
from engine.kv.hashing import BlockHasher
from engine.kv.tiers import TierManager
from engine.request import Request, RequestStatus
from engine.sched.lora_pass import LoraPass
from engine.sched.output import LoraGate, PeerImporter, ScheduledRequest, SchedulerOutput


def _peer_extent(request: Request, peer: PeerBlocks, start: int, limit: int) -> int:
    """How far (block index, exclusive) the peer's blocks continue the request's prefix from ``start``."""
    if peer.first_block > start:
        return start  # a gap between our hits and the peer's blocks
    end = start
    for i in range(start, min(peer.first_block + len(peer.block_hashes), limit)):
        if request.block_hashes[i] != peer.block_hashes[i - peer.first_block]:
            break
        end = i + 1
    return end


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        hasher: BlockHasher,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        tiers: TierManager | None = None,
        lora: LoraGate | None = None,
    ) -> None:
        self.pool = pool
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.tiers = tiers
        self.lora = lora
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # prefix blocks in flight from a lower tier
        self.num_preemptions = 0
        self.num_lora_reserves = 0  # requests passed over for an adapter slot until they reserved one
        self.num_prefix_hit_tokens = 0
        self.num_prefix_queried_tokens = 0  # tokens looked up in the prefix cache (vLLM's prefix_cache_queries)
        self.num_tier_hit_tokens = 0  # prompt tokens whose KV was loaded back from a lower tier
        self.num_peer_hit_tokens = 0  # prompt tokens whose KV was read from a peer worker
        self.importer: PeerImporter | None = None  # the worker's puller of peer blocks (prefill_worker)
        self.queue_time = Histogram(LATENCY_BUCKETS_S)  # arrival → first scheduled, seconds (not after preemption)

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    def queued_prefill_tokens(self) -> int:
        """Tokens still to be prefilled: waiting requests whole, running ones' unfinished prompts."""
        total = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        total += sum(r.num_tokens - r.num_computed_tokens for r in self.loading.values())
        return total + sum(max(0, r.num_tokens - r.num_computed_tokens - 1) for r in self.running)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- mutation -------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.hasher.extend(request.block_hashes, request.all_token_ids, request.params.hash_salt)
        self.waiting.append(request)

    def remove(self, request: Request, status: RequestStatus) -> None:
        """Finish a request in any state: free its blocks and forget it."""
        self.drop_peer(request)
        self.detach(request, status)
        self._free(request)

    def detach(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues but leave its blocks held (a prefill handoff)."""
        if request in self.running:
            self.running.remove(request)
            self._release_lora(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status

    def free(self, request: Request) -> None:
        self._free(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # cannot happen for a running request; guard against a stuck loop
                i += 1
                continue
            if not self._grow(request, num_new, out):
                continue  # request itself was preempted; running[i] is now the next one
            drafts = self._fit_drafts(request, budget - num_new) if num_new == 1 else ()
            out.scheduled.append(ScheduledRequest(request, num_new + len(drafts), drafts))
            budget -= num_new + len(drafts)
            i += 1

        blocked = False  # an earlier request that must compute its prompt did not fit: FCFS among those
        slots = LoraPass(self.lora, self.max_num_seqs)
        for request in list(self.waiting):
            if budget <= 0 or out.preempted or len(self.running) >= self.max_num_seqs:
                break
            if request.blocks:  # KV already in place (received from a prefill worker)
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                need = self.blocks_needed(request.num_computed_tokens + num_new) - len(request.blocks)
                if need > 0 and not self.pool.can_allocate(need):
                    continue  # others holding their KV may still fit; never wait behind them
                if not slots.acquire(request):
                    continue
                self.waiting.remove(request)
                if need > 0:
                    request.blocks.extend(self.pool.allocate(need))
                self._observe_queue_time(request)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                continue
            if blocked:
                continue
            if request.needs_prompt_logprobs:
                hits = []  # every prompt position's logits are needed; a cached block has none
            else:
                hits = self.pool.match_prefix(request.block_hashes, request.all_token_ids, self.block_size)
                hits = hits[: (request.num_tokens - 1) // self.block_size]
            if (self.tiers is not None or request.peer_blocks is not None) and not request.needs_prompt_logprobs:
                load = self._load_prefix(request, hits)
                if load is not None:
                    if load == "blocked":
                        blocked = True
                    continue  # loading, or waiting for another request's load: no budget spent
            num_cached = len(hits) * self.block_size
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    blocked = True
                    continue
                num_new = budget
            num_new_blocks = self.blocks_needed(num_cached + num_new) - len(hits)
            num_revived = sum(1 for b in hits if b.ref_count == 0)
            if not self.pool.can_allocate(num_new_blocks + num_revived):
                blocked = True
                continue
            if not slots.acquire(request):
                continue  # its adapter has no slot now; later requests may run (their adapters have slots)
            self.waiting.remove(request)
            self.pool.touch(hits)
            request.blocks = hits + self.pool.allocate(num_new_blocks)
            request.num_registered_blocks = len(hits)
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = num_cached
            self.num_prefix_hit_tokens += num_cached
            self.num_prefix_queried_tokens += request.num_tokens
            self._observe_queue_time(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        self.num_lora_reserves += slots.reserves
        if not self.running and not out.scheduled and self.waiting:
            self._break_deadlock(out)
        return out

    def _load_prefix(self, request: Request, hits: list) -> str | None:
        """If the request's prefix continues past its device hits on a lower tier, or at the peer the router
        lent it (``request.peer_blocks``), start bringing those blocks in (→ "loading"), or wait for a load
        of them already in flight (→ "waiting"); "blocked": the device blocks for them are not free; None:
        nothing to bring, admit as usual. The source covering more blocks wins; a peer's lease that is not
        used is released at once."""
        B = self.block_size
        start, limit = len(hits), (request.num_tokens - 1) // B
        tier_hits = []
        if self.tiers is not None:
            tier_hits, waits = self.tiers.match(
                request.block_hashes, lambda i: tuple(request.all_token_ids[i * B:(i + 1) * B]), start, limit)
            if waits:
                self.tiers.stats.waits_on_load += 1
                return "waiting"
        peer = request.peer_blocks
        peer_end = _peer_extent(request, peer, start, limit) if peer is not None else start
        use_peer = peer_end > start + len(tier_hits)
        n = peer_end - start if use_peer else len(tier_hits)
        if n == 0:
            self.drop_peer(request)
            return None
        num_revived = sum(1 for b in hits if b.ref_count == 0)
        if not self.pool.can_allocate(n + num_revived):
            return "blocked"
        self.waiting.remove(request)
        self.pool.touch(hits)
        targets = self.pool.allocate(n)
        request.blocks = hits + targets
        request.num_registered_blocks = start
        request.num_computed_tokens = start * B
        self.num_prefix_hit_tokens += start * B
        self.num_prefix_queried_tokens += request.num_tokens
        request.status = RequestStatus.WAITING_FOR_TIER_LOAD
        self.loading[request.request_id] = request
        local_ids = [b.block_id for b in targets]
        if use_peer:
            request.peer_blocks = None
            first = start - peer.first_block
            self.importer.start(request.request_id, peer, peer.remote_block_ids[first:first + n], local_ids)
        else:
            self.drop_peer(request)
            self.tiers.start_load(request.request_id, tier_hits, local_ids)
        return "loading"

    def drop_peer(self, request: Request) -> None:
        """Give back the peer blocks lent to ``request`` unused (its lease ends now, not at its timeout)."""
        if request.peer_blocks is not None and self.importer is not None:
            self.importer.release(request.peer_blocks)
        request.peer_blocks = None

    def finish_load(self, request_id: str, num_loaded: int, from_peer: bool = False) -> None:
        """A load (lower tier) or import (peer) ended with its first ``num_loaded`` blocks in place; the rest
        (a failure) are recomputed into the blocks already allocated. The request returns to the queue's front."""
        request = self.loading.pop(request_id)
        if request.abort_pending:
            self._free(request)
            return
        request.num_computed_tokens += num_loaded * self.block_size
        if from_peer:
            self.num_peer_hit_tokens += num_loaded * self.block_size
        else:
            self.num_tier_hit_tokens += num_loaded * self.block_size
        if request.num_preemptions == 0:
            request.num_cached_prompt_tokens = request.num_computed_tokens
        self.register_full_blocks(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _break_deadlock(self, out: SchedulerOutput) -> None:
        """Nothing runs and nothing waiting fits: the blocks are all held by waiting requests whose KV
        arrived from a prefill worker (each waiting for one more block, or behind a request that needs many).
        Free the newest such request's blocks; it recomputes its tokens later (its full blocks stay in the
        prefix cache, so the recompute is mostly cache hits). Counted as a preemption."""
        victim = next((r for r in reversed(self.waiting) if r.blocks), None)
        if victim is None:
            return
        self._free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)

    def _observe_queue_time(self, request: Request) -> None:
        if request.num_preemptions == 0:
            request.first_scheduled_time = time.monotonic()
            self.queue_time.observe(request.first_scheduled_time - request.arrival_time)

    def on_step_computed(self, out: SchedulerOutput) -> None:
        """The model has run ``out``: advance computed counts and offer newly full blocks to the cache. Drafts
        do not count until accepted (``on_drafts_accepted``)."""
        for s in out.scheduled:
            request = s.request
            request.num_computed_tokens += s.num_new_tokens - s.num_draft_tokens
            self.register_full_blocks(request)

    def on_drafts_accepted(self, request: Request, num_accepted: int) -> None:
        """The first ``num_accepted`` drafts a step verified were appended to the request (its hashes extended):
        their KV, written by that step, is the request's; full blocks are offered to the cache. The rejected
        drafts' KV lies past ``num_computed_tokens`` in blocks never registered, and is overwritten."""
        request.num_computed_tokens += num_accepted
        self.register_full_blocks(request)

    def register_full_blocks(self, request: Request) -> None:
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        first = request.num_registered_blocks
        if num_full <= first:
            return
        parent = request.block_hashes[first - 1] if first else None
        self.pool.cache_full_blocks(
            request.blocks[first:num_full], request.block_hashes[first:num_full],
            request.all_token_ids, self.block_size, first, parent,
        )
        request.num_registered_blocks = num_full

    def on_tokens_appended(self, request: Request) -> None:
        self.hasher.extend(request.block_hashes, request.all_token_ids, request.params.hash_salt)

    # ---- internals -------------------------------------------------------------------------------
    def _fit_drafts(self, request: Request, budget: int) -> tuple[int, ...]:
        """The request's drafts (``spec_token_ids``) that fit the step's token budget left and the blocks free
        without preempting anyone: drafts are cut, never paid for by another request's KV."""
        drafts = request.spec_token_ids
        held = len(request.blocks) * self.block_size - request.num_computed_tokens - 1  # room past the new token
        n = min(len(drafts), budget, held + self.pool.num_free_blocks * self.block_size)
        if n <= 0:
            return ()
        need = self.blocks_needed(request.num_computed_tokens + 1 + n) - len(request.blocks)
        if need > 0:
            request.blocks.extend(self.pool.allocate(need))
        return tuple(drafts[:n])

    def _grow(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Ensure blocks for ``num_new`` more tokens, preempting the newest requests if needed.
        Returns False if ``request`` itself had to be preempted."""
        need = self.blocks_needed(request.num_computed_tokens + num_new) - len(request.blocks)
        while need > 0 and not self.pool.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return False
        if need > 0:
            request.blocks.extend(self.pool.allocate(need))
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self._release_lora(request)
        self._free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _release_lora(self, request: Request) -> None:
        if request.params.lora is not None and self.lora is not None:
            self.lora.release(request.params.lora)

    def _free(self, request: Request) -> None:
        if request.blocks:
            self.pool.free_blocks(reversed(request.blocks))
        request.blocks = []
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
