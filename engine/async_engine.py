"""AsyncEngine: the engine loop on its own thread, streaming outputs to asyncio callers.

Only the engine thread touches the ``Engine``; callers talk to it through an inbox (add / abort) and get
outputs on a per-request ``asyncio.Queue``. Validation happens in the caller (``make_request`` is a pure
query), so a bad request raises ``InvalidRequestError`` straight at its caller. A caller that stops
iterating (client gone, task cancelled) aborts its request, which frees its blocks.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from engine.engine import Engine
from engine.outputs import RequestOutput
from engine.request import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="duet-engine", daemon=True)
        self._thread.start()

    async def generate(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        request = self.engine.make_request(request_id, prompt, prompt_token_ids, params)
        rid = request.request_id
        if rid in self._streams:
            from engine.errors import InvalidRequestError

            raise InvalidRequestError(f"request id {rid!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), stream)
        self._send("add", request)
        finished = False
        try:
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._send("abort", rid)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    # ---- engine thread ----------------------------------------------------------------------------
    def _send(self, verb: str, arg) -> None:
        self._inbox.put((verb, arg))
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug or device fault: fail what was running, keep serving
                log.exception("engine step failed")
                outputs = self.engine.fail_all(f"engine step failed: {e}")
            for out in outputs:
                self._deliver(out.request_id, out)

    def _drain_inbox(self) -> None:
        while True:
            try:
                verb, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if verb == "add":
                try:
                    self.engine.add(arg)
                except Exception as e:
                    self._deliver(arg.request_id, e)
            elif verb == "abort":
                self.engine.abort_request(arg)

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)
