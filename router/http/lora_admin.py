"""vLLM's runtime LoRA endpoints on the OpenAI port, admin-key protected (router/access.py, the rule of /admin/*):

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql", "pinned": false}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

Bodies and answers are vLLM's (``vllm/entrypoints/serve/lora/``): success is 200 with a text body
("Success: LoRA adapter 'sql' added successfully." / "... removed successfully."); a missing ``lora_name`` or
``lora_path``, an adapter already loaded under that name, or one duet cannot serve (router/lora_adapters.py names
the worker and the reason: DoRA, rank over max_lora_rank, max_cpu_loras reached, ...) is 400; an unload of a name not
served, or a load from a path with no directory, 404; a worker that failed, 500. ``pinned`` (duet's, SGLang's name;
optional, default false) keeps the adapter in a device slot for good (engine/lora/manager.py). Unknown fields are
refused by name. An unload answers once the adapter's running requests ended and every worker dropped it; new
requests naming it are 404 from the moment the call arrives (router/lora_adapters.py).
"""
from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from router.backend import Backend
from router.http.errors import ApiError

_FIELDS = {"load": {"lora_name": str, "lora_path": str, "pinned": bool}, "unload": {"lora_name": str}}


def lora_router(backend: Backend, can_write) -> APIRouter:
    """The two endpoints over ``backend.lora`` (``can_write``: router/http/admin.py ``access_checks``)."""
    router = APIRouter()

    def adapters():
        if backend.lora is None:
            raise ApiError(400, "this server cannot load or unload LoRA adapters at run time", "BadRequestError",
                           code="lora_runtime_unsupported")
        return backend.lora

    @router.post("/v1/load_lora_adapter", dependencies=[Depends(can_write)])
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await _body(request, "load")
        await adapters().load(body["lora_name"], body["lora_path"], body.get("pinned", False))
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    @router.post("/v1/unload_lora_adapter", dependencies=[Depends(can_write)])
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await _body(request, "unload")
        await adapters().unload(body["lora_name"])
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    return router


async def _body(request: Request, verb: str) -> dict[str, Any]:
    fields = _FIELDS[verb]
    try:
        body = json.loads(await request.body() or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", "InvalidUserInput") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", "InvalidUserInput")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise ApiError(400, f"unknown field(s) {unknown}; {verb}_lora_adapter takes {sorted(fields)}",
                       "InvalidUserInput", param=unknown[0])
    required = ("lora_name", "lora_path") if verb == "load" else ("lora_name",)
    if not all(body.get(k) for k in required):
        raise ApiError(400, f"{' and '.join(repr(k) for k in required)} must be provided", "InvalidUserInput",
                       param=next(k for k in required if not body.get(k)))
    for key, kind in fields.items():
        if key in body and not isinstance(body[key], kind):
            raise ApiError(400, f"{key!r} must be a {kind.__name__}, got {json.dumps(body[key])}", "InvalidUserInput",
                           param=key)
    return body
