"""The engine: one process, one model, one paged KV cache. ``step()`` = schedule → run → sample → update.

    engine = Engine(EngineConfig(model="path/to/checkpoint"))
    engine.add_request("r1", prompt="Hello", params=SamplingParams(max_tokens=32, temperature=0))
    while engine.has_unfinished_requests():
        for out in engine.step(): print(out.new_text, end="")

Everything a caller can get wrong is checked in ``make_request`` (a query: it touches no engine state)
and raised as ``InvalidRequestError``; the engine goes on serving the other requests.
"""
from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass, replace

from engine.config import EngineConfig
from engine.engine_emit import EmitMixin
from engine.engine_handoff import RemoteKVMixin
from engine.errors import ConfigError, InvalidRequestError
from engine.kv.block_pool import BlockPool
from engine.kv.events import KVEvent, WorkerLoad
from engine.kv.handoff import PeerBlocks
from engine.kv.hashing import BlockHasher, kv_namespace
from engine.kv.mover import build_tiers
from engine.loading.checkpoint import load_model_config, load_tokenizer
from engine.model_runner import ModelRunner
from engine.models.tensor_parallel import TensorParallel
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus, SamplingParams, admit_rope_factors, check_prompt
from engine.sched.scheduler import Scheduler
from engine.speculative.decoder import SpecDecoder
from engine.speculative.draft import DraftModel
from engine.text.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0  # of admitted requests
    num_computed_tokens: int = 0  # tokens the model actually ran (prefill chunks + decode tokens)
    num_generated_tokens: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_handoffs: int = 0  # prefill role: requests whose KV was handed to a decode worker
    num_remote_kv_received: int = 0  # decode role: requests whose prompt KV arrived from a prefill worker
    num_remote_blocks_received: int = 0
    num_remote_prefix_hit_blocks: int = 0  # decode role: blocks not transferred because we had them
    num_remote_recomputes: int = 0  # decode role: failed transfers recomputed locally
    num_remote_failures: int = 0  # decode role: failed transfers ended with an error
    num_peer_import_failures: int = 0  # prefix blocks lent by a peer that could not be read: recomputed
    # slower paths taken because a faster one failed: the torch reference kernels instead of the C ones (the C
    # library would not build), eager decode instead of a CUDA graph (a capture failed); the log says which
    kernel_fallbacks: int = 0
    # what the steps did, for the autoscaler's capacity estimates (cluster/autoscale_estimate.py)
    busy_s: float = 0.0  # seconds spent in steps that ran the model
    num_prefill_tokens_computed: int = 0  # prompt tokens the steps ran (chunks of more than one token)
    num_decode_steps: int = 0  # steps with decode rows (one new token) ...
    num_decode_tokens: int = 0  # ... and those rows


class Engine(EmitMixin, RemoteKVMixin):
    def __init__(self, config: EngineConfig, *, tokenizer: Tokenizer | None = None,
                 tp: TensorParallel | None = None, tier_mirror=None) -> None:
        """``tp``: rank 0 of a tensor-parallel engine (engine/models/tensor_parallel.py); the other ranks follow this
        engine's steps until ``close``. ``tier_mirror(job) -> Completion``: they run each KV-tier job on their own tiers
        (engine/kv/mover.py; without it a tensor-parallel engine has no tiers)."""
        self.config = config
        self.model_config = load_model_config(config.model)
        mpe = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or mpe, mpe)
        self.tokenizer = tokenizer or load_tokenizer(config.model)
        spec = config.speculative_config
        draft = DraftModel.load(config, self.model_config, self.max_model_len, self.tokenizer) \
            if spec is not None and spec.needs_draft_model else None  # its weights in memory before the cache is sized
        self.runner = ModelRunner(self.model_config, config, self.max_model_len, tp,
                                  extra_bytes_per_block=draft.bytes_per_block if draft else 0)
        self.max_model_len = self.runner.max_model_len  # capped to what the KV cache holds (engine/kv/sizing.py)
        self.pool = BlockPool(self.runner.num_blocks, config.enable_prefix_caching, config.worker_id)
        self.hasher = BlockHasher(config.block_size, config.hash_seed,
                                  kv_namespace(config.hash_namespace, config.kv_cache_dtype))
        if tp is not None and tp.enabled and config.kv_host_bytes and tier_mirror is None:
            raise ConfigError("a tensor-parallel engine's KV tiers need its other ranks' (a worker's tier_mirror)")
        self.tiers = build_tiers(config, self.runner.kv_cache, self.runner.bytes_per_block, self.pool, tier_mirror)
        self.scheduler = Scheduler(self.pool, self.hasher, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, self.tiers, lora=self.runner.lora)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.stats.kernel_fallbacks = len(self.runner.fallbacks)
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._grammars = None  # engine.sampling.structured.GrammarBackend, built on the first structured request
        self._grammar_lock = threading.Lock()  # make_request may run on any thread
        self.spec = SpecDecoder(spec, draft and draft.allocate(self.runner.num_blocks)) if spec is not None else None
        self._decode_only_tokens = 0  # this step's tokens, when it ran only decoding sequences (and drafts)
        self.held: dict[str, Request] = {}  # prefill role: handed-off requests whose blocks stay pinned
        self.remote_pending: dict[str, Request] = {}  # decode role: blocks reserved, KV in flight

    # ---- requests ------------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str | None = None,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
    ) -> Request:
        """Validate and build a request without touching engine state (safe from any thread)."""
        params = params or SamplingParams()
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompt or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt must be a string")
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = check_prompt(prompt_token_ids, params, vocab_size=self.model_config.vocab_size,
                           max_model_len=self.max_model_len)
        params = admit_rope_factors(params, len(ids), self.model_config.longrope_original_len)  # kept if chosen
        lora = self.runner.lora
        if params.lora is not None and (lora is None or params.lora not in lora.adapters):
            known = lora.names() if lora is not None else []
            raise InvalidRequestError(f"unknown LoRA adapter {params.lora!r} (this engine serves {known or 'none'})")
        total = len(ids) + params.max_tokens
        if self.scheduler.blocks_needed(total) > self.pool.num_blocks:
            raise InvalidRequestError(
                f"the request needs {self.scheduler.blocks_needed(total)} KV blocks; this engine has "
                f"{self.pool.num_blocks}")
        request_id = request_id or f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        eos = frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
        request = Request(request_id, ids, params, seed=seed, eos_token_ids=eos)
        if params.structured is not None:
            request.grammar = self._grammar_matcher(request)
        return request

    def _grammar_matcher(self, request: Request):
        """The request's grammar matcher, advanced over what it generated before a migration."""
        with self._grammar_lock:
            if self._grammars is None:
                from engine.sampling.structured import GrammarBackend  # the grammar library loads on first use
                self._grammars = GrammarBackend(self.tokenizer, self.model_config.vocab_size,
                                                self.tokenizer.eos_token_ids)
            grammars = self._grammars
        resume = request.params.resume
        generated = request.prompt_token_ids[-resume.num_output_tokens:] if resume else ()
        try:
            return grammars.matcher(request.params.structured, generated)
        except RuntimeError as e:
            raise InvalidRequestError(f"resume: the generated tokens do not follow the grammar: {e}") from None

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self._start_text(request)
        self.requests[request.request_id] = request
        self.stats.num_prompt_tokens += request.num_prompt_tokens
        self.scheduler.add(request)

    def _start_text(self, request: Request) -> None:
        """The request's detokenizer; for a resumed request, replayed through the tokens generated before the
        move, so its text, what is still held back and the next text it emits are exactly the original's."""
        resume = request.params.resume
        if resume is None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                         skip_special_tokens=request.params.skip_special_tokens)
            return
        n = resume.num_output_tokens
        if n >= request.num_prompt_tokens:
            raise InvalidRequestError(f"resume: {n} generated tokens leave no original prompt")
        request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids[:-n],
                                                     skip_special_tokens=request.params.skip_special_tokens)
        request.text = "".join(request.detokenizer.add(t) for t in request.prompt_token_ids[-n:])
        if resume.num_emitted_chars > len(request.text):
            raise InvalidRequestError(f"resume: {resume.num_emitted_chars} characters emitted, but the generated "
                                      f"tokens make only {len(request.text)}")
        request.num_stop_held_chars = len(request.text) - resume.num_emitted_chars
        request.num_prior_output_tokens = n

    def add_request(self, request_id=None, prompt=None, prompt_token_ids=None, params=None,
                    remote_decode: bool = False, peer: PeerBlocks | None = None) -> Request:
        request = self.make_request(request_id, prompt, prompt_token_ids, params)
        request.remote_decode = remote_decode
        request.peer_blocks = peer
        self.add(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request_id in self.remote_pending or request_id in self.scheduler.loading:
            # its KV may still be landing in its blocks: they are freed when the transfer / load ends
            request.abort_pending = True
            request.status = RequestStatus.FINISHED_ABORTED
        else:
            self.scheduler.remove(request, RequestStatus.FINISHED_ABORTED)
        self.stats.num_aborted += 1
        if self.spec is not None:
            self.spec.finish(request, finished=False)
        self._pending.append(self._output(request, [], "", 0))
        return True

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every unfinished request with an error (after an unexpected fault), freeing its blocks."""
        outputs, self._pending = self._pending, []
        for request in list(self.requests.values()):
            if request.request_id in self.remote_pending or request.request_id in self.scheduler.loading:
                continue  # its KV is in flight; commit_remote / fail_remote / the load's end settle it
            del self.requests[request.request_id]
            request.error = error
            self.scheduler.remove(request, RequestStatus.FINISHED_ERROR)
            outputs.append(self._output(request, [], "", 0))
        return outputs

    # ---- LoRA adapters (engine/lora/manager.py), between steps ---------------------------------------
    def load_lora(self, name: str, path: str, pinned: bool = False) -> str:
        """Load the PEFT adapter at ``path`` as ``name`` (host memory, and a free slot if one is; ``pinned``: a slot
        for good); returns its digest. LoraAdapterError names what refused it."""
        return self._lora_manager().load(name, path, pinned).digest

    def add_lora(self, adapter, pinned: bool = False) -> str:
        """``load_lora`` of an adapter read already (engine/lora/adapter.py ``load_adapter``, off the engine thread,
        so a large file does not stall the steps); returns its digest."""
        return self._lora_manager().add(adapter, pinned).digest

    def unload_lora(self, name: str) -> None:
        """Forget adapter ``name``; refused (InvalidRequestError) while a request of this engine still runs or waits
        with it. A prefill worker's handed-off requests (``held``) do not count: their KV is computed."""
        manager = self._lora_manager()
        users = [r.request_id for group in (self.requests, self.remote_pending) for r in group.values()
                 if r.params.lora == name]
        if users:
            raise InvalidRequestError(f"LoRA adapter {name!r} is in use by {len(users)} requests ({users[:3]} ...)")
        manager.unload(name)

    def lora_stats(self) -> dict | None:
        """The adapters (engine/lora/manager.py ``info``) and those of the running and the waiting requests (vLLM's
        ``running_lora_adapters`` / ``waiting_lora_adapters``: names, sorted); None without LoRA."""
        if self.runner.lora is None:
            return None
        sched = self.scheduler
        waiting = [*sched.waiting, *sched.loading.values(), *self.remote_pending.values()]
        return {**self.runner.lora.info(), "reserves": sched.num_lora_reserves,
                "running_adapters": sorted({r.params.lora for r in sched.running if r.params.lora is not None}),
                "waiting_adapters": sorted({r.params.lora for r in waiting if r.params.lora is not None})}

    def _lora_manager(self):
        if self.runner.lora is None:
            raise ConfigError("this engine was started without LoRA slots (set max_loras or lora_modules)")
        return self.runner.lora

    def has_unfinished_requests(self) -> bool:
        """Whether ``step()`` has work (requests waiting for remote KV do not count until committed)."""
        return bool(self.scheduler.num_unfinished) or bool(self._pending)

    # ---- the loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0, steps = time.perf_counter(), self.stats.num_steps
        self._decode_only_tokens = 0
        try:
            return self._step()
        finally:
            if self.stats.num_steps != steps:  # a step that ran the model: its whole time counts as busy
                dt = time.perf_counter() - t0
                self.stats.busy_s += dt
                if self.spec is not None and self._decode_only_tokens:
                    self.spec.observe_step(self._decode_only_tokens, dt)

    def _step(self) -> list[RequestOutput]:
        self.sync_tiers()
        outputs, self._pending = self._pending, []
        if self.spec is not None:
            self.spec.sweep(self.requests)
            self.spec.propose(self.scheduler.running, self.max_model_len)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.loading:  # only loads in flight: wait for one rather than spin
                self.sync_tiers(wait_s=0.005)
            return outputs
        decode_rows = sum(1 for s in sched.scheduled if s.num_new_tokens - s.num_draft_tokens == 1)
        if decode_rows == len(sched.scheduled):  # decode / verify only: what the speculation policy's cost model fits
            self._decode_only_tokens = sched.num_batched_tokens
        if self.spec is not None:
            self.spec.fill(sched)  # a draft model's drafts, now that their blocks are allocated
        logits, sampled = self.runner.execute(sched)
        self.stats.kernel_fallbacks = len(self.runner.fallbacks)
        self.scheduler.on_step_computed(sched)
        self.sync_tiers()
        st = self.stats
        st.num_steps += 1
        st.num_computed_tokens += sched.num_batched_tokens
        st.num_prefill_tokens_computed += sched.num_batched_tokens - decode_rows - sum(
            s.num_draft_tokens for s in sched.scheduled)
        st.num_decode_steps += decode_rows > 0
        st.num_decode_tokens += decode_rows
        if not sampled:
            return outputs
        return outputs + self._sample_and_emit(logits, sampled)

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams]):
        """Run a batch to completion; returns {request_id: (token_ids, text, finish_reason)} in input order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = []
        for p, sp in zip(prompts, params_list):
            r = self.add_request(prompt=p, params=sp) if isinstance(p, str) else self.add_request(
                prompt_token_ids=p, params=sp)
            ids.append(r.request_id)
        results: dict[str, dict] = {i: {"token_ids": [], "text": "", "finish_reason": None} for i in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                res = results[out.request_id]
                res["token_ids"].extend(out.new_token_ids)
                res["text"] += out.new_text
                if out.finished:
                    res["finish_reason"] = out.finish_reason
        return [results[i] for i in ids]

    # ---- reporting ------------------------------------------------------------------------------
    def load(self, role: str = "both") -> WorkerLoad:
        return WorkerLoad(
            worker=self.config.worker_id, role=role, running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting), kv_blocks_used=self.pool.num_used_blocks,
            kv_blocks_total=self.pool.num_blocks,
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens(),
            tiers=self.tiers.usage() if self.tiers is not None else ())

    def take_events(self) -> list[KVEvent]:
        self.sync_tiers()
        return self.pool.take_events()

    def snapshot_events(self) -> list[KVEvent]:
        """Events that rebuild this engine's cached set, every tier, from nothing (a query)."""
        events = self.pool.snapshot_events()
        return events + self.tiers.snapshot_events() if self.tiers is not None else events

    # ---- lower KV tiers (engine/kv/tiers.py) --------------------------------------------------------
    def sync_tiers(self, wait_s: float = 0.0) -> None:
        """Apply the mover's finished jobs (loaded requests rejoin the queue) and write newly cached blocks
        through to the host tier. Engine thread only."""
        if self.tiers is None:
            return
        for job in self.tiers.poll(wait_s):
            self.scheduler.finish_load(job.request_id, job.num_loaded)
        new = self.pool.take_new_cached()
        if new:
            pinned = self.tiers.offload(new, lambda blocks: self.pool.free_blocks(reversed(blocks)))
            self.pool.touch(pinned)

    def finish_import(self, request_id: str, ok: bool) -> None:
        """The peer blocks of a request's prefix have landed (``ok``) or not (recomputed, counted)."""
        request = self.scheduler.loading.get(request_id)
        if request is None:
            return
        n = len(request.blocks) - request.num_registered_blocks
        if not ok:
            self.stats.num_peer_import_failures += 1
        self.scheduler.finish_load(request_id, n if ok else 0, from_peer=True)

    def rename(self, worker_id: str) -> None:
        """The worker took a new id (a role flip): KV events and load reports name it from now on."""
        self.config = replace(self.config, worker_id=worker_id)
        self.pool.worker_id = worker_id
        if self.tiers is not None:
            self.tiers.worker_id = worker_id

    def capture_decode_graphs(self) -> int:
        """Capture every decode bucket's graph now (CUDA graphs, or a CPU's recordings of C calls), for an engine
        about to decode (a decode or colocated worker at start-up, a flip into decode), so no serving step pays a
        first capture and its Triton compiles (0.4-1.2 s on an H200). Returns how many were captured: 0 without
        graphs (a dense model on a CPU, cuda_graph_max_batch / cpu_graph_max_batch 0)."""
        graphs = self.runner.decode_graphs
        return graphs.capture_all() if graphs is not None else 0

    def close(self) -> None:
        """Stop the mover thread and remove the disk tier's files; release the other tensor-parallel ranks."""
        if self.tiers is not None:
            self.tiers.mover.close()
        if self.runner.tp.enabled:
            self.runner.stop_followers()

