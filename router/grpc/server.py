"""The gRPC front door (proto/duet/v1/generate.proto) over a `router.backend.Backend`.

    server = await start_grpc_server(backend, "0.0.0.0", 50051, api_keys=("k1",))
    server.port                       # the bound port (useful with port=0)
    await server.wait_for_termination()
    await server.stop(grace=5)        # health flips to NOT_SERVING first, then in-flight calls drain

Design notes:
- The servicer is a translator and nothing else: protobuf request -> (request_id, prompt ids,
  SamplingParams) -> `backend.generate` -> one GenerateResponse per engine output. Tokenization and chat
  templating happen here because the router owns them (the backend seam takes token ids); they run on a
  worker thread so a long prompt does not stall every other stream on the event loop.
- Absent sampling fields (proto3 `optional`) take SamplingParams' defaults, so the HTTP and gRPC doors
  cannot drift; SamplingParams' own validation is the one place values are checked.
- Status codes: everything a client can cause (`DuetError`: empty prompt, unknown model, prompt over the
  context, max_tokens <= 0, bad temperature, a request id in use) is INVALID_ARGUMENT with the engine's
  message. A backend failure reported mid-stream (finish_reason "error") aborts the call with UNAVAILABLE
  and the error text: the engine is (or was) down, the tokens already sent stand, and a retry of the whole
  request is safe because generation has no side effects. An exception escaping the backend is a bug:
  INTERNAL, logged. finish_reason "abort" (the server aborted the request, e.g. on shutdown) is delivered
  as an ordinary final message.
- Cancellation: the handler writes with `context.write` instead of being an async generator, so when the
  client cancels (or its deadline passes) the CancelledError lands inside our `async for` and
  `contextlib.aclosing` closes the backend iterator right there — the backend contract turns that into an
  abort that frees the request's KV blocks. (An async-generator handler can be dropped while suspended at
  `yield`, leaving the close to the garbage collector.)
- API keys: a server interceptor guards every method of duet.v1.Generate (`authorization: Bearer <key>`,
  constant-time compare) but the LoRA RPCs, which apply the admin-key rule themselves (router/grpc/lora.py).
  Health and reflection stay open so load balancers and grpcurl work unkeyed.
  With ``salt_by_api_key`` the servicer salts each request's block hashes by its key (router/tenancy.py).
- Health: grpc.health.v1 reports "" and "duet.v1.Generate"; a small task mirrors `backend.health().ok`
  into both every `health_interval_s`. `grpc.aio.server()` builds a plain Server we cannot subclass, so
  `start_grpc_server` wraps that instance's `stop` to enter graceful shutdown (NOT_SERVING) before the
  listener closes, and stores the bound port as `server.port`.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import uuid
from collections.abc import Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.errors import DuetError, InvalidRequestError, LoraAdapterNotFoundError, LoraAdaptersBusyError
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from engine.sampling.structured import structured_output
from engine.text.tokenizer import Tokenizer
from proto.build import ensure_generated
from router.admission import DeadlineExceededError, OverloadedError, QueueTimeoutError
from router.backend import Backend
from router.grpc.chat import ChatTurn
from router.grpc.lora import ADMIN_METHODS, LoraAdminRpcs
from router.openai.chat_format import ChatFormat
from router.routing.policy import NoWorkersError
from router.tenancy import metadata_bearer, tenant_salt

ensure_generated()
from proto.duet.v1 import generate_pb2 as pb  # noqa: E402  (generated above when missing)
from proto.duet.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generate"].full_name  # "duet.v1.Generate"
MAX_REQUEST_ID_CHARS = 256
# GenerateRequest fields with presence that map one to one onto SamplingParams keywords
_SCALAR_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "ignore_eos",
                           "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
                           "cache_salt")
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# ---- protobuf <-> engine types (pure functions) ----------------------------------------------------

def sampling_params_from_pb(request: pb.GenerateRequest, tenant_salt: str | None = None) -> SamplingParams:
    """SamplingParams from the set fields (``tenant_salt``: the API key's, router/tenancy.py); raises
    InvalidRequestError for bad values."""
    kw = {name: getattr(request, name) for name in _SCALAR_SAMPLING_FIELDS if request.HasField(name)}
    kw["tenant_salt"] = tenant_salt
    if kw.get("max_tokens", 1) < 1:  # no prompt logprobs here: a request that generates nothing is a mistake
        raise InvalidRequestError(f"max_tokens must be >= 1, got {kw['max_tokens']}")
    fmt = request.WhichOneof("response_format")
    if fmt == "json_schema":
        kw["structured"] = structured_output("json_schema", request.json_schema)
    elif fmt == "json_object" and request.json_object:
        kw["structured"] = structured_output("json_object")
    elif fmt in ("regex", "grammar"):
        kw["structured"] = structured_output(fmt, getattr(request, fmt))
    elif fmt == "choice":
        kw["structured"] = structured_output("choice", json.dumps(list(request.choice.choices)))
    return SamplingParams(stop=tuple(request.stop), stop_token_ids=tuple(request.stop_token_ids),
                          logit_bias=dict(request.logit_bias), **kw)


def prompt_token_ids_from_pb(request: pb.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """The prompt as token ids: text is encoded with special tokens, a chat is templated (the template
    supplies BOS) and encoded without them, token ids pass through. Raises InvalidRequestError."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        if not request.text:
            raise InvalidRequestError("the prompt is empty")
        return tokenizer.encode(request.text)
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "chat":  # plain chats; with tools or a thinking template, router/grpc/chat.py renders it
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        return tokenizer.encode_chat(messages, add_generation_prompt=True)
    raise InvalidRequestError("the request has no prompt: set one of text, token_ids or chat")


def response_from_output(out: RequestOutput) -> pb.GenerateResponse:
    """One engine step's output as a GenerateResponse; finish_reason, stop_reason and usage on the last."""
    msg = pb.GenerateResponse(request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text,
                              logprobs=out.new_logprobs)
    if any(out.new_top_logprobs):  # logprobs=0 yields empty dicts: nothing to send
        msg.top_logprobs.extend(_top_logprobs_pb(top) for top in out.new_top_logprobs)
    if out.finished:
        msg.finish_reason = out.finish_reason or ""
        if isinstance(out.stop_reason, str):
            msg.stop_string = out.stop_reason
        elif isinstance(out.stop_reason, int):
            msg.stop_token_id = out.stop_reason
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                                    cached_tokens=out.num_cached_tokens))
    return msg


def _top_logprobs_pb(top: dict[int, float]) -> pb.TopLogprobs:
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    return pb.TopLogprobs(entries=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in ranked])


def _status_of(e: DuetError) -> grpc.StatusCode:
    """One status per condition (router/admission.py's table); anything else the caller got wrong."""
    if isinstance(e, (OverloadedError, LoraAdaptersBusyError)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(e, (QueueTimeoutError, DeadlineExceededError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(e, NoWorkersError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(e, LoraAdapterNotFoundError):  # unloaded between the check and the admission
        return grpc.StatusCode.NOT_FOUND
    return grpc.StatusCode.INVALID_ARGUMENT


# ---- the servicer ----------------------------------------------------------------------------------

class GenerateServicer(LoraAdminRpcs, pb_grpc.GenerateServicer):
    def __init__(self, backend: Backend, salt_by_api_key: bool = False, tool_call_parser: str | None = None, *,
                 api_keys: Sequence[str] = (), admin_key: str | None = None, bind_host: str = "127.0.0.1") -> None:
        self.backend = backend
        self.salt_by_api_key = salt_by_api_key
        self.tool_call_parser = tool_call_parser
        self.api_keys, self.admin_key, self.bind_host = tuple(api_keys), admin_key, bind_host  # the LoRA RPCs' rule

    @functools.cached_property
    def chat_format(self) -> ChatFormat:
        return ChatFormat.of(self.backend.tokenizer, self.tool_call_parser)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
                         ) -> pb.ListModelsResponse:
        card = self.backend.card
        return pb.ListModelsResponse(models=[pb.ModelInfo(  # the base, then the LoRA adapters served now
            id=name, max_model_len=card.max_model_len, vocab_size=card.vocab_size, created=card.created,
            parent="" if name == card.model_id else card.model_id)
            for name in (card.model_id, *self.backend.lora_adapters())])

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        try:
            if request.model not in ("", self.backend.card.model_id) and self.backend.lora is not None:
                # an adapter the resolver finds (router/lora_resolver.py) is loaded on first use
                await self.backend.lora.resolve(request.model)
            request_id, prompt_ids, params, turn = await asyncio.to_thread(self._prepare, request,
                                                                           self._tenant_salt(context))
        except DuetError as e:
            await context.abort(_status_of(e), str(e))
        try:
            async with contextlib.aclosing(self.backend.generate(request_id, prompt_ids, params)) as outputs:
                async for out in outputs:
                    if out.finish_reason == "error":
                        await context.abort(grpc.StatusCode.UNAVAILABLE,
                                            f"request {request_id} failed: {out.error or 'backend error'}")
                    if out.new_token_ids or out.new_text or out.finished:
                        msg = response_from_output(out)
                        await context.write(turn.shape(msg, out) if turn is not None else msg)
        except DuetError as e:  # the backend refused it before the first output (or timed it out)
            await context.abort(_status_of(e), str(e))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:
            log.exception("request %s: backend raised", request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"request {request_id}: {type(e).__name__}: {e}")

    def _tenant_salt(self, context: grpc.aio.ServicerContext) -> str | None:
        """The API key's salt when salting by key (the interceptor let only keyed calls through)."""
        if not self.salt_by_api_key:
            return None
        return tenant_salt(metadata_bearer(context.invocation_metadata() or ()) or "")

    def _prepare(self, request: pb.GenerateRequest, tenant_salt: str | None = None
                 ) -> tuple[str, list[int], SamplingParams, ChatTurn | None]:
        """Validate and tokenize (on a worker thread); raises InvalidRequestError. A chat is rendered and its
        output shaped as on the HTTP path (router/grpc/chat.py)."""
        card, adapters = self.backend.card, self.backend.lora_adapters()
        if request.model and request.model != card.model_id and request.model not in adapters:
            served = ", ".join(repr(n) for n in (card.model_id, *adapters))
            raise InvalidRequestError(f"unknown model {request.model!r}; this server serves {served}")
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        params = sampling_params_from_pb(request, tenant_salt)
        if request.model in adapters:  # a LoRA adapter's name: the request runs with it
            params = dataclasses.replace(params, lora=request.model)
        turn = None
        if request.WhichOneof("prompt") == "chat" and ChatTurn.needed(request, self.chat_format):
            turn = ChatTurn.of(request, card.model_id, self.chat_format)
            prompt_ids, params = turn.prompt_ids, turn.params(params)
        else:
            prompt_ids = prompt_token_ids_from_pb(request, self.backend.tokenizer)
        self.backend.check_request(prompt_ids, params)
        return request_id, prompt_ids, params, turn


# ---- API keys --------------------------------------------------------------------------------------

class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls to `protected_service` without `authorization: Bearer <one of api_keys>`."""

    def __init__(self, api_keys: Iterable[str], protected_service: str = SERVICE_NAME) -> None:
        self._keys = tuple(k.encode() for k in api_keys)
        if not self._keys or not all(self._keys):
            raise ValueError("api_keys must be non-empty strings")
        self._prefix = f"/{protected_service}/"
        self._own_check = {f"{self._prefix}{m}" for m in ADMIN_METHODS}  # the admin-key rule (router/grpc/lora.py)

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefix) or method in self._own_check:
            return handler
        if self.is_authorized(handler_call_details.invocation_metadata or ()):
            return handler
        return _rejecting_handler(handler, "missing or invalid API key (send 'authorization: Bearer <key>')")

    def is_authorized(self, metadata: Sequence[tuple[str, str | bytes]]) -> bool:
        token = metadata_bearer(metadata)
        if token is None:
            return False
        # constant-time per key, and no early exit: timing says nothing about the keys
        return sum(hmac.compare_digest(token.encode(), k) for k in self._keys) > 0


_HANDLER_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def _rejecting_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that fails every call with UNAUTHENTICATED."""
    async def reject(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    for kind, factory in _HANDLER_FACTORIES.items():
        if getattr(handler, kind) is not None:
            return factory(reject, request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)
    raise TypeError(f"not an RPC method handler: {handler!r}")


# ---- the server ------------------------------------------------------------------------------------

async def start_grpc_server(backend: Backend, host: str = "127.0.0.1", port: int = 50051, *,
                            api_keys: Iterable[str] = (), health_interval_s: float = 5.0,
                            max_request_bytes: int = 4 << 20, salt_by_api_key: bool = False,
                            tool_call_parser: str | None = None, admin_key: str | None = None) -> grpc.aio.Server:
    """Start serving `backend`; returns the started server, with the bound port as ``server.port``
    (port=0 picks a free one). Its ``stop(grace)`` first sets every health status to NOT_SERVING.
    With ``api_keys``, duet.v1.Generate requires one of them (its LoRA RPCs follow the admin-key rule instead:
    ``admin_key``, router/access.py); health and reflection never do.
    ``salt_by_api_key``: each API key is its own prefix-cache domain (router/tenancy.py)."""
    keys = tuple(api_keys)
    if salt_by_api_key and not keys:
        raise ValueError("salt_by_api_key needs api_keys: without keys there are no tenants to tell apart")
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(keys)] if keys else [],
                             options=[("grpc.max_receive_message_length", max_request_bytes)])  # over: RESOURCE_EXHAUSTED
    servicer = GenerateServicer(backend, salt_by_api_key, tool_call_parser, api_keys=keys, admin_key=admin_key,
                                bind_host=host)
    pb_grpc.add_GenerateServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound_port = server.add_insecure_port(address)
    except RuntimeError as e:  # grpcio >= 1.50 raises; older versions return 0
        raise OSError(f"gRPC server cannot bind {address}: {e}") from e
    if bound_port == 0:
        raise OSError(f"gRPC server cannot bind {address}")
    await _set_health(health_servicer, backend.health().ok)
    await server.start()
    watcher = asyncio.create_task(_mirror_backend_health(backend, health_servicer, health_interval_s),
                                  name="duet-grpc-health")
    _stop_serving_before_stop(server, health_servicer, watcher)
    server.port = bound_port
    log.info("gRPC front door on %s:%d (%s)", host, bound_port, "API keys" if keys else "no auth")
    return server


async def _set_health(health_servicer: health.aio.HealthServicer, ok: bool) -> None:
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, _SERVING if ok else _NOT_SERVING)


async def _mirror_backend_health(backend: Backend, health_servicer: health.aio.HealthServicer,
                                 interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            ok = backend.health().ok
        except Exception:
            log.exception("backend.health() raised; reporting NOT_SERVING")
            ok = False
        await _set_health(health_servicer, ok)


def _stop_serving_before_stop(server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                              watcher: asyncio.Task) -> None:
    """Wrap this server instance's ``stop`` so health says NOT_SERVING before the listener closes."""
    stop = server.stop

    async def stop_serving(grace: float | None) -> None:
        watcher.cancel()
        await health_servicer.enter_graceful_shutdown()
        await stop(grace)

    server.stop = stop_serving
