"""How tool calls look in a model's text, and the incremental parsers that find them.

    fmt = detect_format(tokenizer.chat_template)    # or FORMATS[name] (``--tool-call-parser``)
    parser = fmt.parser()                           # one per choice
    events = parser.feed(text_delta)                # [Text | Call] as soon as they are certain
    events += parser.finish()                       # held-back text, a call the output ended inside

Formats, chosen from the markers the chat template writes (``detect_format``):
- ``hermes`` (Qwen2.5, Qwen3, Hermes 2/3, many fine-tunes): ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``,
  any number, text around them;
- ``mistral``: ``[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`` to the end of the output;
- ``llama3_json`` (Llama 3.1 / 3.2): ``{"name": …, "parameters": {…}}`` as the whole output (or after
  ``<|python_tag|>``), several separated by ``;``;
- ``generic`` for templates that render no tools at all (SmolLM2's): router/openai/tools.py describes the tools
  in a system message and holds the output to ``{"tool_calls": [{"name", "arguments"}]}`` or ``{"response": …}``
  with a grammar; :class:`GenericParser` reads it, streaming the response's text as it decodes.

One design for the marker formats (:class:`MarkerParser`): text outside calls, payloads between a start marker
and an end marker (or the end of the output). Text is released as soon as it cannot be the beginning of a start
marker, whatever the chunking — a character per delta or a whole output at once give the same events (vLLM's and
SGLang's streaming bugs came from parsers that assumed one token per delta). A call is released whole when its
payload is complete (Dynamo's choice): its arguments are JSON text, the same streamed or not. A payload that does
not parse is the model's text and is released as content, never dropped.

**An output cut inside its calls** (max_tokens, a stop string): the calls that were complete are calls, and the
unfinished one is dropped (a :class:`Dropped` event, which router/openai/assistant_message.py logs and counts) — never the raw
list as content, which no OpenAI client reads as calls. A JSON list of calls (the generic format's, vLLM's
``required`` array, Mistral's) is read by :class:`CallListReader`, which releases each call as soon as its object
is complete, streamed or not; an unclosed hermes or Llama payload that is an unclosed JSON object is an
unfinished call.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from engine.sampling.call_lists import ListScanner
from engine.text.stopping import held_chars  # text that may still become a marker, as for stop strings


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class Dropped:
    """A call that is not returned, and why: ``unfinished`` (the output ended inside it) here; router/openai/assistant_message.py
    adds ``repeat`` and ``extra``."""

    reason: str
    text: str


Event = Text | Call | Dropped


def call_of(obj, args_keys=("arguments", "parameters")) -> Call | None:
    """``{"name": str, "arguments" | "parameters": object or JSON text}`` → Call; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def calls_of(payload: str, *, many: bool = False, sep: str | None = None) -> list[Call] | None:
    """A payload's calls: one JSON object, or (``many``) a JSON array of them, or objects split on ``sep``."""
    text = payload.strip()
    try:
        if sep is not None:
            docs = [json.loads(part) for part in text.split(sep) if part.strip()]
        else:
            doc = json.loads(text)
            docs = doc if many and isinstance(doc, list) else [doc]
    except json.JSONDecodeError:
        return None
    calls = [call_of(d) for d in docs]
    return calls if calls and all(c is not None for c in calls) else None


def unfinished_object(text: str) -> bool:
    """Whether ``text`` opens a JSON object that it does not close (a call the output ended inside)."""
    text = text.strip()
    if not text.startswith("{"):
        return False
    scan = ListScanner(0)  # no list at the top of an object: only its depth is read
    scan.feed(text)
    return scan.depth > 0


def cut_calls(payload: str, *, many: bool = False, sep: str | None = None) -> list[Event] | None:
    """A payload the output ended inside, as :func:`calls_of` reads it: its complete calls and the unfinished one
    :class:`Dropped`; None when it is not a cut call payload (then it is text)."""
    text = payload.strip()
    if sep is not None and sep in text:
        *whole, last = text.split(sep)
        calls = [calls_of(part) for part in whole if part.strip()]
        if any(c is None for c in calls) or not unfinished_object(last):
            return None
        return [c for cs in calls for c in cs] + [Dropped("unfinished", last.strip())]
    if many and text.startswith("["):
        reader = CallListReader(0)
        events = reader.feed(text) + reader.finish()
        return None if reader.closed or any(isinstance(e, Text) for e in events) else events
    return [Dropped("unfinished", text)] if unfinished_object(text) else None


class CallListReader:
    """A JSON list of calls as its text arrives (the list at container depth ``list_depth``:
    engine/sampling/call_lists.py :class:`ListScanner`): each call released once its object is complete; at the end, one
    the output ended inside is :class:`Dropped`. An item that is not a call is text (under a grammar, never)."""

    def __init__(self, list_depth: int) -> None:
        self.scan = ListScanner(list_depth)

    @property
    def closed(self) -> bool:
        return self.scan.closed

    def feed(self, text: str) -> list[Event]:
        return [_call_or_text(item) for item in self.scan.feed(text)]

    def finish(self) -> list[Event]:
        item, self.scan.item = self.scan.item, None
        return [Dropped("unfinished", item)] if item is not None and not self.scan.closed else []


def _call_or_text(item: str) -> Event:
    try:
        call = call_of(json.loads(item))
    except json.JSONDecodeError:
        call = None
    return call if call is not None else Text(item)


class MarkerParser:
    """Text, and calls in payloads after one of ``starts`` up to ``end`` (None: the end of the output).
    ``bare_json``: an output whose first non-blank character is ``{`` is a payload too (Llama 3.1's JSON calls).
    ``cut``: a payload the output ended inside → its events (:func:`cut_calls`), or None for text."""

    def __init__(self, starts: tuple[str, ...], end: str | None, payload: Callable[[str], list[Call] | None],
                 bare_json: bool = False, cut: Callable[[str], list[Event] | None] = cut_calls) -> None:
        self.starts, self.end, self.payload, self.bare_json, self.cut = starts, end, payload, bare_json, cut
        self.buf, self.marker, self.in_call, self.seen_text = "", "", False, False

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while True:
            if not self.in_call:
                if self.bare_json and not self.seen_text:
                    head = self.buf.lstrip()
                    if not head:
                        break  # only blanks so far: the output may still open with a JSON call
                    if head[0] == "{":
                        self.buf, self.marker, self.in_call = head, "", True
                        continue
                    self.seen_text = True
                at, marker = self._find_start()
                if marker is None:
                    keep = held_chars(self.buf, self.starts)
                    _text(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                _text(out, self.buf[:at])
                self.seen_text = True
                self.buf, self.marker, self.in_call = self.buf[at + len(marker):], marker, True
            else:
                if self.end is None:
                    break  # to the end of the output: finish() reads it
                at = self.buf.find(self.end)
                if at < 0:
                    break
                payload, self.buf = self.buf[:at], self.buf[at + len(self.end):]
                self._release(out, payload, self.end)
                self.in_call = False
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self.in_call:
            self._release(out, self.buf, "")
        else:
            _text(out, self.buf)
        self.buf, self.in_call = "", False
        return out

    def _find_start(self) -> tuple[int, str | None]:
        found = [(self.buf.find(m), m) for m in self.starts if m in self.buf]
        return min(found) if found else (-1, None)

    def _release(self, out: list[Event], payload: str, end: str) -> None:
        calls = self.payload(payload)
        if calls is None and not end:  # the output ended inside the payload
            calls = self.cut(payload)
        if calls is None:
            _text(out, self.marker + payload + end)  # not a call after all: the model's text
        else:
            out.extend(calls)


class GenericParser:
    """The generic format's output: ``{"tool_calls": [...]}`` → each call as soon as it is complete
    (:class:`CallListReader`), ``{"response": "…"}`` → its text, decoded and released as it arrives. Anything else
    is released as text."""

    RESPONSE, CALLS = '{"response":"', '{"tool_calls":'

    def __init__(self) -> None:
        self.buf, self.mode, self.pos = "", None, 0
        self.calls = CallListReader(1)

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        if self.mode is None:
            head = self.buf.lstrip()
            for mode, prefix in (("response", self.RESPONSE), ("calls", self.CALLS)):
                if head.startswith(prefix):
                    self.mode, self.buf, self.pos = mode, head, len(prefix)
            if self.mode is None:
                if any(p.startswith(head) for p in (self.RESPONSE, self.CALLS)):
                    return []  # still a prefix of one of them
                self.mode = "text"
        if self.mode == "text":
            out, self.buf = [Text(self.buf)] if self.buf else [], ""
            return out
        if self.mode == "response":
            return self._decode_string()
        if self.mode == "calls":
            text, self.buf = self.buf, ""
            return self.calls.feed(text)
        return []

    def finish(self) -> list[Event]:
        if self.mode == "calls":
            return self.calls.finish()
        if self.mode in (None, "text") and self.buf:
            return [Text(self.buf)]
        return []

    def _decode_string(self) -> list[Event]:
        """Release the response string's characters up to the last complete escape; stop at its closing quote."""
        raw, i, safe = self.buf, self.pos, self.pos
        while i < len(raw):
            c = raw[i]
            if c == '"':
                text = json.loads('"' + raw[self.pos:i] + '"')
                self.pos, self.mode = len(raw), "done"
                return [Text(text)] if text else []
            if c == "\\":
                step = _escape_len(raw, i)
                if step is None:
                    break  # an escape cut in the middle: wait for the rest
                i += step
            else:
                i += 1
            safe = i
        text = json.loads('"' + raw[self.pos:safe] + '"') if safe > self.pos else ""
        self.pos = safe
        return [Text(text)] if text else []


def _escape_len(raw: str, i: int) -> int | None:
    """Length of the JSON escape at ``raw[i]`` (a backslash), or None when it is not complete yet. A high
    surrogate ``\\uD83D`` is only complete with its low half (decoding it alone would break the character)."""
    if i + 1 >= len(raw):
        return None
    if raw[i + 1] != "u":
        return 2
    if i + 6 > len(raw):
        return None
    if 0xD800 <= int(raw[i + 2:i + 6], 16) <= 0xDBFF:
        return 12 if i + 12 <= len(raw) else None
    return 6


def _text(out: list[Event], text: str) -> None:
    if text:
        out.append(Text(text))


@dataclass(frozen=True)
class ToolFormat:
    """A way tool calls are written: ``native`` formats are the chat template's own (it renders the tools);
    the generic one is duet's, for templates that render none."""

    name: str
    native: bool
    make: Callable[[], MarkerParser | GenericParser]
    start: str | None = None  # the marker a call opens with (a strict auto call's trigger), if one
    markers: tuple[str, ...] = ()  # the marker strings the parser reads (kept in the text if they are special tokens)

    def parser(self):
        return self.make()


FORMATS = {
    "hermes": ToolFormat("hermes", True, lambda: MarkerParser(("<tool_call>",), "</tool_call>", calls_of),
                         start="<tool_call>", markers=("<tool_call>", "</tool_call>")),
    "mistral": ToolFormat("mistral", True, lambda: MarkerParser(("[TOOL_CALLS]",), None,
                                                                lambda p: calls_of(p, many=True),
                                                                cut=lambda p: cut_calls(p, many=True)),
                          start="[TOOL_CALLS]", markers=("[TOOL_CALLS]",)),
    "llama3_json": ToolFormat("llama3_json", True, lambda: MarkerParser(("<|python_tag|>",), None,
                                                                        lambda p: calls_of(p, sep=";"),
                                                                        bare_json=True,
                                                                        cut=lambda p: cut_calls(p, sep=";")),
                              markers=("<|python_tag|>",)),
    "generic": ToolFormat("generic", False, GenericParser),
}


def detect_format(chat_template: str | None) -> ToolFormat:
    """The format a chat template writes tool calls in, from its markers; ``generic`` when it writes none (it
    does not mention ``tools`` or ``tool_calls``: the model never sees the tools otherwise)."""
    template = chat_template or ""
    if "tools" not in template and "tool_calls" not in template:
        return FORMATS["generic"]
    for marker, name in (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
                         ('"parameters"', "llama3_json")):
        if marker in template:
            return FORMATS[name]
    return FORMATS["generic"]
