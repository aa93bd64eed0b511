"""gRPC chats with tools and reasoning, the HTTP path's code over protobuf: a ``GenerateRequest.chat`` becomes the
chat request /v1/chat/completions would get (router/openai/protocol.py validates it, router/openai/chat_format.py
renders it with the tools), and each engine output is shaped as the HTTP path shapes it
(router/openai/assistant_message.py): ``text`` carries the message's content, ``reasoning`` and ``tool_calls`` their own
fields, and finish_reason is ``tool_calls`` when calls were made (``stop`` for a named tool_choice).

    chat = ChatTurn.of(request, model_id, chat_format)    # InvalidRequestError for a bad chat
    prompt_ids, params = chat.prompt_ids, chat.params(params)
    response = chat.shape(response_from_output(out), out)
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from router.openai.assistant_message import MessageShaper, Shaping
from router.openai.chat_format import ChatFormat
from router.openai.protocol import ChatCompletionRequest


@dataclass
class ChatTurn:
    prompt_ids: list[int]
    shaping: Shaping
    shaper: MessageShaper | None  # None: the text passes as it is (no tools, a template that does not think)

    @staticmethod
    def needed(request, chat: ChatFormat) -> bool:
        """Whether the chat needs the HTTP path's rendering: tools, tool calls in its history, or a template that
        thinks. A plain chat keeps gRPC's own rendering, which passes any role the template accepts."""
        c = request.chat
        return bool(c.tools or c.tool_choice or chat.thinks or any(m.tool_calls or m.tool_call_id for m in c.messages))

    @classmethod
    def of(cls, request, model_id: str, chat: ChatFormat) -> ChatTurn:
        body = _chat_request(request, model_id)
        prompt_ids, shaping = chat.prompt(body)
        return cls(prompt_ids, shaping, shaping.shaper() if shaping.active else None)

    def params(self, params: SamplingParams) -> SamplingParams:
        """The request's own sampling params, with the grammar that enforces its tool calls (if any)."""
        constraint = self.shaping.plan.constraint if self.shaping.plan is not None else None
        if self.shaping.keep_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        if constraint is None:
            return params
        if params.structured is not None:
            raise InvalidRequestError("a response format (json_schema, regex, ...) cannot be combined with tool calls "
                                      "that are enforced (tool_choice required or a tool's name, strict tools, or a "
                                      "model whose template has no tool format)")
        if params.ignore_eos:
            raise InvalidRequestError("ignore_eos cannot be combined with enforced tool calls")
        return dataclasses.replace(params, structured=constraint)

    def shape(self, msg, out: RequestOutput):
        """``msg`` (the output's GenerateResponse) with its text shaped into content, reasoning and calls."""
        if self.shaper is None:
            return msg
        part = self.shaper.part(out.new_text, finished=out.finished)
        if out.finished:
            plan = self.shaping.plan
            if plan is not None and out.finish_reason is not None:
                msg.finish_reason = plan.finish_reason(self.shaper.num_calls, out.finish_reason)
        msg.text, msg.reasoning = part.content, part.reasoning
        for call in part.tool_calls:
            msg.tool_calls.add(id=call["id"], name=call["function"]["name"], arguments=call["function"]["arguments"],
                               index=call["index"])
        return msg


def _chat_request(request, model_id: str) -> ChatCompletionRequest:
    chat = request.chat
    if not chat.messages:
        raise InvalidRequestError("cannot apply the chat template to an empty list of messages")
    messages: list[dict[str, Any]] = []
    for m in chat.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
            message["content"] = m.content or None
        messages.append(message)
    body: dict[str, Any] = {"model": model_id, "messages": messages}
    if chat.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description or None, "parameters": _schema(t), "strict": t.strict}}
            for t in chat.tools]
    if chat.tool_choice:
        body["tool_choice"] = chat.tool_choice if chat.tool_choice in ("none", "auto", "required") else {
            "type": "function", "function": {"name": chat.tool_choice}}
    if chat.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = chat.parallel_tool_calls
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidRequestError(f"chat.{where}: {first['msg']}") from None


def _schema(tool) -> dict | None:
    if not tool.parameters:
        return None
    try:
        schema = json.loads(tool.parameters)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"chat.tools ({tool.name}): parameters is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"chat.tools ({tool.name}): parameters must be a JSON object")
    return schema
