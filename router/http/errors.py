"""The HTTP front door's requests and errors: body parsing and limits, API keys, OpenAI error bodies.

Errors are always OpenAI bodies ``{"error": {message, type, param, code}}``: bad JSON, bad UTF-8, bad
types and values are 400 (FastAPI's 422 included), an unknown model or LoRA adapter 404, a missing or wrong key 401,
overload 429 with Retry-After, queue timeout 408, deadline 504, no workers 503 (router/admission.py's
table); only a genuine fault is a 500, and it is logged. The server keeps the connection after a 500.
"""
from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import InvalidRequestError, LoraAdapterError, LoraAdapterNotFoundError, LoraAdaptersBusyError
from router.admission import DeadlineExceededError, OverloadedError, QueueTimeoutError
from router.openai.base import BadRequest, error_body
from router.openai.protocol import GenerationRequest
from router.routing.policy import NoWorkersError
from router.tenancy import bearer_token

log = logging.getLogger(__name__)

_Body = TypeVar("_Body", bound=GenerationRequest)
CLIENT_GONE_STATUS = 499  # nginx's "client closed request"; nobody reads it


class ApiError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = error_body(message, type, param, code)
        self.headers = headers or {}


class ClientGone(Exception):
    """The client closed the connection."""


class ClientTooSlow(Exception):
    """The client stopped reading a streamed response: its buffered outputs passed MAX_BUFFERED_OUTPUTS."""


async def parse_body(request: Request, model: type[_Body], max_bytes: int) -> _Body:
    raw = await read_body(request, max_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the request body is not valid UTF-8") from None
    try:  # parsed here too, only to tell malformed JSON from a wrong field in the message
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("the request body nests too deeply") from None
    if not isinstance(parsed, dict):
        raise BadRequest("the request body must be a JSON object")
    return model.model_validate_json(text, strict=True)  # strict JSON mode: "5" is not an integer


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, or 413 as soon as it is known to be over ``max_bytes`` (never read whole into memory)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body is {declared} bytes; the limit is {max_bytes}", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"the request body is over the limit of {max_bytes} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def api_key_check(api_keys: Sequence[str]):
    keys = [k.encode() for k in api_keys]

    async def check(request: Request) -> None:
        if not keys:
            return
        token = bearer_token(request.headers.get("authorization", ""))
        if token is None or not any(hmac.compare_digest(token.encode(), k) for k in keys):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "authentication_error", code="invalid_api_key")

    return check


def error_response(exc: Exception) -> tuple[int, dict[str, Any]]:
    """(status, OpenAI error body) for any exception; logs the ones that are our fault."""
    exc = _as_api_error(exc)
    if isinstance(exc, ApiError):
        return exc.status_code, exc.body
    if isinstance(exc, ClientGone):
        return CLIENT_GONE_STATUS, error_body("the client closed the connection", code="client_closed")
    if isinstance(exc, InvalidRequestError):
        return 400, error_body(str(exc), param=getattr(exc, "param", None))
    if isinstance(exc, (ValidationError, RequestValidationError)):
        return 400, _validation_error_body(exc.errors())
    if isinstance(exc, StarletteHTTPException):
        return exc.status_code, error_body(str(exc.detail), "invalid_request_error", code=str(exc.status_code))
    log.error("internal error while serving a request", exc_info=exc)
    return 500, error_body(f"internal server error: {type(exc).__name__}", "server_error", code="internal_error")


def _as_api_error(exc: Exception) -> Exception:
    """The front door's one status per overload/timeout condition (router/admission.py's table)."""
    if isinstance(exc, OverloadedError):
        return ApiError(429, str(exc), "rate_limit_error", code="overloaded",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, QueueTimeoutError):
        return ApiError(408, str(exc), "timeout_error", code="queue_timeout")
    if isinstance(exc, DeadlineExceededError):
        return ApiError(504, str(exc), "timeout_error", code="deadline_exceeded")
    if isinstance(exc, NoWorkersError):
        return ApiError(503, str(exc), "server_error", code="no_workers")
    if isinstance(exc, ClientTooSlow):
        return ApiError(408, str(exc), "timeout_error", code="client_too_slow")
    if isinstance(exc, LoraAdaptersBusyError):  # a resolver's adapter, and no room for it now
        return ApiError(429, str(exc), "rate_limit_error", code="lora_adapters_busy",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, LoraAdapterNotFoundError):  # vLLM's NotFoundError (an adapter unloaded, or never there)
        return ApiError(404, str(exc), "NotFoundError", code="lora_adapter_not_found")
    if isinstance(exc, LoraAdapterError):
        return ApiError(400, str(exc), "BadRequestError", code="lora_adapter_error")
    return exc


def error_headers(exc: Exception) -> dict[str, str]:
    """Headers an error response must carry: Retry-After on 429, Allow on 405."""
    exc = _as_api_error(exc)
    if isinstance(exc, ApiError):
        return exc.headers
    if isinstance(exc, StarletteHTTPException):
        return dict(exc.headers or {})
    return {}


def _validation_error_body(errors: Sequence[Any]) -> dict[str, Any]:
    def where(error: Any) -> str:
        return ".".join(str(part) for part in error.get("loc", ()) if part != "body")

    described = "; ".join(f"{where(e) or 'body'}: {e.get('msg', 'invalid')}" for e in errors[:3])
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    # param names the top-level field: deeper locations hold pydantic's union tags ("stop.str")
    param = where(errors[0]).split(".")[0] if errors else None
    return error_body(f"invalid request: {described}{more}", param=param or None)


def health_error(message: str, detail: dict[str, Any]) -> dict[str, Any]:
    return {**detail, "status": "unavailable", **error_body(message, "server_error", code="unhealthy")}


def install_error_handlers(app: FastAPI) -> None:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        status, body = error_response(exc)
        return JSONResponse(body, status_code=status, headers=error_headers(exc))

    for exc_class in (ApiError, ClientGone, InvalidRequestError, ValidationError, RequestValidationError,
                      StarletteHTTPException, OverloadedError, QueueTimeoutError, DeadlineExceededError,
                      NoWorkersError):
        app.add_exception_handler(exc_class, handle)
    app.add_middleware(_InternalErrorMiddleware)


class _InternalErrorMiddleware:
    """Answers an unexpected exception with a 500 OpenAI body and keeps the connection.

    Starlette's own catch-all re-raises after answering, which makes the server drop the keep-alive
    connection; a client that pools connections then sees its next request reset.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:  # too late for a status: let the server close the connection
                raise
            status, body = error_response(exc)
            await JSONResponse(body, status_code=status, headers=error_headers(exc))(scope, receive, send)
