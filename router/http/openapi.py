"""The published OpenAPI document (/openapi.json) describes what the server really accepts and answers.

The generation endpoints read their JSON themselves (to tell malformed JSON, bad UTF-8 and wrong fields
apart with OpenAI-style errors), so FastAPI alone would publish them without a request body. This adds the
request models' JSON schemas as the bodies, and every status each operation can answer with the error body
they carry — so a schema-driven fuzzer (schemathesis) reaches the real code paths and can check that
nothing undocumented comes back.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from router.http.responses_api import ResponsesRequest
from router.openai.protocol import ChatCompletionRequest, CompletionRequest

_ERROR = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ERROR_STATUSES = {
    "400": "invalid request (malformed JSON or UTF-8, wrong types or values, prompt too long, ...)",
    "401": "missing or wrong API key",
    "403": "this key may not do that (admin writes)",
    "404": "unknown model, pool or route",
    "405": "method not allowed (the Allow header lists the right one)",
    "408": "waited too long for an admission slot, or the client stopped reading",
    "413": "request body over the limit",
    "429": "overloaded: retry after the Retry-After header's seconds",
    "503": "no worker can serve it, or generation failed",
    "504": "the request ran past its deadline",
}
_GENERATION = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
               "/v1/responses": ResponsesRequest}


def _null_means_default(schema: dict[str, Any]) -> dict[str, Any]:
    """The request models treat ``"field": null`` as the field left out (OpenAI clients send nulls), so every
    optional property also accepts null."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required:
            continue
        variants = prop.get("anyOf", [prop])
        if not any(v.get("type") == "null" for v in variants):
            kept = {k: prop.pop(k) for k in ("default", "title", "description") if k in prop}
            schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **kept}
    return schema


_NAME = {"type": "string", "minLength": 1}
_LORA_BODIES = {
    "/v1/load_lora_adapter": {"type": "object", "additionalProperties": False, "required": ["lora_name", "lora_path"],
                              "properties": {"lora_name": _NAME, "lora_path": _NAME, "pinned": {"type": "boolean"}}},
    "/v1/unload_lora_adapter": {"type": "object", "additionalProperties": False, "required": ["lora_name"],
                                "properties": {"lora_name": _NAME}},
}


def document(app: FastAPI, model_names: Callable[[], list[str]], resolves: bool = False) -> None:
    """Replace ``app.openapi`` with one that publishes request bodies and error responses. ``model_names()``: the
    names this server answers to now (valid requests name one; anything else is a 404): the document is made again
    when they change (LoRA adapters loaded and unloaded at run time). ``resolves``: a LoRA resolver may load other
    names on first use (router/lora_resolver.py), so ``model`` is any string, the served names its examples."""

    def openapi() -> dict[str, Any]:
        names = list(model_names())
        if app.openapi_schema and app.openapi_schema.get("x-duet-models") == names:
            return app.openapi_schema
        name_schema = ({"type": "string", "examples": names, "description": "a served model or LoRA adapter, or "
                        "an adapter the server's resolver finds (404 when it does not)"} if resolves
                       else {"type": "string", "enum": names})
        schema = get_openapi(title=app.title, version="1", summary=app.summary, routes=app.routes)
        schema["x-duet-models"] = names
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["ErrorResponse"] = _ERROR
        for path, model in _GENERATION.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            body["properties"]["model"] = {**name_schema, "title": "Model"}
            for name, part in {**body.pop("$defs", {}), model.__name__: body}.items():
                components[name] = _null_means_default(part)
            operation = schema["paths"][path]["post"]
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            operation["responses"] = {"200": {"description": "the completion (JSON), or server-sent events with "
                                                             "\"stream\": true", "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {"type": "object", "properties": {"data": {"type": "string"}}}}}}}
        for parameter in schema["paths"]["/v1/models/{model_id}"]["get"].get("parameters", []):
            if parameter["name"] == "model_id":
                parameter["schema"] = {"type": "string", "enum": names}
        pools = schema["paths"].get("/admin/pools/{role}", {}).get("post")
        if pools is not None:
            for parameter in pools.get("parameters", []):
                if parameter["name"] == "role":
                    parameter["schema"] = {"type": "string", "enum": ["prefill", "decode"]}
            pools["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False, "minProperties": 1,
                "properties": {"target": {"type": "integer", "minimum": 0}, "pin": {"type": "boolean"}}}}}}
        for path, body in _LORA_BODIES.items():  # router/http/lora_admin.py: vLLM's bodies, a text answer
            operation = schema["paths"].get(path, {}).get("post")
            if operation is not None:
                operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
                operation["responses"] = {"200": {"description": "Success: ...", "content": {
                    "text/plain": {"schema": {"type": "string"}}}}}
        if "/metrics" in schema["paths"]:
            schema["paths"]["/metrics"]["get"]["responses"]["200"] = {
                "description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}
        for methods in schema["paths"].values():
            for operation in methods.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)  # validation errors are 400 here, with an OpenAI body
                for status, why in _ERROR_STATUSES.items():
                    responses.setdefault(status, {"description": why, "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
