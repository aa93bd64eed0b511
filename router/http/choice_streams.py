"""The engine streams of one response's choices, merged: each choice's backend stream is pumped by its own task
into one queue, beside a watcher of the client's connection (router/http/app.py, router/http/responses_api.py).

Tearing down is synchronous (cancel the tasks): it cannot itself be cancelled halfway, which matters because
Starlette cancels a streaming body when the client goes. A cancelled task closes its backend iterator, which
aborts the request and frees its KV blocks. The watcher makes a client that hangs up abort its request within
one event-loop turn, streaming or not, even while the request is still queued and produces nothing.
"""
from __future__ import annotations

import asyncio
import contextlib

from fastapi import Request

from engine.outputs import RequestOutput
from engine.request import SamplingParams
from router.backend import Backend
from router.http.errors import ApiError, ClientGone, ClientTooSlow

MAX_BUFFERED_OUTPUTS = 4096  # per response: a client that stops reading is cut off beyond this
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ChoiceRun:
    """The backend streams of a response's choices, each pumped by its own task into one queue."""

    _DISCONNECTED = object()

    def __init__(self, backend: Backend, response_id: str, runs: list[tuple[list[int], SamplingParams]],
                 request: Request) -> None:
        """``runs``: (prompt ids, params) per choice, in choice-index order."""
        self._queue: asyncio.Queue = asyncio.Queue()
        self._buffered: list = []
        self._num_open = len(runs)
        self._overflowed = False
        self._tasks = [asyncio.create_task(self._pump(i, backend, f"{response_id}-{i}", ids, p))
                       for i, (ids, p) in enumerate(runs)]
        self._tasks.append(asyncio.create_task(self._watch(request)))

    @classmethod
    async def started(cls, backend: Backend, response_id: str, runs: list[tuple[list[int], SamplingParams]],
                      request: Request) -> ChoiceRun:
        """A run whose first output has arrived (so a request the workers refuse is still a 4xx); what the
        backend raised before that is raised here, with everything cancelled."""
        run = cls(backend, response_id, runs, request)
        try:
            await run.wait_first()
        except BaseException:
            run.cancel()
            raise
        return run

    async def collect(self, choices: list) -> None:
        """Every output into its choice (``ChoiceState.add``), then cancel; a 503 when a choice ended in error."""
        try:
            while (item := await self.next()) is not None:
                choices[item[0]].add(item[1])
        finally:
            self.cancel()
        failed = next((c for c in choices if c.error is not None), None)
        if failed is not None:
            raise ApiError(503, f"generation failed: {failed.error}", "server_error", code="generation_failed")

    async def wait_first(self) -> None:
        """Wait for the first output of any choice; raises what the backend raised before it started."""
        item = await self._queue.get()
        self._buffered.append(item)
        if item is self._DISCONNECTED:
            raise ClientGone()
        if isinstance(item[1], BaseException):
            raise item[1]

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next (choice index, output), or None when every choice has finished."""
        while self._num_open:
            if self._overflowed:
                raise ClientTooSlow(f"the client stopped reading: more than {MAX_BUFFERED_OUTPUTS} outputs "
                                     "were waiting to be sent, so the request was aborted")
            item = self._buffered.pop() if self._buffered else await self._queue.get()
            if item is self._DISCONNECTED:
                raise ClientGone()
            index, out = item
            if isinstance(out, BaseException):
                raise out
            if out is None:
                self._num_open -= 1
                continue
            return index, out
        return None

    def cancel(self) -> None:
        """Abort whatever still runs (each pump closes its backend stream) and stop watching the client."""
        for task in self._tasks:
            task.cancel()

    def _cancel_pumps(self) -> None:
        for task in self._tasks[:-1]:
            task.cancel()

    async def _pump(self, index: int, backend: Backend, request_id: str, prompt_ids: list[int],
                    params: SamplingParams) -> None:
        try:
            outputs = backend.generate(request_id, prompt_ids, params)
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    if self._queue.qsize() >= MAX_BUFFERED_OUTPUTS:  # the client does not read: do not
                        self._overflowed = True                       # buffer without bound; abort instead
                        self._cancel_pumps()
                        return
                    self._queue.put_nowait((index, out))
                    if out.finished:
                        return
            raise RuntimeError("the backend stream ended without a final output")
        except Exception as e:
            self._queue.put_nowait((index, e))
        finally:
            self._queue.put_nowait((index, None))

    async def _watch(self, request: Request) -> None:
        # The body has been read, so the next ASGI message is the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(0.05)  # an unexpected message: do not spin
        # Abort here rather than rely on the consumer: a streaming body cancelled before it started
        # never runs its own clean-up.
        self._cancel_pumps()
        self._queue.put_nowait(self._DISCONNECTED)
