"""AsyncEngine: the engine loop on its own thread, streaming outputs to asyncio callers.

Only the engine thread touches the ``Engine``; callers talk to it through an inbox and get outputs on a
per-request ``asyncio.Queue``. Validation happens in the caller (``make_request`` is a pure query), so a
bad request raises ``InvalidRequestError`` straight at its caller. A caller that stops iterating (client
gone, task cancelled) aborts its request, which frees its blocks.

Hooks for the workers that wrap an engine (all run on the engine thread, so they may touch the engine):
- ``on_output(out) -> out``: sees every output before it is delivered (the prefill worker puts a lease
  on a handoff here, before anyone can learn the handoff exists);
- ``on_tick()``: once per loop iteration, and at least every ``tick_s`` when idle (publishing KV
  events and load, polling transfer notices, expiring leases);
- ``call(fn)``: run ``fn(engine)`` on the engine thread, result as a ``concurrent.futures.Future``;
- ``stream(request_id, start)``: open a stream for a request that enters the engine some other way
  than ``add`` (``start(engine)`` runs on the engine thread; the decode worker's remote-KV path).
``load_lora`` / ``unload_lora`` / ``lora_adapters``: the LoRA verbs of a worker or a colocated server.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from engine.engine import Engine
from engine.errors import InvalidRequestError, RankLostError
from engine.outputs import RequestOutput
from engine.request import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        *,
        on_output: Callable[[RequestOutput], RequestOutput] | None = None,
        on_tick: Callable[[], None] | None = None,
        tick_s: float = 0.5,
        name: str = "duet-engine",
        on_fatal: Callable[[Exception], None] | None = None,
    ) -> None:
        """``on_fatal(error)``: the engine cannot step again (a tensor-parallel rank is gone), called on the engine
        thread before its requests are failed and the thread ends (a worker exits its process there)."""
        self.engine = engine
        self._on_fatal = on_fatal
        self._on_output = on_output
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def generate(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        remote_decode: bool = False,
        peer=None,
    ) -> AsyncIterator[RequestOutput]:
        request = self.engine.make_request(request_id, prompt, prompt_token_ids, params)
        request.remote_decode = remote_decode
        request.peer_blocks = peer  # engine.kv.handoff.PeerBlocks lent for the prefix
        async for out in self.stream(request.request_id, lambda engine: engine.add(request)):
            yield out

    async def stream(self, request_id: str, start: Callable[[Engine], None]) -> AsyncIterator[RequestOutput]:
        """Deliver ``request_id``'s outputs after running ``start(engine)`` on the engine thread. An
        exception raised by ``start`` is raised here; leaving early aborts the request."""
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._send("start", (request_id, start))
        finished = False
        try:
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    finished = True  # it never entered the engine (or already left it)
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send("abort", request_id)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def has_stream(self, request_id: str) -> bool:
        """Whether a caller is still reading ``request_id``'s outputs."""
        return request_id in self._streams

    def call(self, fn: Callable[[Engine], object]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send("call", (fn, future))
        return future

    # ---- LoRA adapters (engine/lora/manager.py) ---------------------------------------------------
    async def load_lora(self, name: str, path: str, pinned: bool = False) -> str:
        """Load the PEFT adapter at ``path`` as ``name``; returns its digest. The files are read on a helper thread
        (the steps go on) and the adapter joins the engine between two steps. The same bytes already loaded under
        the same name is no error (a router retrying after a partial failure); other bytes are."""
        from engine.lora.adapter import load_adapter  # torch: this module's importers may not need it

        lora = self.engine.runner.lora
        adapter = await asyncio.to_thread(load_adapter, name, path, lora.pool.num_layers if lora else None)

        def add(engine: Engine) -> str:
            held = engine.runner.lora.adapters.get(name) if engine.runner.lora is not None else None
            if held is not None and held.digest == adapter.digest:
                return held.digest
            return engine.add_lora(adapter, pinned)  # refuses other bytes under a loaded name

        return await asyncio.wrap_future(self.call(add))

    async def unload_lora(self, name: str) -> None:
        await asyncio.wrap_future(self.call(lambda engine: engine.unload_lora(name)))

    async def lora_adapters(self) -> dict[str, str]:
        """The adapters loaded: name -> digest (empty without LoRA)."""
        def held(engine: Engine) -> dict[str, str]:
            lora = engine.runner.lora
            return {} if lora is None else {n: lora.digest(n) for n in lora.names()}

        return await asyncio.wrap_future(self.call(held))

    def deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """Hand an output (or an exception that ends the stream) to the request's caller, from any thread."""
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

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
            if self._on_tick is not None:
                self._guarded(self._on_tick)
            if not self.engine.has_unfinished_requests():
                self._wake.wait(self._tick_s)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except RankLostError as e:  # a tensor-parallel rank is gone: this engine cannot step again
                log.error("engine stops: %s", e)
                if self._on_fatal is not None:
                    self._on_fatal(e)
                for out in self.engine.fail_all(f"engine lost a tensor-parallel rank: {e}"):
                    self.deliver(out.request_id, out)
                return  # the thread ends: the worker's health says so and the pool replaces it
            except Exception as e:  # a bug or device fault: fail what was running, keep serving
                log.exception("engine step failed")
                outputs = self.engine.fail_all(f"engine step failed: {e}")
            for out in outputs:
                if self._on_output is not None:
                    out = self._on_output(out)
                self.deliver(out.request_id, out)

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            log.exception("engine-thread hook failed")

    def _drain_inbox(self) -> None:
        while True:
            try:
                verb, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if verb == "start":
                request_id, start = arg
                try:
                    start(self.engine)
                except Exception as e:
                    self.deliver(request_id, e)
            elif verb == "abort":
                self.engine.abort_request(arg)
            elif verb == "call":
                fn, future = arg
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except Exception as e:
                        future.set_exception(e)

