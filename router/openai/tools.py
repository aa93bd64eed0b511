"""Tool calling on /v1/chat/completions, the request side: ``tools``, ``tool_choice``, ``parallel_tool_calls``, and
the history's assistant ``tool_calls`` and ``role: "tool"`` messages as the chat template expects them.

    plan = ToolPlan.of(tools, tool_choice, parallel_tool_calls, fmt)    # None without tools
    messages, template_tools = plan.template_input(messages)             # what the chat template renders
    plan.constraint                                                      # the grammar holding the output, or None

Modes, as OpenAI defines them and vLLM enforces them:
- ``none``: a message; the tools still reach the template, calls are not parsed.
- ``auto``: the model decides; calls are parsed from its text in the template's format (router/openai/tool_parsers.py).
  When a tool is ``strict`` and the format has a start marker (hermes), its calls are enforced by a lazy
  grammar: free text until ``<tool_call>``, then that tool's arguments schema (llguidance structural tags).
- ``required``: at least one call, enforced: the output is a JSON array of ``{"name", "parameters"}`` objects,
  each valid against its tool (exactly one when ``parallel_tool_calls`` is false) — vLLM's schema. A list that
  may hold several calls ends at its first repeated call (``CallListOutput``: engine/sampling/call_lists.py).
- named (``{"type": "function", "function": {"name": …}}``): that call, enforced: the output is its arguments.
finish_reason is ``tool_calls`` when calls were made, ``stop`` for a named call (OpenAI's rule).

The **generic format** (templates that render no tools, SmolLM2's): the tools are described in a system message;
earlier calls and answers are written back as the JSON the model writes, tool results as user messages; every
mode is enforced by one JSON schema — ``{"tool_calls": [...]}``, and for ``auto`` ``{"response": "…"}`` as the
alternative. Any model then calls tools parseably (a weak model's calls are well-formed, not necessarily wise).

A tool's ``parameters`` schema is checked like a ``json_schema`` response format (a 400 naming the tool);
embedded in a bigger schema, its ``$defs`` / ``definitions`` move to the root under the tool's name and its local
``$ref`` s follow them.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from engine.errors import InvalidRequestError
from engine.request import StructuredOutput
from engine.sampling.call_lists import CallListOutput
from engine.sampling.structured import check_structured_output, generation_schema, structured_output
from router.openai.base import BadRequest, StrictModel
from router.openai.tool_parsers import ToolFormat

log = logging.getLogger(__name__)

TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's
MAX_TOOLS = 128  # OpenAI's
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
COMPACT = (",", ":")


class FunctionDef(StrictModel):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    fmt: ToolFormat
    tools: tuple[ToolDef, ...]
    named: str | None
    parallel: bool
    constraint: StructuredOutput | None

    @classmethod
    def of(cls, tools: list[ToolDef] | None, tool_choice: ToolChoice | None, parallel: bool,
           fmt: ToolFormat) -> ToolPlan | None:
        if not tools:
            if tool_choice not in (None, "none"):
                raise BadRequest("tool_choice needs tools", "tool_choice")
            return None
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise BadRequest(f"tool names must be unique: {sorted(n for n in set(names) if names.count(n) > 1)}",
                             "tools")
        for i, tool in enumerate(tools):
            _check_parameters(i, tool)
        named = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else None
        if named is not None and named not in names:
            raise BadRequest(f"tool_choice names {named!r}, which is not among the tools ({', '.join(names)})",
                             "tool_choice")
        mode = "named" if named else (tool_choice or "auto")
        plan = cls(mode, fmt, tuple(tools), named, parallel, None)
        return dataclasses.replace(plan, constraint=plan._constraint())

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"

    @property
    def metric_mode(self) -> str:
        """The mode as ``duet_tool_requests`` counts it: auto with strict tools is told apart, enforced or not."""
        if self.mode != "auto" or not any(t.function.strict for t in self.tools):
            return self.mode
        return "auto_strict" if self.constraint is not None else "auto_strict_parsed"

    def finish_reason(self, num_calls: int, engine_reason: str | None) -> str | None:
        if num_calls and engine_reason == "stop":
            return "stop" if self.mode == "named" else "tool_calls"
        return engine_reason

    # ---- the grammar ------------------------------------------------------------------------------------
    def _constraint(self) -> StructuredOutput | None:
        tools = [t for t in self.tools if self.named is None or t.function.name == self.named]
        many = self.parallel and self.mode != "named"  # a list of calls that may hold several
        if not self.fmt.native:
            return None if self.mode == "none" else \
                _schema(_generic_schema(tools, self.mode, self.parallel), list_depth=1 if many else None)
        if self.mode == "named":
            return _schema(_embedded({tools[0].function.name: _parameters(tools[0])}, lambda p: next(iter(p.values()))))
        if self.mode == "required":
            return _schema(_required_schema(tools, self.parallel), list_depth=0 if many else None)
        if self.mode == "auto" and any(t.function.strict for t in tools):
            return _strict_auto(tools, self.fmt)
        return None

    # ---- the prompt -------------------------------------------------------------------------------------
    def template_input(self, messages: list[dict[str, Any]], placement: str = "system"
                       ) -> tuple[list[dict[str, Any]], list[dict] | None]:
        """The messages (assistant calls with their arguments as objects) and the tools, as the template takes
        them; in the generic format the tools are described in a system message (``placement="user"``: at the
        head of the first user message, for templates that refuse system messages) and the history is its JSON."""
        if self.fmt.native:
            return messages, [t.model_dump(exclude_none=True) for t in self.tools]
        return _generic_messages(messages, self.tools, self.mode, placement), None


def history_message(role: str, tool_calls: list[ToolCall] | None, where: str) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` as templates read them: arguments parsed to objects (vLLM's)."""
    if not tool_calls:
        return {}
    if role != "assistant":
        raise BadRequest(f"{where}.tool_calls: only assistant messages carry tool calls", "messages")
    calls = []
    for j, call in enumerate(tool_calls):
        try:
            args = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise BadRequest(f"{where}.tool_calls[{j}].function.arguments is not JSON: {e}", "messages") from None
        if not isinstance(args, dict):
            raise BadRequest(f"{where}.tool_calls[{j}].function.arguments must be a JSON object", "messages")
        calls.append({"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}})
    return {"tool_calls": calls}


def _check_parameters(i: int, tool: ToolDef) -> None:
    try:
        structured_output("json_schema", json.dumps(_parameters(tool)))
    except InvalidRequestError as e:
        raise BadRequest(f"tools[{i}].function.parameters ({tool.function.name}): {e}", "tools") from None


def _parameters(tool: ToolDef) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else EMPTY_PARAMETERS


def _schema(schema: dict[str, Any], list_depth: int | None = None) -> StructuredOutput:
    """The checked spec; ``list_depth``: a list of calls at that depth, ended at its first repeated call."""
    if list_depth is None:
        return structured_output("json_schema", json.dumps(schema))
    spec = CallListOutput("json_schema", json.dumps(schema), list_depth)
    check_structured_output(spec)
    return spec


def _required_schema(tools: list[ToolDef], parallel: bool) -> dict[str, Any]:
    def item(p: dict[str, dict]) -> dict[str, Any]:
        return {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                            "parameters": schema},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for name, schema in p.items()]}

    items = _embedded({t.function.name: _parameters(t) for t in tools}, item)
    defs = items.pop("$defs", None)
    return {"type": "array", "items": items, "minItems": 1, **({} if parallel else {"maxItems": 1})} | \
        ({"$defs": defs} if defs else {})


def _generic_schema(tools: list[ToolDef], mode: str, parallel: bool) -> dict[str, Any]:
    def calls(p: dict[str, dict]) -> dict[str, Any]:
        item = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                           "required": ["name", "arguments"], "additionalProperties": False}
                          for name, schema in p.items()]}
        many = parallel and mode != "named"
        return {"type": "object", "properties": {"tool_calls": {"type": "array", "items": item, "minItems": 1,
                                                                **({} if many else {"maxItems": 1})}},
                "required": ["tool_calls"], "additionalProperties": False}

    doc = _embedded({t.function.name: _parameters(t) for t in tools}, calls)
    if mode != "auto":
        return doc
    defs = doc.pop("$defs", None)
    response = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                "additionalProperties": False}
    return {"anyOf": [doc, response]} | ({"$defs": defs} if defs else {})


def _embedded(params: dict[str, dict], build) -> dict[str, Any]:
    """``build`` over the tools' parameter schemas, each with its ``$defs`` / ``definitions`` hoisted to the root
    as ``<tool>.<name>`` and its local references rewritten to them."""
    defs: dict[str, Any] = {}
    moved = {}
    for name, schema in params.items():
        schema = dict(schema)
        local = {**schema.pop("definitions", {}), **schema.pop("$defs", {})}
        for key, value in local.items():
            defs[f"{name}.{key}"] = _rewrite_refs(value, name)
        moved[name] = _rewrite_refs(schema, name)
    out = build(moved)
    return {**out, "$defs": {**out.get("$defs", {}), **defs}} if defs else out


def _rewrite_refs(node, tool: str):
    if isinstance(node, list):
        return [_rewrite_refs(n, tool) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str):
            for prefix in ("#/$defs/", "#/definitions/"):
                if value.startswith(prefix):
                    value = f"#/$defs/{tool}.{value[len(prefix):]}"
                    break
            else:
                raise BadRequest(f"tools: {tool}'s parameters use $ref {value!r}; only references to its own $defs "
                                 "or definitions are supported", "tools")
            out[key] = value
        else:
            out[key] = _rewrite_refs(value, tool)
    return out


def _strict_auto(tools: list[ToolDef], fmt: ToolFormat) -> StructuredOutput | None:
    """auto with strict tools: free text, and each call after the format's start marker held to its tool's
    schema (llguidance structural tags; hermes's payload shape)."""
    if fmt.name != "hermes":
        log.warning("strict tools with tool_choice auto are not enforced in the %s format (parsed only)", fmt.name)
        return None
    from llguidance import StructTag  # the router's grammar library (engine/sampling/structured.py checks the result)

    tags = [StructTag(trigger="<tool_call>", begin=f'<tool_call>\n{{"name": "{t.function.name}", "arguments": ',
                      grammar=generation_schema(_parameters(t)), end="}\n</tool_call>") for t in tools]
    try:
        return structured_output("grammar", StructTag.to_grammar(tags, assume_special=False))
    except InvalidRequestError as e:
        raise BadRequest(f"tools: the strict calls cannot be enforced: {e}", "tools") from None


def _untitled(node):
    """A schema without its ``title`` strings (pydantic writes one per field: noise in a prompt, not a constraint)."""
    if isinstance(node, list):
        return [_untitled(n) for n in node]
    if not isinstance(node, dict):
        return node
    return {k: _untitled(v) for k, v in node.items() if not (k == "title" and isinstance(v, str))}


def _generic_messages(messages: list[dict[str, Any]], tools: tuple[ToolDef, ...], mode: str,
                      placement: str) -> list[dict]:
    """The generic format's prompt: a system message listing the tools and the answer's shape; earlier calls and
    answers as the JSON the model writes; a run of tool results as one user message (templates without tools
    reject ``role: tool`` or render it as a role the model never saw; some insist that roles alternate). With
    ``tool_choice: none`` the model answers in words: the history's calls and results stay readable, the tools
    are not offered."""
    listing = json.dumps([{"name": t.function.name, "description": t.function.description or "",
                           "parameters": _untitled(_parameters(t))} for t in tools], ensure_ascii=False)
    shape = ('{"tool_calls": [{"name": <tool name>, "arguments": <its arguments>}]} to call tools'
             + ('' if mode != "auto" else ', or {"response": <your answer>} to answer'))
    system = f"You can use these tools:\n{listing}\nAnswer with a JSON object: {shape}."
    out = []
    names = {}
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant" and (m.get("tool_calls") or m.get("content") is not None and mode != "none"):
            doc = {}
            if m.get("tool_calls"):
                for c in m["tool_calls"]:
                    names[c["id"]] = c["function"]["name"]
                doc["tool_calls"] = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                     for c in m.pop("tool_calls")]
            if m.get("content"):
                doc["response"] = m["content"]
            m["content"] = json.dumps(doc, ensure_ascii=False, separators=COMPACT)
        elif m["role"] == "tool":
            result = {"tool_call_id": m.get("tool_call_id"), "name": names.get(m.get("tool_call_id")),
                      "content": m.get("content")}
            if out and out[-1].get("tool_results") is not None:
                out[-1]["tool_results"].append(result)
                continue
            m = {"role": "user", "tool_results": [result]}
        out.append(m)
    for m in out:
        if "tool_results" in m:
            m["content"] = json.dumps({"tool_results": m.pop("tool_results")}, ensure_ascii=False)
    if mode == "none":
        return out
    if placement == "user":
        first = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
        if first is not None:
            out[first] = {**out[first], "content": f"{system}\n\n{out[first].get('content') or ''}"}
            return out
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}".strip()}, *out[1:]]
    return [{"role": "system", "content": system}, *out]
