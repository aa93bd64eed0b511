"""The OpenAI-compatible HTTP front door: FastAPI over a `router.backend.Backend`.

    app = create_app(backend, api_keys=("k1",), served_model_names=("my-model",))
    uvicorn.run(app, host="0.0.0.0", port=8000)

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming), GET /v1/models,
GET /v1/models/{id}, GET /health (open even when API keys are set; ``?probe=liveness`` for liveness
probes); the operator's /admin/* and /metrics
(router/http/admin.py); vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (router/http/lora_admin.py).

One path serves both generation endpoints: parse the body → tokenize (the router owns tokenization)
→ one SamplingParams per choice → `ChoiceRun` → either stream SSE chunks or collect one JSON body;
the endpoints differ only in the request model, the prompt ids and the `ResponseBuilder`.

`ChoiceRun` (router/http/choice_streams.py) merges the choices' backend streams, with a watcher of the client's
connection: a client that hangs up aborts its request and frees its KV blocks within one event-loop turn.
POST /v1/responses is router/http/responses_api.py's, over the chat path.

The response status is decided after the first engine output arrives, so a request the workers refuse
is a 400 rather than an error inside a 200 stream. After that, a failure is an SSE ``data: {"error":
...}`` event followed by ``[DONE]`` (streaming) or a 503 (not streaming).

With ``salt_by_api_key`` every request's block hashes are salted by the API key it came with (beside
the client's ``cache_salt``): tenants never share prefix-cache hits (router/tenancy.py).

Errors are always OpenAI bodies ``{"error": {message, type, param, code}}`` (router/http/errors.py).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from router.backend import Backend
from router.http.choice_streams import SSE_HEADERS, ChoiceRun
from router.http.errors import (
    ApiError,
    ClientGone,
    api_key_check,
    error_response,
    health_error,
    install_error_handlers,
    parse_body,
)
from router.http.openapi import document
from router.http.responses_api import ResponsesRequest, serve_response
from router.openai.assistant_message import Shaping
from router.openai.base import error_body
from router.openai.chat_format import ChatFormat
from router.openai.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from router.openai.response_builder import ChatResponses, ChoiceState, CompletionResponses, ResponseBuilder
from router.tenancy import bearer_token, tenant_salt

log = logging.getLogger(__name__)

_Body = TypeVar("_Body", bound=GenerationRequest)
_DONE = "data: [DONE]\n\n"
DEFAULT_MAX_REQUEST_BYTES = 4 << 20


def create_app(backend: Backend, *, api_keys: Sequence[str] = (),
               served_model_names: Sequence[str] | None = None, operator=None, metrics=None,
               admin_key: str | None = None, bind_host: str = "127.0.0.1",
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, salt_by_api_key: bool = False,
               tool_call_parser: str | None = None) -> FastAPI:
    """``operator`` (cluster.pools.PoolManager) and ``metrics`` (router.metrics.collector.RouterMetrics) add the
    operator's API: /admin/* and /metrics (router/http/admin.py). ``salt_by_api_key``: each API key is its
    own prefix-cache domain (router/tenancy.py); it needs ``api_keys``. ``tool_call_parser``: the format tool
    calls are parsed in (router/openai/tool_parsers.py FORMATS; default: detected from the chat template)."""
    from router.http.admin import access_checks, admin_router
    from router.http.lora_admin import lora_router

    if salt_by_api_key and not api_keys:
        raise ValueError("salt_by_api_key needs api_keys: without keys there are no tenants to tell apart")
    app = FastAPI(title="duet", summary="OpenAI-compatible API over duet")
    server = _OpenAIServer(backend, served_model_names, max_request_bytes, salt_by_api_key, metrics,
                           tool_call_parser)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(api_key_check(api_keys))])
    v1.add_api_route("/completions", server.completions, methods=["POST"])
    v1.add_api_route("/chat/completions", server.chat_completions, methods=["POST"])
    v1.add_api_route("/responses", server.responses, methods=["POST"])
    v1.add_api_route("/models", server.list_models, methods=["GET"])
    v1.add_api_route("/models/{model_id:path}", server.get_model, methods=["GET"])
    app.include_router(v1)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.include_router(admin_router(operator, metrics, api_keys=api_keys, admin_key=admin_key, bind_host=bind_host))
    app.include_router(lora_router(backend, access_checks(api_keys, admin_key, bind_host)[1]))
    install_error_handlers(app)
    document(app, lambda: [*server.model_names, *backend.lora_adapters()],
             resolves=backend.lora is not None and backend.lora.resolver is not None)
    return app


class _OpenAIServer:
    def __init__(self, backend: Backend, served_model_names: Sequence[str] | None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, salt_by_api_key: bool = False,
                 metrics=None, tool_call_parser: str | None = None) -> None:
        self.backend = backend
        self.max_request_bytes = max_request_bytes
        self.salt_by_api_key = salt_by_api_key
        self.metrics = metrics
        self.model_names = list(served_model_names or [backend.card.model_id])
        self._accepted_names = {backend.card.model_id, *self.model_names}
        self.tool_call_parser = tool_call_parser
        if tool_call_parser is not None:
            ChatFormat.check_parser(tool_call_parser)

    @functools.cached_property
    def chat_format(self) -> ChatFormat:
        """The model's chat conventions, read from its template on the first chat request."""
        return ChatFormat.of(self.backend.tokenizer, self.tool_call_parser)

    async def completions(self, request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, self.max_request_bytes)
        await self.resolve_model(body.model)
        tokenizer = self.backend.tokenizer
        prompts = body.prompts()
        prompt_ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        echo = [p if isinstance(p, str) else None for p in prompts] if body.echo else None  # None: decode ids
        return await self._generate(request, body, prompt_ids, CompletionResponses, echo=echo)

    async def chat_completions(self, request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, self.max_request_bytes)
        await self.resolve_model(body.model)
        prompt_ids, shaping = self.chat_prompt(body)
        if shaping.plan is not None and self.metrics is not None:
            self.metrics.tool_requests.labels(shaping.plan.fmt.name, shaping.plan.metric_mode).inc()
        return await self._generate(request, body, [prompt_ids], functools.partial(ChatResponses, shaping=shaping),
                                    tool_constraint=shaping.plan.constraint if shaping.plan else None,
                                    keep_special_tokens=shaping.keep_special_tokens)

    def chat_prompt(self, body) -> tuple[list[int], Shaping]:
        """A chat body's prompt ids and shaping, with the tool calls its responses drop counted."""
        prompt_ids, shaping = self.chat_format.prompt(body)
        if shaping.plan is not None and self.metrics is not None:
            dropped = self.metrics.tool_calls_dropped
            shaping = dataclasses.replace(shaping, report=lambda fmt, reason: dropped.labels(fmt, reason).inc())
        return prompt_ids, shaping

    async def responses(self, request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest, self.max_request_bytes)
        return await serve_response(self, request, body)

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters served now (loaded and unloaded at run time); their parent: the first served name."""
        return self.backend.lora_adapters()

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_entry(name) for name in (*self.model_names, *self.lora_names)]}

    async def get_model(self, model_id: str) -> dict[str, Any]:
        self.check_model(model_id)
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
                        builder_class: Callable[..., ResponseBuilder], echo: list[str | None] | None = None,
                        tool_constraint=None, keep_special_tokens: bool = False) -> Response:
        """``prompts``: one, or a completions batch; choice ``p * n + i`` is prompt p's i-th choice.
        ``echo``: each prompt's text (None: the decoded ids), returned before its completions."""
        # a batch is completions only, whose max_tokens does not depend on the prompt: one params list
        params = body.sampling_params(len(prompts[0]), self.backend.card.max_model_len, self.salt_for(request),
                                      tool_constraint, keep_special_tokens)
        if body.model in self.lora_names:  # a LoRA adapter's name: the request runs with it
            params = [dataclasses.replace(p, lora=body.model) for p in params]
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
        run = await ChoiceRun.started(self.backend, builder.id, [(ids, sp) for ids in prompts for sp in params],
                                      request)
        if body.stream:
            return StreamingResponse(_stream_events(run, builder, choices), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        await run.collect(choices)
        return JSONResponse(builder.response(choices))

    def salt_for(self, request: Request) -> str | None:
        """The API key's salt when salting by key (the key was checked by the router's dependency)."""
        if not self.salt_by_api_key:
            return None
        return tenant_salt(bearer_token(request.headers.get("authorization", "")) or "")

    async def resolve_model(self, name: str) -> None:
        """``check_model`` for a generation: a LoRA adapter the backend's resolver finds is loaded first (the
        request's 404 otherwise; an adapter found but not servable 400; no room now 429)."""
        if name not in self._accepted_names and self.backend.lora is not None:
            await self.backend.lora.resolve(name)
        self.check_model(name)

    def check_model(self, name: str) -> None:
        if name not in self._accepted_names and name not in self.lora_names:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves "
                           f"{', '.join(repr(n) for n in self.model_names)}", param="model", code="model_not_found")

    def _model_entry(self, name: str) -> dict[str, Any]:
        card = self.backend.card
        entry = {"id": name, "object": "model", "created": card.created, "owned_by": "duet",
                 "root": card.model_id, "max_model_len": card.max_model_len}
        if name in self.lora_names:  # vLLM's entry for an adapter: its base model as parent
            entry["parent"] = self.model_names[0]
        if card.weights is not None:  # an extension field (OpenAI clients keep unknown fields as extras)
            entry["duet"] = card.weights.to_json()
        return entry


async def _stream_events(run: ChoiceRun, builder: ResponseBuilder,
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
                for chunk in builder.chunks(delta):  # none while a parser holds text back (a possible marker)
                    yield _sse(chunk)
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
