"""POST /v1/responses, the stateless subset, as a translation onto the chat path (Dynamo's approach): the request
becomes a chat completion (instructions → a system message; input messages, ``function_call`` and
``function_call_output`` items → assistant tool calls and tool messages; ``text.format`` → ``response_format``;
``max_output_tokens`` → ``max_completion_tokens``), runs exactly as one, and its shaped message
(router/openai/assistant_message.py) comes back as Responses output items — ``reasoning``, ``message``,
``function_call`` — in a response object, or as OpenAI's streaming events (``response.created`` …
``response.completed``, each with its ``sequence_number``; no ``[DONE]``).

Nothing is stored: ``store: true`` and ``previous_response_id`` are refused with a 400 (a client that omits
``store`` gets an unstored response — duet keeps no conversation state), and so are fields whose meaning we
cannot honour (``include``, ``background``, ``conversation``, ``truncation: "auto"``, ``reasoning``). Reasoning
items a client sends back are dropped, as chat templates drop earlier turns' thinking.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from router.http.choice_streams import SSE_HEADERS, ChoiceRun
from router.http.errors import ClientGone, error_response
from router.openai.assistant_message import MessagePart, MessageShaper
from router.openai.base import BadRequest, StrictModel
from router.openai.protocol import ChatCompletionRequest
from router.openai.response_builder import ChoiceState
from router.openai.tools import MAX_TOOLS, FunctionDef

REFUSED = {"previous_response_id": "duet keeps no conversation state: send the whole input",
           "conversation": "duet keeps no conversation state: send the whole input",
           "background": "background responses need stored state, which duet does not keep",
           "reasoning": "reasoning effort has no equivalent here (chat_template_kwargs can switch thinking)"}


class FunctionTool(FunctionDef):
    """The Responses API's function tool: chat's function, flat, with its type beside it."""

    type: Literal["function"]


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None


class ResponsesRequest(StrictModel):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # extension (as on chat): fixes sampling
    logit_bias: dict[str, float] | None = None  # extension (as on chat): token id (a string) -> bias
    stream: bool = False
    store: bool | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    reasoning: Any = None

    def chat_body(self) -> ChatCompletionRequest:
        """The chat completion this response runs as; BadRequest for what the stateless subset cannot do."""
        if self.store:
            raise BadRequest("store: true is not supported: duet keeps no responses (omit it, or send false)", "store")
        for name, why in REFUSED.items():
            if getattr(self, name) not in (None, False):
                raise BadRequest(f"{name} is not supported: {why}", name)
        if self.include:
            raise BadRequest(f"include is not supported ({', '.join(self.include)})", "include")
        if self.truncation == "auto":
            raise BadRequest("truncation 'auto' is not supported: a prompt over the context is a 400", "truncation")
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "stream": self.stream,
                                "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = {"type": fmt.type} | ({"json_schema": {
                "name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}} if fmt.type == "json_schema"
                else {})
        for ours, theirs in (("max_completion_tokens", self.max_output_tokens), ("temperature", self.temperature),
                             ("top_p", self.top_p), ("seed", self.seed), ("logit_bias", self.logit_bias)):
            if theirs is not None:
                body[ours] = theirs
        return ChatCompletionRequest.model_validate(json.loads(json.dumps(body)), strict=True)

    def _messages(self) -> list[dict[str, Any]]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            kind = item.get("type", "message")
            where = f"input[{i}]"
            if kind == "message":
                messages.append({"role": _field(item, "role", where), "content": _text_of(item.get("content"), where)})
            elif kind == "function_call":
                call = {"id": _field(item, "call_id", where), "type": "function",
                        "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                                 "content": output if isinstance(output, str) else _text_of(output, where)})
            elif kind != "reasoning":
                raise BadRequest(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                                 "function_call_output)", "input")
        if not any(m["role"] != "system" for m in messages):
            raise BadRequest("input is empty", "input")
        return messages


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise BadRequest(f"{where}.{name} must be a string", "input")
    return value


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest(f"{where}.content must be a string or a list of text parts (input images, files and audio "
                     "are not supported)", "input")


class ResponsesOutput:
    """A response object and its streaming events, from the shaped message of the one choice."""

    def __init__(self, body: ResponsesRequest, num_prompt_tokens: int) -> None:
        self.body, self.num_prompt_tokens = body, num_prompt_tokens
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.items: list[dict] = []  # output items so far
        self.open: dict | None = None  # the reasoning or message item being streamed
        self.seq = 0

    def response(self, status: str, *, usage: dict | None = None, finish: str | None = None) -> dict:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": b.model, "output": self.items, "instructions": b.instructions,
                "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
                "tool_choice": b.tool_choice.model_dump() if isinstance(b.tool_choice, NamedFunction)
                else b.tool_choice or "auto", "parallel_tool_calls": b.parallel_tool_calls,
                "temperature": b.temperature, "top_p": b.top_p, "max_output_tokens": b.max_output_tokens,
                "text": {"format": b.text.format.model_dump(by_alias=True, exclude_none=True)
                         if b.text and b.text.format else {"type": "text"}},
                "metadata": b.metadata or {}, "store": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "usage": usage}

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def part_events(self, part: MessagePart) -> list[dict]:
        """Events for a shaped part: reasoning, then text, then whole calls (each closes the item before it)."""
        out = []
        if part.reasoning:
            out += self._text_into("reasoning", part.reasoning)
        if part.content:
            out += self._text_into("message", part.content)
        for call in part.tool_calls:
            out += self.close()
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
            self.items.append(item)
            index = len(self.items) - 1
            out.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
            item["arguments"] = call["function"]["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=item["arguments"]))
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"]))
            item["status"] = "completed"
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def finish_events(self, status: str, usage: dict, finish: str | None) -> list[dict]:
        out = self.close()
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self.event(kind, response=self.response(status, usage=usage, finish=finish))]

    def _text_into(self, kind: str, text: str) -> list[dict]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self.close()
            part_type = "reasoning_text" if kind == "reasoning" else "output_text"
            item = {"type": kind, "id": f"{'rs' if kind == 'reasoning' else 'msg'}_{uuid.uuid4().hex[:24]}",
                    "status": "in_progress"} | ({"summary": []} if kind == "reasoning" else {"role": "assistant"})
            item["content"] = []
            self.items.append(item)
            self.open = item
            index = len(self.items) - 1
            out.append(self.event("response.output_item.added", output_index=index, item=json.loads(json.dumps(item))))
            part = {"type": part_type, "text": ""} | ({"annotations": []} if kind == "message" else {})
            item["content"].append(part)
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=dict(part)))
        item, index = self.open, len(self.items) - 1
        item["content"][0]["text"] += text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        out.append(self.event(delta, item_id=item["id"], output_index=index, content_index=0, delta=text))
        return out

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        item, index, self.open = self.open, len(self.items) - 1, None
        part = item["content"][0]
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        item["status"] = "completed"
        return [self.event(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]


def usage_of(choice: ChoiceState, num_prompt_tokens: int) -> dict:
    return {"input_tokens": num_prompt_tokens, "input_tokens_details": {"cached_tokens": choice.num_cached_tokens},
            "output_tokens": choice.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_prompt_tokens + choice.num_output_tokens}


async def serve_response(server, request, body: ResponsesRequest) -> Response:
    """Run ``body`` on ``server`` (router/http/app.py's): the chat path, shaped into Responses output."""
    chat = body.chat_body()
    await server.resolve_model(chat.model)
    prompt_ids, shaping = server.chat_prompt(chat)
    [params] = chat.sampling_params(len(prompt_ids), server.backend.card.max_model_len, server.salt_for(request),
                                    shaping.plan.constraint if shaping.plan else None, shaping.keep_special_tokens)
    server.backend.check_request(prompt_ids, params)
    out = ResponsesOutput(body, len(prompt_ids))
    run = await ChoiceRun.started(server.backend, out.id, [(prompt_ids, params)], request)
    if body.stream:
        return StreamingResponse(_events(run, out, shaping.shaper()), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    choice = ChoiceState(0)
    await run.collect([choice])
    out.part_events(shaping.shaper().part(choice.total().text, finished=True))
    out.close()
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    return JSONResponse(out.response(status, usage=usage_of(choice, len(prompt_ids)), finish=choice.finish_reason))


async def _events(run: ChoiceRun, out: ResponsesOutput, shaper: MessageShaper) -> AsyncIterator[str]:
    choice = ChoiceState(0)
    try:
        yield _sse(out.event("response.created", response=out.response("in_progress")))
        yield _sse(out.event("response.in_progress", response=out.response("in_progress")))
        while (item := await run.next()) is not None:
            delta = choice.add(item[1])
            if choice.error is not None:
                yield _sse(out.event("error", code="generation_failed", message=f"generation failed: {choice.error}",
                                     param=None))
                return
            for event in out.part_events(shaper.part(delta.text, finished=delta.finish_reason is not None)):
                yield _sse(event)
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        for event in out.finish_events(status, usage_of(choice, out.num_prompt_tokens), choice.finish_reason):
            yield _sse(event)
    except ClientGone:
        return
    except Exception as e:  # the status line is gone: report in band
        body = error_response(e)[1]["error"]
        yield _sse(out.event("error", code=body.get("code"), message=body["message"], param=body.get("param")))
    finally:
        run.cancel()


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
