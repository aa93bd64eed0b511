"""The engine's disaggregation verbs (engine/kv/handoff.py is the design note): the prefill role hands a request's
KV off and keeps it pinned; the decode role reserves blocks for a handoff, then commits or fails it. A mixin of
``Engine`` (split from engine/engine.py by responsibility): it uses the engine's scheduler, pool and requests."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.kv.handoff import KVHandoff, RemoteKVPlan
from engine.request import Request, RequestStatus
from engine.text.stopping import held_chars

if TYPE_CHECKING:  # the host, for a type checker only
    from engine.engine import Engine


def growth_blocks(request: Request, block_size: int, reserve_tokens: int, num_blocks: int | None = None) -> int:
    """Blocks ``request`` may still take to grow by ``reserve_tokens`` (or to its max_tokens, if sooner), holding
    ``num_blocks`` (default: the blocks it holds)."""
    end = min(request.num_prompt_tokens + request.params.max_tokens, request.num_tokens + reserve_tokens)
    held = len(request.blocks) if num_blocks is None else num_blocks
    return max(0, -(-end // block_size) - held)


def handoff_reserve(running, request: Request, num_blocks: int, block_size: int, reserve_tokens: int) -> int:
    """Blocks a decode worker keeps free when it admits ``request`` (which will hold ``num_blocks``): room for
    it and every running sequence to grow by ``reserve_tokens``. 0 when nothing runs (admitted whenever its
    prompt fits: never a deadlock) or with no reserve."""
    if not running or reserve_tokens <= 0:
        return 0
    return (sum(growth_blocks(r, block_size, reserve_tokens) for r in running)
            + growth_blocks(request, block_size, reserve_tokens, num_blocks))


class RemoteKVMixin:
    # ---- disaggregation: prefill role ------------------------------------------------------------
    def _hand_off(self: Engine, request: Request) -> KVHandoff:
        """First token sampled: leave the batch, keep the prompt's blocks pinned for the decode worker."""
        self.scheduler.detach(request, RequestStatus.FINISHED_REMOTE)
        del self.requests[request.request_id]
        self.held[request.request_id] = request
        self.stats.num_handoffs += 1
        n = request.num_prompt_tokens
        return KVHandoff(
            request_id=request.request_id, prompt_token_ids=tuple(request.prompt_token_ids),
            first_token_id=request.output_token_ids[0],
            first_logprob=request.output_logprobs[0] if request.output_logprobs else None,
            first_top_logprobs=request.output_top_logprobs[0] if request.output_top_logprobs else None,
            params=request.params, seed=request.seed, block_ids=tuple(request.block_ids),
            block_hashes=tuple(request.block_hashes[: n // self.config.block_size]), num_tokens=n,
            block_size=self.config.block_size)

    def release_held(self: Engine, request_id: str) -> bool:
        """The decode side has the KV (or the lease expired): unpin the blocks. Idempotent."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.free(request)
        return True

    # ---- disaggregation: decode role --------------------------------------------------------------
    def reserve_remote(self: Engine, handoff: KVHandoff) -> RemoteKVPlan | None:
        """Admit a handed-off request: reuse our own prefix hits, allocate the rest. None if the pool is
        too full right now (the caller retries later); ``InvalidRequestError`` if it can never fit."""
        if handoff.block_size != self.config.block_size:
            raise InvalidRequestError(f"handoff block size {handoff.block_size} != ours {self.config.block_size}")
        request = self.make_request(handoff.request_id, prompt_token_ids=list(handoff.prompt_token_ids),
                                    params=handoff.params)
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        request.seed = handoff.seed
        request.append_output_token(handoff.first_token_id)
        if request.grammar is not None:
            request.grammar.accept(handoff.first_token_id)
        if handoff.first_logprob is not None:
            request.output_logprobs.append(handoff.first_logprob)
            request.output_top_logprobs.append(handoff.first_top_logprobs or {})
        self.hasher.extend(request.block_hashes, request.all_token_ids, request.params.hash_salt)
        B = self.config.block_size
        n_prompt = request.num_prompt_tokens
        hits = self.pool.match_prefix(request.block_hashes, request.all_token_ids, B)[: n_prompt // B]
        need = len(handoff.block_ids) - len(hits)
        reserve = handoff_reserve(self.scheduler.running, request, len(handoff.block_ids), B,
                                  self.config.kv_handoff_reserve_tokens)
        if not self.pool.can_allocate(need + sum(1 for b in hits if b.ref_count == 0) + reserve):
            return None
        self.pool.touch(hits)
        request.blocks = hits + self.pool.allocate(need)
        request.num_registered_blocks = len(hits)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._start_text(request)
        request.text += request.detokenizer.add(handoff.first_token_id)
        request.num_stop_held_chars = held_chars(request.text, request.params.stop)  # the prefill side emitted the rest
        self.requests[request.request_id] = request
        self.remote_pending[request.request_id] = request
        self.stats.num_prompt_tokens += n_prompt
        self.stats.num_remote_prefix_hit_blocks += len(hits)
        return RemoteKVPlan(request.request_id, tuple(handoff.block_ids[len(hits):]),
                            tuple(b.block_id for b in request.blocks[len(hits):]), len(hits))

    def commit_remote(self: Engine, request_id: str) -> bool:
        """The planned blocks have landed: the prompt counts as computed; the request joins the batch."""
        request = self.remote_pending.pop(request_id)
        if request.abort_pending:
            self.scheduler.free(request)
            return False
        self.stats.num_remote_kv_received += 1
        self.stats.num_remote_blocks_received += len(request.blocks) - request.num_registered_blocks
        request.num_computed_tokens = request.num_prompt_tokens
        self.scheduler.register_full_blocks(request)
        self.scheduler.waiting.append(request)
        request.status = RequestStatus.WAITING
        return True

    def fail_remote(self: Engine, request_id: str, error: str, recompute: bool) -> None:
        """The transfer failed: recompute the prompt here (counted) or end the request with ``error``."""
        request = self.remote_pending.pop(request_id)
        self.scheduler.free(request)
        if request.abort_pending:
            return
        if recompute:
            self.stats.num_remote_recomputes += 1
            request.status = RequestStatus.WAITING
            self.scheduler.waiting.append(request)
            return
        self.stats.num_remote_failures += 1
        del self.requests[request_id]
        request.error = error
        request.status = RequestStatus.FINISHED_ERROR
        self._pending.append(self._output(request, [], "", 0))
