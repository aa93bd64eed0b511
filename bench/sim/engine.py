"""One simulated engine: duet's real ``Scheduler``, ``BlockPool``, ``BlockHasher`` and ``Request``, with the model
replaced by a step-time model (bench/sim/step_model.py). No torch.

It mirrors ``engine.engine.Engine`` for everything that decides *when* tokens appear — ``step`` (schedule →
[model] → ``on_step_computed`` → one token per finished sequence → stop on length, as with ``ignore_eos``),
the prefill role's handoff (``_hand_off``: the request leaves the batch, its blocks stay pinned until
``release_held``) and the decode role's ``reserve_remote`` / ``commit_remote`` / ``fail_remote`` — and
leaves out what does not (sampling, detokenizing, logprobs, stop strings). Sampled tokens are the fixed id
``SAMPLED_TOKEN``; outputs never become anyone's prefix in the trace, so their value does not matter.

A step is split in two as time passes in the simulator: ``begin_step(now_s)`` schedules it (blocks are
allocated, preemptions happen) and returns its shape; ``end_step(sched, now_s)`` is the state after the
forward pass, when the step's tokens exist.

With lower KV tiers (``tiers``: a ``bench.sim.tiers.TierSpec``) the engine runs the real ``TierManager`` on a
``SimMover`` and ``sync_tiers`` mirrors ``Engine.sync_tiers``: finished loads go back to the scheduler
(``finish_load``), newly cached blocks are written through to the host tier, pinned until the store lands.
The cluster calls ``sync_tiers`` at every pass of the engine loop and wakes an idle engine when its mover's
next job finishes (``next_wake_s``). ``start_after_peer_fetch`` is the modelled peer import
(bench/sim/tiers.py): the request enters the scheduler when the peer's blocks have landed on the host tier.
"""
from __future__ import annotations

from dataclasses import dataclass

from bench.sim.step_model import StepShape, step_shape
from bench.sim.tiers import SimMover, SimTierManager, TierSpec
from engine.engine_handoff import handoff_reserve
from engine.kv.block_pool import BlockPool
from engine.kv.events import KVEvent, WorkerLoad
from engine.kv.hashing import BlockHasher
from engine.request import Request, RequestStatus, SamplingParams
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler

SAMPLED_TOKEN = 1


@dataclass(frozen=True)
class Sampled:
    """One token a step produced for a request."""

    request_id: str
    num_output_tokens: int  # after this token
    finished: bool  # the request is done (length reached)
    handoff: bool  # prefill role: the request left the batch with its blocks pinned


@dataclass(frozen=True)
class RemotePlan:
    num_hit_blocks: int  # blocks this engine already had cached (not transferred)
    num_missing_blocks: int  # blocks to read from the prefill worker


class SimEngine:
    def __init__(self, worker_id: str, *, block_size: int, num_blocks: int, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_prefix_caching: bool = True, tiers: TierSpec | None = None,
                 bytes_per_block: float = 0.0, reserve_tokens: int = 256) -> None:
        self.worker_id = worker_id
        self.reserve_tokens = reserve_tokens  # EngineConfig.kv_handoff_reserve_tokens
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching, worker_id)
        self.hasher = BlockHasher(block_size)
        self.mover = SimMover(tiers, bytes_per_block) if tiers is not None else None
        self.tiers = SimTierManager(tiers, self.mover, self.pool.record, worker_id) if tiers is not None else None
        self.pool.track_new_cached = tiers is not None  # as engine.kv.mover.build_tiers sets it
        self.scheduler = Scheduler(self.pool, self.hasher, max_num_seqs, max_num_batched_tokens, True, self.tiers)
        self.importing: dict[int, tuple] = {}  # peer-import job id -> the request's add() arguments
        self._loaded_tokens: dict[str, int] = {}  # request -> prompt tokens loaded from a lower tier ...
        self._peer_tokens: dict[str, int] = {}  # ... of which fetched from a peer first
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # prefill role: handed off, blocks pinned until released
        self.remote_pending: dict[str, Request] = {}  # decode role: blocks reserved, KV in flight
        self.added_s: dict[str, float] = {}  # request -> when it entered the engine (for queue time)
        self.queue_times: list[tuple[float, float]] = []  # (t_s, queue_s) at each first scheduling
        self._computes_prompt: set[str] = set()  # entered without its KV: its prompt runs here
        self.prompt_tokens_computed = 0  # prompts admitted to be computed here (first admission only) ...
        self.prompt_tokens_hit = 0  # ... and their tokens found in the prefix cache (any tier, or a peer)
        self.prompt_tokens_hit_tiers = 0  # ... of those, loaded from this engine's host or disk tier
        self.prompt_tokens_hit_peer = 0  # ... or fetched from a peer (then loaded from the host tier)
        self.work = {"busy_s": 0.0, "prefill_tokens": 0, "decode_steps": 0, "decode_tokens": 0}  # as EngineStats

    def count_step(self, step_s: float, shape: StepShape) -> None:
        w = self.work
        w["busy_s"] += step_s
        w["prefill_tokens"] += shape.num_tokens - shape.num_decode_seqs
        if shape.num_decode_seqs:
            w["decode_steps"] += 1
            w["decode_tokens"] += shape.num_decode_seqs

    def held_blocks(self) -> int:
        return sum(len(r.blocks) for r in self.held.values())

    # ---- queries -------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.scheduler.num_unfinished)

    def is_idle(self) -> bool:
        """Holds nothing a drain must wait for: no request, no pinned handoff, no KV in flight."""
        return not (self.requests or self.held or self.remote_pending or self.importing
                    or (self.tiers is not None and self.tiers.num_jobs_in_flight))

    def load(self, role: str) -> WorkerLoad:
        s = self.scheduler
        return WorkerLoad(self.worker_id, role, len(s.running), len(s.waiting), self.pool.num_used_blocks,
                          self.pool.num_blocks, s.queued_prefill_tokens(),
                          tiers=self.tiers.usage() if self.tiers is not None else ())

    def next_wake_s(self) -> float | None:
        """When the mover's next job finishes (the engine loop must look at it then), if any is in flight."""
        return self.mover.next_completion_s() if self.mover is not None else None

    def held_prefix(self, hashes: list[int], prompt: tuple[int, ...], first: int, limit: int, *,
                    disk: bool = True) -> int:
        """Blocks ``first, first+1, … < limit`` of a prompt this engine holds now, contiguous, on its device or
        a lower tier (the disk tier only with ``disk``): what a peer fetch could read here."""
        B, n = self.block_size, 0
        for i in range(first, limit):
            tokens = tuple(prompt[i * B:(i + 1) * B])
            if self.pool.get_cached_block(hashes[i], tokens) is None and not (
                    self.tiers is not None and self.tiers.holds(hashes[i], tokens, disk=disk)):
                break
            n += 1
        return n

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    # ---- requests ------------------------------------------------------------------------------
    def add(self, request_id: str, prompt: list[int], max_tokens: int, now_s: float,
            remote_decode: bool = False) -> Request:
        if self.blocks_needed(len(prompt) + max_tokens) > self.pool.num_blocks:
            raise ValueError(f"{request_id} needs {self.blocks_needed(len(prompt) + max_tokens)} KV blocks; "
                             f"{self.worker_id} has {self.pool.num_blocks}")  # the engine refuses it up front
        request = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0)
        request.remote_decode = remote_decode
        self.requests[request_id] = request
        self.added_s[request_id] = now_s
        self._computes_prompt.add(request_id)
        self.scheduler.add(request)
        return request

    def start_after_peer_fetch(self, request_id: str, prompt: tuple[int, ...], max_tokens: int, now_s: float,
                               remote_decode: bool, hashes: list[int], peer: SimEngine) -> int:
        """The modelled peer import: the prompt's blocks this engine lacks on every tier and ``peer`` holds on
        its device or host tier are fetched into our host tier, then the request is added (and loads them
        like any host hit). Returns the blocks fetched (0: added at once)."""
        B = self.block_size
        if self.blocks_needed(len(prompt) + max_tokens) > self.pool.num_blocks:
            self.add(request_id, prompt, max_tokens, now_s, remote_decode)  # raises: refused up front
        limit = (len(prompt) - 1) // B  # the scheduler never takes the last prompt token's block from a cache
        own = self.held_prefix(hashes, prompt, 0, limit)
        n = peer.held_prefix(hashes, prompt, own, limit, disk=False)
        job = self.tiers.import_from_peer([(hashes[i], tuple(prompt[i * B:(i + 1) * B]))
                                           for i in range(own, own + n)]) if n else None
        if job is None:
            self.add(request_id, prompt, max_tokens, now_s, remote_decode)
            return 0
        self.importing[job.job_id] = (request_id, prompt, max_tokens, now_s, remote_decode)
        self._peer_tokens[request_id] = sum(1 for op in job.ops if op.kind == "fetch") * B
        return self._peer_tokens[request_id] // B

    # ---- lower tiers (engine.Engine.sync_tiers) --------------------------------------------------------
    def sync_tiers(self, now_s: float) -> None:
        """Apply the mover's finished jobs at ``now_s`` (loaded requests rejoin the queue, peer imports enter
        it) and write newly cached blocks through to the host tier."""
        if self.tiers is None:
            return
        self.mover.advance_to(now_s)
        for job in self.tiers.poll():
            self._loaded_tokens.setdefault(job.request_id, job.num_loaded * self.block_size)
            self.scheduler.finish_load(job.request_id, job.num_loaded)
        done, self.tiers.peer_done = self.tiers.peer_done, []
        for job in done:
            request_id, prompt, max_tokens, added_s, remote_decode = self.importing.pop(job.job_id)
            self.add(request_id, prompt, max_tokens, added_s, remote_decode)  # queue time counts from arrival
        new = self.pool.take_new_cached()
        if new:
            pinned = self.tiers.offload(new, lambda blocks: self.pool.free_blocks(reversed(blocks)))
            self.pool.touch(pinned)

    def drain_tiers(self) -> None:
        """Let every copy in flight land (the end of a run: nothing is left pinned)."""
        while self.mover is not None and (t := self.mover.next_completion_s()) is not None:
            self.sync_tiers(t)

    # ---- the step --------------------------------------------------------------------------------
    def begin_step(self, now_s: float) -> tuple[SchedulerOutput, StepShape]:
        sched = self.scheduler.schedule()
        for s in sched.scheduled:
            rid = s.request.request_id
            added = self.added_s.pop(rid, None)
            if added is not None:
                self.queue_times.append((now_s, now_s - added))
            if rid in self._computes_prompt:  # first admission: num_computed_tokens = its prefix hit
                self._computes_prompt.discard(rid)
                self.prompt_tokens_computed += s.request.num_prompt_tokens
                self.prompt_tokens_hit += s.request.num_computed_tokens
                loaded = self._loaded_tokens.pop(rid, 0)
                peer = min(self._peer_tokens.pop(rid, 0), loaded)
                self.prompt_tokens_hit_tiers += loaded - peer
                self.prompt_tokens_hit_peer += peer
        return sched, step_shape(sched)

    def end_step(self, sched: SchedulerOutput, now_s: float = 0.0) -> list[Sampled]:
        completed = [s.request for s in sched.scheduled if s.completes_sequence]  # before the counts advance
        self.scheduler.on_step_computed(sched)
        self.sync_tiers(now_s)  # as Engine.step: the new blocks are pinned for their store before any free
        out = []
        for request in completed:
            request.append_output_token(SAMPLED_TOKEN)
            self.scheduler.on_tokens_appended(request)
            n_out = len(request.output_token_ids)
            if n_out >= request.params.max_tokens:
                self.scheduler.remove(request, RequestStatus.FINISHED_LENGTH)
                del self.requests[request.request_id]
                out.append(Sampled(request.request_id, n_out, True, False))
            elif request.remote_decode:
                self.scheduler.detach(request, RequestStatus.FINISHED_REMOTE)
                del self.requests[request.request_id]
                self.held[request.request_id] = request
                out.append(Sampled(request.request_id, n_out, False, True))
            else:
                out.append(Sampled(request.request_id, n_out, False, False))
        return out

    # ---- disaggregation ------------------------------------------------------------------------------
    def release_held(self, request_id: str) -> bool:
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.free(request)
        return True

    def reserve_remote(self, request_id: str, prompt: tuple[int, ...], max_tokens: int,
                       prompt_hashes: list[int]) -> RemotePlan | None:
        """As ``Engine.reserve_remote``: reuse our own leading full-block hits, allocate the rest of the
        handoff's blocks; None when the pool cannot take it now. ``prompt_hashes`` are the prompt's block
        hashes (the router's: the same chain), so a handoff that does not fit costs no hashing."""
        n_prompt = len(prompt)
        if self.blocks_needed(n_prompt + max_tokens) > self.pool.num_blocks:
            raise ValueError(f"{request_id} needs {self.blocks_needed(n_prompt + max_tokens)} KV blocks; "
                             f"{self.worker_id} has {self.pool.num_blocks}")
        hits = self.pool.match_prefix(prompt_hashes[: n_prompt // self.block_size], prompt, self.block_size)
        need = self.blocks_needed(n_prompt) - len(hits)
        request = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0)
        request.append_output_token(SAMPLED_TOKEN)  # the first token, sampled by the prefill worker
        reserve = handoff_reserve(self.scheduler.running, request, self.blocks_needed(n_prompt), self.block_size,
                                  self.reserve_tokens)  # as Engine.reserve_remote
        if not self.pool.can_allocate(need + sum(1 for b in hits if b.ref_count == 0) + reserve):
            return None
        request.block_hashes = list(prompt_hashes)
        self.hasher.extend(request.block_hashes, request.all_token_ids)
        self.pool.touch(hits)
        request.blocks = hits + self.pool.allocate(need)
        request.num_registered_blocks = len(hits)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request_id] = request
        self.remote_pending[request_id] = request
        return RemotePlan(len(hits), need)

    def commit_remote(self, request_id: str, now_s: float) -> None:
        request = self.remote_pending.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        self.scheduler.register_full_blocks(request)
        self.scheduler.waiting.append(request)
        request.status = RequestStatus.WAITING
        self.added_s[request_id] = now_s

    def fail_remote(self, request_id: str, now_s: float) -> None:
        """The transfer failed (its lease expired): recompute the prompt here, as ``recompute_on_failure``."""
        request = self.remote_pending.pop(request_id)
        self.scheduler.free(request)
        request.status = RequestStatus.WAITING
        self.scheduler.waiting.append(request)
        self.added_s[request_id] = now_s
        self._computes_prompt.add(request_id)
