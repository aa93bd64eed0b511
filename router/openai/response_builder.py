"""OpenAI response bodies of /v1/completions and /v1/chat/completions, streamed or not.

Each choice keeps a :class:`ChoiceState` that turns engine outputs into :class:`Delta` s; a streamed
chunk formats one delta, a non-streamed response formats the choice's whole history as one delta. The two
endpoints differ only in a :class:`ResponseBuilder` subclass (ids, object names, the choice and logprobs
shapes). Requests are parsed in router/openai/protocol.py.

Token strings in logprobs are ``decode([id])`` with special tokens kept. A byte-level token holding
half a UTF-8 character decodes to U+FFFD, so its ``bytes`` (chat) are those of U+FFFD, not the raw
byte. ``-inf`` logprobs are sent as -9999.0 (JSON has no infinity).
"""
from __future__ import annotations

import math
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import RequestOutput
from engine.text.tokenizer import Tokenizer
from router.openai.assistant_message import MessagePart, MessageShaper, Shaping

_LOGPROB_FLOOR = -9999.0


# ---------------------------------------------------------------------------------------------- choices


@dataclass
class Delta:
    """New text and tokens of one choice (one streamed chunk, or a whole choice when not streaming)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float | None]  # None: the echoed prompt's first token (nothing precedes it)
    top_logprobs: list[dict[int, float] | None]
    finish_reason: str | None = None


@dataclass
class ChoiceState:
    """Everything one choice has produced so far; ``error`` is set when it ended in error or abort."""

    index: int
    prefix_text: str = ""  # echo: the prompt text, sent before the first generated text
    prefix_token_ids: list[int] = field(default_factory=list)  # echo with logprobs: the prompt's tokens
    first_of_prompt: bool = True  # the prompt's cached tokens count once in usage, with its first choice
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_output_tokens: int = 0
    num_generated_ids: int = 0  # token ids received (token_ids also holds an echoed prompt's)
    num_cached_tokens: int = 0

    def add(self, out: RequestOutput) -> Delta:
        first = not self.text_parts
        text = (self.prefix_text if first else "") + out.new_text
        self.text_parts.append(text)
        token_ids, logprobs = list(out.new_token_ids), list(out.new_logprobs)
        tops = list(out.new_top_logprobs or [{} for _ in out.new_logprobs])
        if first and self.prefix_token_ids and out.prompt_logprobs is not None:
            token_ids = self.prefix_token_ids + token_ids
            logprobs = list(out.prompt_logprobs) + logprobs
            tops = [None if t is None else t or {} for t in out.prompt_top_logprobs or ()] + tops
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.top_logprobs += tops
        self.num_generated_ids += len(out.new_token_ids)
        self.num_output_tokens = out.num_output_tokens or self.num_generated_ids
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            if out.finish_reason not in ("stop", "length"):
                self.error = out.error or f"the request ended with {out.finish_reason!r}"
        return Delta(self.index, text, token_ids, logprobs, tops, self.finish_reason if out.finished else None)

    def total(self) -> Delta:
        text = "".join(self.text_parts) or self.prefix_text
        return Delta(self.index, text, self.token_ids, self.logprobs, self.top_logprobs, self.finish_reason)


# ---------------------------------------------------------------------------------------------- responses


class ResponseBuilder(ABC):
    """Formats one response (streamed or not) of one endpoint; subclasses give the endpoint's shapes."""

    id_prefix = ""
    object_name = ""
    chunk_object_name = ""

    def __init__(self, tokenizer: Tokenizer, model: str, num_prompt_tokens: int, *, with_logprobs: bool,
                 include_usage: bool = False) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.num_prompt_tokens = num_prompt_tokens
        self.with_logprobs = with_logprobs
        self.include_usage = include_usage
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._text_offsets: dict[int, int] = {}  # per choice: chars of token strings already sent

    def response(self, choices: list[ChoiceState]) -> dict[str, Any]:
        return {**self._envelope(self.object_name),
                "choices": [self._choice(c.total(), streaming=False) for c in choices],
                "usage": self.usage(choices)}

    def chunks(self, delta: Delta) -> list[dict[str, Any]]:
        """The streamed chunks of ``delta``: none while it carries nothing yet (text held back by a parser); tool
        calls and the finish reason in chunks of their own, as OpenAI sends them (openai-python's stream helper
        closes a call only on a later chunk)."""
        choice = self._choice(delta, streaming=True)
        if not choice.get("delta", True) and choice["finish_reason"] is None and choice["logprobs"] is None:
            return []
        if choice.get("delta", {}).get("tool_calls") and choice["finish_reason"] is not None:
            finish = {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
            return [self._chunk_of(choice | {"finish_reason": None}), self._chunk_of(finish)]
        return [self._chunk_of(choice)]

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return []

    def usage_chunk(self, choices: list[ChoiceState]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object_name), "choices": [], "usage": self.usage(choices)}

    def usage(self, choices: list[ChoiceState]) -> dict[str, Any]:
        completion_tokens = sum(c.num_output_tokens for c in choices)
        cached_tokens = sum(c.num_cached_tokens for c in choices if c.first_of_prompt)
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.num_prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def _chunk_of(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = {**self._envelope(self.chunk_object_name), "choices": [choice]}
        return body | ({"usage": None} if self.include_usage else {})

    @abstractmethod
    def _choice(self, delta: Delta, *, streaming: bool) -> dict[str, Any]:
        """One choice in the endpoint's shape (text or message/delta)."""

    @abstractmethod
    def _logprobs(self, delta: Delta) -> dict[str, Any] | None:
        """The endpoint's logprobs object for ``delta`` (None when not asked for)."""

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _next_text_offsets(self, delta: Delta, tokens: list[str]) -> list[int]:
        offset = self._text_offsets.get(delta.index, 0)
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._text_offsets[delta.index] = offset
        return offsets


class CompletionResponses(ResponseBuilder):
    id_prefix = "cmpl"
    object_name = chunk_object_name = "text_completion"

    def _choice(self, delta: Delta, *, streaming: bool) -> dict[str, Any]:
        return {"index": delta.index, "text": delta.text, "logprobs": self._logprobs(delta),
                "finish_reason": delta.finish_reason}

    def _logprobs(self, delta: Delta) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        tokens = [self._token(t) for t in delta.token_ids]
        tops: list[dict[str, float] | None] = []
        for token_id, logprob, top in zip(delta.token_ids, delta.logprobs, delta.top_logprobs):
            if logprob is None:  # an echoed prompt's first token
                tops.append(None)
                continue
            # OpenAI: the n most likely tokens, plus the chosen one when it is not among them. Ids whose
            # strings collide (U+FFFD) keep the likeliest one's logprob.
            entries: dict[str, float] = {}
            for t, lp in _by_logprob({token_id: logprob} | top):
                entries.setdefault(self._token(t), _finite(lp))
            tops.append(entries)
        return {"tokens": tokens, "token_logprobs": [None if lp is None else _finite(lp) for lp in delta.logprobs],
                "top_logprobs": tops, "text_offset": self._next_text_offsets(delta, tokens)}


class ChatResponses(ResponseBuilder):
    """Chat bodies; with an active ``shaping`` (tools, reasoning: router/openai/assistant_message.py) each choice's text
    is shaped into content, reasoning and tool calls, streamed and not by the same shaper."""

    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args, shaping: Shaping | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shaping = shaping if shaping is not None and shaping.active else None
        self._shapers: dict[int, MessageShaper] = {}
        self._num_calls: dict[int, int] = {}  # per choice: tool calls made so far

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """OpenAI opens each streamed chat choice with a chunk that carries only the role."""
        return [self._chunk_of({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}) for i in range(num_choices)]

    def _choice(self, delta: Delta, *, streaming: bool) -> dict[str, Any]:
        if self.shaping is not None:
            return self._shaped_choice(delta, streaming=streaming)
        if streaming:
            key, message = "delta", {"content": delta.text} if delta.text else {}
        else:
            key, message = "message", {"role": "assistant", "content": delta.text}
        return {"index": delta.index, key: message, "logprobs": self._logprobs(delta),
                "finish_reason": delta.finish_reason}

    def _shaped_part(self, delta: Delta, *, streaming: bool) -> MessagePart:
        """``delta``'s text as a message part: streamed, through the choice's own shaper (it holds back what is not
        certain yet); else, a whole choice through a fresh one."""
        shaper = self._shapers.setdefault(delta.index, self.shaping.shaper()) if streaming else self.shaping.shaper()
        part = shaper.part(delta.text, finished=delta.finish_reason is not None or not streaming)
        self._num_calls[delta.index] = shaper.num_calls
        return part

    def _shaped_choice(self, delta: Delta, *, streaming: bool) -> dict[str, Any]:
        part = self._shaped_part(delta, streaming=streaming)
        plan = self.shaping.plan
        reason = plan.finish_reason(self._num_calls[delta.index], delta.finish_reason) if plan else delta.finish_reason
        message = part.message_fields(streaming=streaming)
        key, message = ("delta", message) if streaming else ("message", {"role": "assistant", **message})
        return {"index": delta.index, key: message, "logprobs": self._logprobs(delta), "finish_reason": reason}

    def _logprobs(self, delta: Delta) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        content = []
        for token_id, logprob, top in zip(delta.token_ids, delta.logprobs, delta.top_logprobs):
            entry = self._entry(token_id, logprob)
            content.append(entry | {"top_logprobs": [self._entry(t, lp) for t, lp in _by_logprob(top)]})
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._token(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def _by_logprob(top: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda item: -item[1])


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR
