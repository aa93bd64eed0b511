"""The operator's HTTP API on the router's port: /admin/* (the only write path to the pools) and /metrics.

    GET  /admin/workers                 every worker: id, role, state, pid, node, load, KV use per tier, latest stats
    GET  /admin/autoscaler              targets, bounds, pins, the last decisions with their reasons and signals
    GET  /admin/timeline?since=T        the dashboard's time series (cluster/dashboard/timeline.py)
    GET  /admin/access                  what reads and writes need (the dashboard shows its controls by it)
    POST /admin/pools/{prefill|decode}  {"target": n} and/or {"pin": true|false}
    GET  /metrics                       Prometheus text (router/metrics/collector.py); open, like vLLM's

Who may do what (router/access.py, the same for the LoRA endpoints, router/http/lora_admin.py, and gRPC's):
- Reads follow the API-key rule: with API keys configured, a valid API key or the admin key; else open.
- Writes need the admin key (``--admin-key``): none sent is 401, any other key (an API key included) 403.
  With no admin key configured, writes are accepted only when the server is bound to a loopback address
  (the embedded default, 127.0.0.1), and then under the read rule; on any other bind they are refused
  with 403 and a hint.
Errors are OpenAI-style bodies like the rest of the API.
"""
from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from engine.errors import InvalidRequestError
from router.access import Denied, is_loopback, read_denied, write_denied
from router.http.errors import ApiError
from router.routing.policy import Role
from router.workers.registry import WorkerRegistry


class Operator(ABC):
    """What the admin API needs from the cluster (cluster.pools.PoolManager implements it)."""

    registry: WorkerRegistry

    @abstractmethod
    def autoscaler_view(self) -> dict[str, Any]: ...

    @abstractmethod
    def set_target(self, role: Role, target: int | None = None, pin: bool | None = None) -> dict[str, Any]: ...

    def timeline(self, since_s: float) -> list[dict[str, Any]]:
        """The dashboard's time series after ``since_s`` (epoch seconds); none by default."""
        return []


def access_checks(api_keys: Sequence[str] = (), admin_key: str | None = None, bind_host: str = "127.0.0.1"):
    """FastAPI dependencies ``(can_read, can_write)`` enforcing router/access.py's rule (OpenAI-style errors)."""
    def bearer(request: Request) -> str | None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None

    def raise_denied(denied: Denied | None) -> None:
        if denied is not None:
            raise ApiError(401 if denied.unauthenticated else 403, denied.message,
                           "authentication_error" if denied.unauthenticated else "permission_error", code=denied.code)

    async def can_read(request: Request) -> None:
        raise_denied(read_denied(bearer(request), api_keys, admin_key))

    async def can_write(request: Request) -> None:
        raise_denied(write_denied(bearer(request), api_keys, admin_key, bind_host))

    return can_read, can_write


def admin_router(operator: Operator | None, metrics, *, api_keys: Sequence[str] = (), admin_key: str | None = None,
                 bind_host: str = "127.0.0.1") -> APIRouter:
    can_read, can_write = access_checks(api_keys, admin_key, bind_host)

    def need_operator() -> Operator:
        if operator is None:
            raise ApiError(404, "this server runs no worker pools (colocated mode)", code="no_pools")
        return operator

    router = APIRouter()

    @router.get("/admin/workers", dependencies=[Depends(can_read)])
    async def workers() -> dict[str, Any]:
        op, now = need_operator(), time.monotonic()
        return {"object": "list", "data": [r.summary(now) for r in op.registry.records()]}

    @router.get("/admin/autoscaler", dependencies=[Depends(can_read)])
    async def autoscaler() -> dict[str, Any]:
        return need_operator().autoscaler_view()

    @router.get("/admin/timeline", dependencies=[Depends(can_read)])
    async def timeline(since: float = 0.0) -> dict[str, Any]:
        return {"object": "list", "data": need_operator().timeline(since)}

    @router.get("/admin/access")
    async def access() -> dict[str, Any]:
        writes = "admin_key" if admin_key else ("loopback" if is_loopback(bind_host) else "disabled")
        return {"reads": "api_key" if api_keys else "open", "writes": writes, "pools": operator is not None}

    @router.post("/admin/pools/{role}", dependencies=[Depends(can_write)])
    async def set_pool(role: str, request: Request) -> dict[str, Any]:
        op = need_operator()
        if role not in (Role.PREFILL.value, Role.DECODE.value):
            raise ApiError(404, f"no pool {role!r}; pools are 'prefill' and 'decode'", param="role", code="unknown_pool")
        body = await _json_object(request)
        unknown = sorted(set(body) - {"target", "pin"})
        if unknown:
            raise ApiError(400, f"unknown field(s) {unknown}; send 'target' and/or 'pin'", param=unknown[0])
        if not body:
            raise ApiError(400, "send 'target' (an integer) and/or 'pin' (a boolean)")
        pin, target = body.get("pin"), body.get("target")
        if "pin" in body and not isinstance(pin, bool):  # null included: an operator's write says what it means
            raise ApiError(400, f"'pin' must be a boolean, got {json.dumps(pin)}", param="pin")
        if "target" in body and (isinstance(target, bool) or not isinstance(target, int)):
            raise ApiError(400, f"'target' must be an integer, got {json.dumps(target)}", param="target")
        try:
            return op.set_target(Role(role), target, pin)
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param="target") from None

    @router.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        if metrics is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body
