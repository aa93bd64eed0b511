"""The assistant message a chat choice's text becomes: reasoning, content and tool calls.

    shaper = Shaping(plan, thinks=True, starts_thinking=False).shaper()   # one per choice
    part = shaper.feed(text_delta)         # MessagePart(content, reasoning, tool_calls) certain so far
    part = shaper.finish()                 # the rest, at the end of the output

One object serves streamed and non-streamed responses (a whole response is ``feed(all) + finish()``), so the two
are equal by construction whatever the chunking — several tokens per delta included.

- **Reasoning** (templates that think: their text mentions ``<think>``): text between ``<think>`` at the start of
  the output — or from the start, when the rendered prompt opened the block itself (DeepSeek-R1 distills) — and
  ``</think>`` is reasoning, sent as ``reasoning_content`` (SGLang's, Dynamo's) and ``reasoning`` (vLLM's);
  blanks after ``</think>`` are dropped.
- **Tool calls** (router/openai/tool_parsers.py parses them in the plan's format): each call gets an id unique in the
  response (``call_`` + 24 hex digits) and its index among the choice's calls. Text before the first call is
  content as written; blank text before, between or after calls is dropped (content is then null, as vLLM's).
- **Calls not returned**, each logged and reported to ``Shaping.report`` (the HTTP front door counts them:
  ``duet_tool_calls_dropped_total{format, reason}``): ``repeat``, a call identical (name and arguments, key order
  aside) to an earlier call of the turn — in a grammar-held list the grammar ended the list there
  (engine/sampling/call_lists.py); ``unfinished``, the output ended inside it (max_tokens: the complete calls before it
  are returned, finish_reason stays ``length``); ``extra``, a second call with ``parallel_tool_calls`` false. A
  named call's arguments cut short are returned as content: that output is no list of calls.
"""
from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.text.stopping import held_chars
from router.openai.tool_parsers import Call, CallListReader, Dropped, Text
from router.openai.tools import ToolPlan

log = logging.getLogger(__name__)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class MessagePart:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI tool_call objects, with their "index"

    def merged(self, other: MessagePart) -> MessagePart:
        return MessagePart(self.content + other.content, self.reasoning + other.reasoning,
                           self.tool_calls + other.tool_calls)

    def message_fields(self, *, streaming: bool) -> dict:
        out: dict = {}
        if self.reasoning:
            out |= {"reasoning_content": self.reasoning, "reasoning": self.reasoning}
        if self.content or not streaming:
            out["content"] = self.content or None
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls if streaming else [
                {k: v for k, v in c.items() if k != "index"} for c in self.tool_calls]
        return out


@dataclass(frozen=True)
class Shaping:
    """What a request asks of its choices' text: the tool plan (None: no tools) and whether the template thinks."""

    plan: ToolPlan | None = None
    thinks: bool = False
    starts_thinking: bool = False
    keep_special_tokens: bool = False  # a marker the shaper reads is a special token: the engine must write it
    report: Callable[[str, str], None] | None = field(default=None, compare=False)  # (format, reason) per dropped call

    @property
    def active(self) -> bool:
        return self.thinks or (self.plan is not None and self.plan.parses_calls)

    def shaper(self) -> MessageShaper:
        return MessageShaper(self)


class MessageShaper:
    def __init__(self, shaping: Shaping) -> None:
        self.shaping = shaping
        plan = shaping.plan
        calls = plan is not None and plan.parses_calls
        # native formats: required / named outputs are vLLM's JSON (a list of calls / the arguments); auto is the
        # template's format; the generic format's parser reads every mode
        native_json = calls and plan.fmt.native and plan.mode in ("required", "named")
        self.whole = native_json and plan.mode == "named"
        self.calls = (CallListReader(0) if native_json else plan.fmt.parser()) if calls and not self.whole else None
        self.think = _ThinkSplit(shaping.starts_thinking) if shaping.thinks else None
        self.num_calls = 0
        self.made: set[tuple[str, str]] = set()  # (name, canonical arguments) of the calls returned
        self.content_started = False
        self.pending_blank = ""
        self.buffer = ""  # required / named: the whole output

    def feed(self, text: str) -> MessagePart:
        part = MessagePart()
        if self.think is not None:
            reasoning, text = self.think.feed(text)
            part.reasoning = reasoning
        self._content(part, text)
        return part

    def part(self, text: str, finished: bool) -> MessagePart:
        """``feed(text)``, and ``finish()`` when the output ended with it."""
        part = self.feed(text)
        return part.merged(self.finish()) if finished else part

    def finish(self) -> MessagePart:
        part = MessagePart()
        if self.think is not None:
            reasoning, text = self.think.finish()
            part.reasoning = reasoning
            self._content(part, text)
        if self.whole:
            self._whole_calls(part)
        elif self.calls is not None:
            self._events(part, self.calls.finish())
        if self.num_calls == 0:
            part.content += self.pending_blank
        self.pending_blank = ""
        return part

    def _content(self, part: MessagePart, text: str) -> None:
        if self.whole:
            self.buffer += text
        elif self.calls is not None:
            self._events(part, self.calls.feed(text))
        else:
            part.content += text

    def _events(self, part: MessagePart, events) -> None:
        for event in events:
            if isinstance(event, Text):
                if self.content_started and not self.num_calls:
                    part.content += event.text  # the message before any call: as written
                    continue
                text = self.pending_blank + event.text
                if text.strip():
                    part.content += text
                    self.pending_blank, self.content_started = "", True
                else:
                    self.pending_blank = text  # blanks before, between or after calls: held
            elif isinstance(event, Dropped):
                self._drop(event.reason, event.text)
            elif isinstance(event, Call):
                self._add_call(part, event)

    def _add_call(self, part: MessagePart, call: Call) -> None:
        key = (call.name, json.dumps(json.loads(call.arguments), sort_keys=True))
        if key in self.made:
            self._drop("repeat", f"{call.name} {call.arguments}")
        elif self.num_calls and not self.shaping.plan.parallel:
            self._drop("extra", f"{call.name} {call.arguments}")  # parallel_tool_calls false: the first call only
        else:
            self.made.add(key)
            self.pending_blank = ""
            part.tool_calls.append(self._call(call))

    def _drop(self, reason: str, text: str) -> None:
        fmt = self.shaping.plan.fmt.name
        log.info("tool call not returned (%s, %s format): %.200s", reason, fmt, text)
        if self.shaping.report is not None:
            self.shaping.report(fmt, reason)

    def _whole_calls(self, part: MessagePart) -> None:
        """named: the output is the arguments object (held by the grammar; cut short by max_tokens, it is returned
        as content)."""
        try:
            doc = json.loads(self.buffer)
        except json.JSONDecodeError:
            part.content += self.buffer
            return
        self._add_call(part, Call(self.shaping.plan.named, json.dumps(doc, ensure_ascii=False)))

    def _call(self, call: Call) -> dict:
        index = self.num_calls
        self.num_calls += 1
        return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}


class _ThinkSplit:
    """``<think>…</think>`` at the start of the output (or open from the prompt) → reasoning, the rest → text."""

    def __init__(self, open_from_prompt: bool) -> None:
        self.state = "thinking" if open_from_prompt else "start"  # start | thinking | after | text
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, out = "", ""
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self.buf, self.state = head[len(THINK_OPEN):], "thinking"
                    continue
                if not head or THINK_OPEN.startswith(head):
                    return reasoning, out  # may still open a think block
                self.state = "text"
            if self.state == "thinking":
                at = self.buf.find(THINK_CLOSE)
                if at < 0:
                    keep = held_chars(self.buf, (THINK_CLOSE,))
                    reasoning += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    return reasoning, out
                reasoning += self.buf[:at]
                self.buf, self.state = self.buf[at + len(THINK_CLOSE):], "after"
            if self.state == "after":
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return reasoning, out
                self.state = "text"
            out += self.buf
            self.buf = ""
            return reasoning, out

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.state == "thinking":  # the output ended inside the block (max_tokens): it was all reasoning
            return rest, ""
        return "", rest if self.state != "after" else rest.lstrip()
