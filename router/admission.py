"""Admission control: a bounded number of sequences in flight, a bounded wait for a slot, deadlines.

    backend = AdmittedBackend(cluster_backend, AdmissionConfig(max_concurrent=256, max_queued=1024,
                                                               queue_timeout_s=30, request_timeout_s=600))

Every condition has one error type, mapped to one status by each front door:

    condition                                       error                    HTTP   gRPC
    the queue is full (or there is none, all busy)  OverloadedError          429 + Retry-After  RESOURCE_EXHAUSTED
    waited in the queue past queue_timeout_s        QueueTimeoutError        408    DEADLINE_EXCEEDED
    generation past request_timeout_s               DeadlineExceededError    504    DEADLINE_EXCEEDED
    no worker in a pool the request needs           NoWorkersError           503    UNAVAILABLE
    a request body over max_request_bytes           (front door)             413    RESOURCE_EXHAUSTED

A slot is one sequence (a choice of an HTTP request with ``n`` choices takes ``n``). Slots are granted in
arrival order: a freed slot goes to the oldest waiter. The deadline covers the whole request from its
admission; a streaming response that already started reports it in-band. Everything here happens before
the first output or ends the stream, so nothing already accepted is silently dropped.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.errors import ConfigError, DuetError
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from router.backend import Backend, Health


class OverloadedError(DuetError, RuntimeError):
    """Too many requests in flight and queued; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueTimeoutError(DuetError, TimeoutError):
    """The request waited for a slot longer than the queue timeout."""


class DeadlineExceededError(DuetError, TimeoutError):
    """The request ran past its deadline and was aborted."""


@dataclass(frozen=True)
class AdmissionConfig:
    max_concurrent: int | None = None  # sequences generating at once (None: no bound)
    max_queued: int | None = None  # sequences waiting for a slot (None: no bound; 0: no queue)
    queue_timeout_s: float | None = None  # longest wait for a slot
    request_timeout_s: float | None = None  # longest life of a request from admission to its last token

    def __post_init__(self) -> None:
        for name in ("max_concurrent", "max_queued"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0
                                      or (name == "max_concurrent" and value == 0)):
                raise ConfigError(f"{name} must be a positive integer (max_queued may be 0) or None, got {value!r}")
        for name in ("queue_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0 or None, got {value!r}")


class AdmittedBackend(Backend):
    def __init__(self, inner: Backend, config: AdmissionConfig) -> None:
        self.inner = inner
        self.config = config
        self.card = inner.card
        self.tokenizer = inner.tokenizer
        self.lora = inner.lora
        self.running = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self.counters = collections.Counter()  # admitted, overloaded, queue_timeouts, deadlines

    @property
    def queued(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    def check_request(self, prompt_token_ids, params) -> None:
        self.inner.check_request(prompt_token_ids, params)

    def lora_adapters(self) -> tuple[str, ...]:
        return self.inner.lora_adapters()

    def health(self) -> Health:
        h = self.inner.health()
        return Health(h.ok, {**h.detail, "admission": {"running": self.running, "queued": self.queued,
                                                       **dict(self.counters)}})

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        await self._acquire()
        try:
            deadline = None if self.config.request_timeout_s is None else time.monotonic() + self.config.request_timeout_s
            stream = self.inner.generate(request_id, prompt_token_ids, params)
            async with contextlib.aclosing(stream):
                while True:
                    try:
                        if deadline is None:
                            out = await anext(stream)
                        else:
                            out = await asyncio.wait_for(anext(stream), max(0.0, deadline - time.monotonic()))
                    except StopAsyncIteration:
                        return
                    except TimeoutError:
                        self.counters["deadlines"] += 1
                        raise DeadlineExceededError(f"request {request_id} ran past its deadline of "
                                                    f"{self.config.request_timeout_s:g} s and was aborted") from None
                    yield out
                    if out.finished:
                        return
        finally:
            self._release()

    # ---- slots -----------------------------------------------------------------------------------
    async def _acquire(self) -> None:
        cfg = self.config
        if cfg.max_concurrent is None or (self.running < cfg.max_concurrent and not self.queued):
            self.running += 1
            self.counters["admitted"] += 1
            return
        if cfg.max_queued is not None and self.queued >= cfg.max_queued:
            self.counters["overloaded"] += 1
            raise OverloadedError(f"the server is at capacity ({self.running} requests running, {self.queued} "
                                  "queued); retry later", retry_after_s=math.ceil(cfg.queue_timeout_s or 1))
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), cfg.queue_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as e:
            if waiter.done() and not waiter.cancelled():  # the slot arrived as we gave up: pass it on
                self._release()
            else:
                waiter.cancel()
            if isinstance(e, TimeoutError):
                self.counters["queue_timeouts"] += 1
                raise QueueTimeoutError(f"waited {cfg.queue_timeout_s:g} s for a free slot") from None
            raise
        self.counters["admitted"] += 1  # the slot was handed over by _release (running unchanged)

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.running -= 1
