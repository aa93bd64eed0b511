"""The operator's HTTP API on the router's port: /admin/* (the only write path to the pools) and /metrics.

    GET  /admin/workers                 every worker: id, role, state, pid, node, load, KV use per tier, latest stats
    GET  /admin/autoscaler              targets, bounds, pins, the last decisions with their reasons and signals
    GET  /admin/timeline?since=T        the dashboard's time series (cluster/dashboard/timeline.py)
    GET  /admin/access                  what reads and writes need (the dashboard shows its controls by it)
    POST /admin/pools/{prefill|decode}  {"target": n} and/or {"pin": true|false}
    GET  /metrics                       Prometheus text (router/metrics/collector.py); open, like vLLM's

Who may do what:
- Reads follow the API-key rule: with API keys configured, a valid API key or the admin key; else open.
- Writes need the admin key (``--admin-key``): none sent is 401, any other key (an API key included) 403.
  With no admin key configured, writes are accepted only when the server is bound to a loopback address
  (the embedded default, 127.0.0.1), and then under the read rule; on any other bind they are refused
  with 403 and a hint.
Errors are OpenAI-style bodies like the rest of the API.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from engine.errors import InvalidRequestError
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


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def admin_router(operator: Operator | None, metrics, *, api_keys: Sequence[str] = (), admin_key: str | None = None,
                 bind_host: str = "127.0.0.1") -> APIRouter:
    api = [k.encode() for k in api_keys]
    admin = admin_key.encode() if admin_key else None

    def bearer(request: Request) -> bytes | None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return token.strip().encode() if scheme.lower() == "bearer" and token.strip() else None

    def matches(given: bytes | None, keys: Sequence[bytes]) -> bool:
        return given is not None and any(hmac.compare_digest(given, k) for k in keys)

    async def can_read(request: Request) -> None:
        if api and not matches(bearer(request), [*api, *([admin] if admin else [])]):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "authentication_error", code="invalid_api_key")

    async def can_write(request: Request) -> None:
        given = bearer(request)
        if admin is None:
            if not is_loopback(bind_host):
                raise ApiError(403, "admin writes are disabled: this server is not bound to a loopback address and "
                               "has no admin key (start it with --admin-key)", "permission_error",
                               code="admin_disabled")
            await can_read(request)  # a write never needs less than a read
            return
        if given is None:
            raise ApiError(401, "admin key required (send 'Authorization: Bearer <admin key>')",
                           "authentication_error", code="missing_admin_key")
        if not matches(given, [admin]):
            raise ApiError(403, "this key may not change the cluster (the admin key is required)", "permission_error",
                           code="not_admin")

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
        writes = "admin_key" if admin else ("loopback" if is_loopback(bind_host) else "disabled")
        return {"reads": "api_key" if api else "open", "writes": writes, "pools": operator is not None}

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
