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
from dataclasses import dataclass, field

from engine.block_pool import BlockPool
from engine.config import EngineConfig, ModelConfig
from engine.errors import InvalidRequestError
from engine.hashing import BlockHasher
from engine.kv_events import KVEvent, WorkerLoad
from engine.model_runner import ModelRunner
from engine.request import Request, RequestStatus, SamplingParams
from engine.sampler import sample
from engine.scheduler import Scheduler
from engine.stopping import apply_stop_conditions
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0  # of admitted requests
    num_computed_tokens: int = 0  # tokens the model actually ran (prefill chunks + decode tokens)
    num_generated_tokens: int = 0
    num_finished: int = 0
    num_aborted: int = 0


class Engine:
    def __init__(self, config: EngineConfig, *, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        mpe = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or mpe, mpe)
        self.tokenizer = tokenizer or Tokenizer.from_dir(config.model)
        self.runner = ModelRunner(self.model_config, config, self.max_model_len)
        self.pool = BlockPool(self.runner.num_blocks, config.enable_prefix_caching, config.worker_id)
        self.hasher = BlockHasher(config.block_size, config.hash_seed, config.hash_namespace)
        self.scheduler = Scheduler(self.pool, self.hasher, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)

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
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request needs "
                f"{total} ({len(ids)} in the prompt + {params.max_tokens} max_tokens)")
        if self.scheduler.blocks_needed(total) > self.pool.num_blocks:
            raise InvalidRequestError(
                f"the request needs {self.scheduler.blocks_needed(total)} KV blocks; this engine has "
                f"{self.pool.num_blocks}")
        request_id = request_id or f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        eos = frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
        return Request(request_id, ids, params, seed=seed, eos_token_ids=eos)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
        self.requests[request.request_id] = request
        self.stats.num_prompt_tokens += request.num_prompt_tokens
        self.scheduler.add(request)

    def add_request(self, request_id=None, prompt=None, prompt_token_ids=None, params=None) -> Request:
        request = self.make_request(request_id, prompt, prompt_token_ids, params)
        self.add(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.remove(request, RequestStatus.FINISHED_ABORTED)
        self.stats.num_aborted += 1
        self._pending.append(self._output(request, [], "", 0))
        return True

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every unfinished request with an error (after an unexpected fault), freeing its blocks."""
        outputs, self._pending = self._pending, []
        for request in list(self.requests.values()):
            del self.requests[request.request_id]
            request.error = error
            self.scheduler.remove(request, RequestStatus.FINISHED_ERROR)
            outputs.append(self._output(request, [], "", 0))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # ---- the loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        logits, sampled = self.runner.execute(sched)
        self.scheduler.on_step_computed(sched)
        self.stats.num_steps += 1
        self.stats.num_computed_tokens += sched.num_batched_tokens
        if not sampled:
            return outputs
        requests = [s.request for s in sampled]
        result = sample(logits, requests)
        for i, request in enumerate(requests):
            n_before = len(request.text) - request.num_stop_held_chars
            request.output_token_ids.append(result.token_ids[i])
            if result.logprobs[i] is not None:
                request.output_logprobs.append(result.logprobs[i])
                request.output_top_logprobs.append(result.top_logprobs[i])
            self.stats.num_generated_tokens += 1
            self.scheduler.on_tokens_appended(request)
            status = apply_stop_conditions(request, self.max_model_len)
            if status is not None:
                self.scheduler.remove(request, status)
                del self.requests[request.request_id]
                self.stats.num_finished += 1
            new_text = request.text[n_before: len(request.text) - request.num_stop_held_chars]
            outputs.append(self._output(request, [result.token_ids[i]], new_text, 1))
        return outputs

    def _output(self, request: Request, new_ids: list[int], new_text: str, n_new: int) -> RequestOutput:
        finished = request.is_finished
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            new_logprobs=request.output_logprobs[-n_new:] if n_new and request.output_logprobs else [],
            new_top_logprobs=request.output_top_logprobs[-n_new:] if n_new and request.output_top_logprobs else [],
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
            error=request.error,
        )

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
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens())

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()
