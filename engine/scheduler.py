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
3. If nothing runs and nothing waiting fits, the blocks are held by waiting requests with received KV:
   the newest of them gives its blocks back and will recompute (else the engine would wait forever).

Bookkeeping only (no torch): the engine runs the model on the ``SchedulerOutput`` and then calls
``on_step_computed``; sampling and stop checks are the engine's.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_pool import BlockPool
from engine.hashing import BlockHasher
from engine.histogram import LATENCY_BUCKETS_S, Histogram
from engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def completes_sequence(self) -> bool:
        """After this step every token of the request is computed, so its next token can be sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        hasher: BlockHasher,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.pool = pool
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0
        self.num_prefix_queried_tokens = 0  # tokens looked up in the prefix cache (vLLM's prefix_cache_queries)
        self.queue_time = Histogram(LATENCY_BUCKETS_S)  # arrival → first scheduled, seconds (not after preemption)

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def queued_prefill_tokens(self) -> int:
        """Tokens still to be prefilled: waiting requests whole, running ones' unfinished prompts."""
        total = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        return total + sum(max(0, r.num_tokens - r.num_computed_tokens - 1) for r in self.running)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- mutation -------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.hasher.extend(request.block_hashes, request.all_token_ids, request.params.hash_salt)
        self.waiting.append(request)

    def remove(self, request: Request, status: RequestStatus) -> None:
        """Finish a request in any state: free its blocks and forget it."""
        self.detach(request, status)
        self._free(request)

    def detach(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues but leave its blocks held (a prefill handoff)."""
        if request in self.running:
            self.running.remove(request)
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
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            i += 1

        blocked = False  # an earlier request that must compute its prompt did not fit: FCFS among those
        for request in list(self.waiting):
            if budget <= 0 or out.preempted or len(self.running) >= self.max_num_seqs:
                break
            if request.blocks:  # KV already in place (received from a prefill worker)
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                need = self.blocks_needed(request.num_computed_tokens + num_new) - len(request.blocks)
                if need > 0 and not self.pool.can_allocate(need):
                    continue  # others holding their KV may still fit; never wait behind them
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
        if not self.running and not out.scheduled and self.waiting:
            self._break_deadlock(out)
        return out

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
            self.queue_time.observe(time.monotonic() - request.arrival_time)

    def on_step_computed(self, out: SchedulerOutput) -> None:
        """The model has run ``out``: advance computed counts and offer newly full blocks to the cache."""
        for s in out.scheduled:
            request = s.request
            request.num_computed_tokens += s.num_new_tokens
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
        self._free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _free(self, request: Request) -> None:
        if request.blocks:
            self.pool.free_blocks(reversed(request.blocks))
        request.blocks = []
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
