"""The OpenAI-compatible HTTP front door: FastAPI over a `router.backend.Backend`.

    app = create_app(backend, api_keys=("k1",), served_model_names=("my-model",))
    uvicorn.run(app, host="0.0.0.0", port=8000)

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming), GET /v1/models,
GET /v1/models/{id}, GET /health (open even when API keys are set; ``?probe=liveness`` for liveness
probes); the operator's /admin/* and /metrics
(router/admin_api.py).

One path serves both generation endpoints: parse the body → tokenize (the router owns tokenization)
→ one SamplingParams per choice → `_ChoiceRun` → either stream SSE chunks or collect one JSON body;
the endpoints differ only in the request model, the prompt ids and the `ResponseBuilder`.

`_ChoiceRun` consumes each choice's backend stream in its own task and merges them, with a watcher of
the client's connection, into one queue. Tearing down is therefore synchronous (cancel the tasks):
it cannot itself be cancelled halfway, which matters because Starlette cancels a streaming body when
the client goes. A cancelled task closes its backend iterator, which aborts the request and frees its
KV blocks. The watcher makes a client that hangs up abort its request within one event-loop turn,
streaming or not, even while the request is still queued and produces nothing.

The response status is decided after the first engine output arrives, so a request the workers refuse
is a 400 rather than an error inside a 200 stream. After that, a failure is an SSE ``data: {"error":
...}`` event followed by ``[DONE]`` (streaming) or a 503 (not streaming).

With ``salt_by_api_key`` every request's block hashes are salted by the API key it came with (beside
the client's ``cache_salt``): tenants never share prefix-cache hits (router/tenancy.py).

Errors are always OpenAI bodies ``{"error": {message, type, param, code}}`` (router/http_errors.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.outputs import RequestOutput
from engine.request import SamplingParams
from router.backend import Backend
from router.openapi_doc import document
from router.http_errors import (
    ApiError, ClientGone, ClientTooSlow, api_key_check, error_response, health_error, install_error_handlers, parse_body,
)
from router.tenancy import bearer_token, tenant_salt
from router.openai_protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest, error_body
from router.openai_responses import ChatResponses, ChoiceState, CompletionResponses, ResponseBuilder

log = logging.getLogger(__name__)

_Body = TypeVar("_Body", bound=GenerationRequest)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = "data: [DONE]\n\n"
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
MAX_BUFFERED_OUTPUTS = 4096  # per response: a client that stops reading is cut off beyond this


def create_app(backend: Backend, *, api_keys: Sequence[str] = (),
               served_model_names: Sequence[str] | None = None, operator=None, metrics=None,
               admin_key: str | None = None, bind_host: str = "127.0.0.1",
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, salt_by_api_key: bool = False) -> FastAPI:
    """``operator`` (cluster.pools.PoolManager) and ``metrics`` (router.metrics.RouterMetrics) add the
    operator's API: /admin/* and /metrics (router/admin_api.py). ``salt_by_api_key``: each API key is its
    own prefix-cache domain (router/tenancy.py); it needs ``api_keys``."""
    from router.admin_api import admin_router

    if salt_by_api_key and not api_keys:
        raise ValueError("salt_by_api_key needs api_keys: without keys there are no tenants to tell apart")
    app = FastAPI(title="duet", summary="OpenAI-compatible API over duet")
    server = _OpenAIServer(backend, served_model_names, max_request_bytes, salt_by_api_key)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(api_key_check(api_keys))])
    v1.add_api_route("/completions", server.completions, methods=["POST"])
    v1.add_api_route("/chat/completions", server.chat_completions, methods=["POST"])
    v1.add_api_route("/models", server.list_models, methods=["GET"])
    v1.add_api_route("/models/{model_id:path}", server.get_model, methods=["GET"])
    app.include_router(v1)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.include_router(admin_router(operator, metrics, api_keys=api_keys, admin_key=admin_key, bind_host=bind_host))
    install_error_handlers(app)
    document(app, server.model_names)
    return app


class _OpenAIServer:
    def __init__(self, backend: Backend, served_model_names: Sequence[str] | None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, salt_by_api_key: bool = False) -> None:
        self.backend = backend
        self.max_request_bytes = max_request_bytes
        self.salt_by_api_key = salt_by_api_key
        self.model_names = list(served_model_names or [backend.card.model_id])
        self._accepted_names = {backend.card.model_id, *self.model_names}

    async def completions(self, request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, self.max_request_bytes)
        self._check_model(body.model)
        tokenizer = self.backend.tokenizer
        prompts = body.prompts()
        prompt_ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        echo = [p if isinstance(p, str) else None for p in prompts] if body.echo else None  # None: decode ids
        return await self._generate(request, body, prompt_ids, CompletionResponses, echo=echo)

    async def chat_completions(self, request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, self.max_request_bytes)
        self._check_model(body.model)
        # the rendered template holds its own BOS: encode without adding special tokens
        prompt_ids = self.backend.tokenizer.encode_chat(body.template_messages(), add_generation_prompt=True)
        return await self._generate(request, body, [prompt_ids], ChatResponses)

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_entry(name) for name in self.model_names]}

    async def get_model(self, model_id: str) -> dict[str, Any]:
        self._check_model(model_id)
        return self._model_entry(model_id)

    async def health(self, probe: str | None = None) -> JSONResponse:
        """Readiness (default): 200 only while the backend can serve (a decode worker is ready).
        ``?probe=liveness``: 200 as long as this server answers — a pool being replaced is no reason to
        restart the router (Kubernetes liveness probes use this)."""
        if probe == "liveness":
            return JSONResponse({"status": "alive"})
        if probe is not None:
            raise ApiError(400, f"unknown probe {probe!r}; use probe=liveness or none", param="probe")
        try:
            health = self.backend.health()
        except Exception as e:  # a health probe must answer, whatever the backend does
            log.exception("backend health check failed")
            return JSONResponse(health_error(f"health check failed: {e}", {}), status_code=503)
        if health.ok:
            return JSONResponse({**health.detail, "status": "ok"})
        return JSONResponse(health_error("the backend is not healthy", health.detail), status_code=503)

    # ---- the one generation path -----------------------------------------------------------------
    async def _generate(self, request: Request, body: GenerationRequest, prompts: list[list[int]],
                        builder_class: type[ResponseBuilder], echo: list[str | None] | None = None) -> Response:
        """``prompts``: one, or a completions batch; choice ``p * n + i`` is prompt p's i-th choice.
        ``echo``: each prompt's text (None: the decoded ids), returned before its completions."""
        # a batch is completions only, whose max_tokens does not depend on the prompt: one params list
        params = body.sampling_params(len(prompts[0]), self.backend.card.max_model_len, self._tenant_salt(request))
        for ids in prompts:
            self.backend.check_request(ids, params[0])  # choices differ only in their seeds
        if echo:  # ids are known to be in the vocabulary now
            echo = [self.backend.tokenizer.decode(ids) if text is None else text for text, ids in zip(echo, prompts)]
        builder = builder_class(self.backend.tokenizer, body.model, sum(len(ids) for ids in prompts),
                                with_logprobs=params[0].logprobs is not None, include_usage=body.include_usage)
        echo_logprobs = params[0].prompt_logprobs is not None
        choices = [ChoiceState(p * len(params) + i, echo[p] if echo else "",
                               prefix_token_ids=ids if echo_logprobs else [], first_of_prompt=i == 0)
                   for p, ids in enumerate(prompts) for i in range(len(params))]
        run = _ChoiceRun(self.backend, builder.id, [(ids, sp) for ids in prompts for sp in params], request)
        try:
            await run.wait_first()
        except BaseException:
            run.cancel()
            raise
        if body.stream:
            return StreamingResponse(_stream_events(run, builder, choices), media_type="text/event-stream",
                                     headers=_SSE_HEADERS)
        return await _collect_response(run, builder, choices)

    def _tenant_salt(self, request: Request) -> str | None:
        """The API key's salt when salting by key (the key was checked by the router's dependency)."""
        if not self.salt_by_api_key:
            return None
        return tenant_salt(bearer_token(request.headers.get("authorization", "")) or "")

    def _check_model(self, name: str) -> None:
        if name not in self._accepted_names:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves "
                           f"{', '.join(repr(n) for n in self.model_names)}", param="model", code="model_not_found")

    def _model_entry(self, name: str) -> dict[str, Any]:
        card = self.backend.card
        return {"id": name, "object": "model", "created": card.created, "owned_by": "duet",
                "root": card.model_id, "max_model_len": card.max_model_len}


class _ChoiceRun:
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


async def _collect_response(run: _ChoiceRun, builder: ResponseBuilder, choices: list[ChoiceState]) -> Response:
    try:
        while (item := await run.next()) is not None:
            choices[item[0]].add(item[1])
    finally:
        run.cancel()
    failed = next((c for c in choices if c.error is not None), None)
    if failed is not None:
        raise ApiError(503, f"generation failed: {failed.error}", "server_error", code="generation_failed")
    return JSONResponse(builder.response(choices))


async def _stream_events(run: _ChoiceRun, builder: ResponseBuilder,
                         choices: list[ChoiceState]) -> AsyncIterator[str]:
    try:
        for chunk in builder.opening_chunks(len(choices)):
            yield _sse(chunk)
        while (item := await run.next()) is not None:
            choice = choices[item[0]]
            delta = choice.add(item[1])
            if choice.error is not None:
                yield _sse(error_body(f"generation failed: {choice.error}", "server_error",
                                      code="generation_failed"))
                break
            # a token whose text is held back (half a character, a possible stop string) is sent
            # only when it carries logprobs
            if delta.text or delta.finish_reason or (builder.with_logprobs and delta.token_ids):
                yield _sse(builder.chunk(delta))
        else:
            if builder.include_usage:
                yield _sse(builder.usage_chunk(choices))
        yield _DONE
    except ClientGone:
        return
    except Exception as e:  # the status line is gone: report in band
        yield _sse(error_response(e)[1])
        yield _DONE
    finally:
        run.cancel()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
