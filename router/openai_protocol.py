"""The OpenAI wire format of /v1/completions and /v1/chat/completions: request bodies in, bodies out.

Requests are pydantic models parsed in strict JSON mode (``"max_tokens": "5"`` is a 400, not a 5);
an explicit null means the field's default; fields we do not know are ignored, fields we know but cannot honour (penalties, logit_bias, a
non-text response_format, tools, suffix, echo with logprobs) are refused with a 400 rather than
silently dropped. ``n`` choices run as n engine requests; with a seed, choice i gets ``seed + i`` so
the choices differ and the response is still reproducible.

Responses are built the same way for both endpoints and for both delivery modes: each choice keeps a
:class:`ChoiceState` that turns engine outputs into :class:`Delta` s; a streamed chunk formats one
delta, a non-streamed response formats the choice's whole history as one delta. The two endpoints
differ only in a :class:`ResponseBuilder` subclass (ids, object names, the choice and logprobs shapes).

Token strings in logprobs are ``decode([id])`` with special tokens kept. A byte-level token holding
half a UTF-8 character decodes to U+FFFD, so its ``bytes`` (chat) are those of U+FFFD, not the raw
byte. ``-inf`` logprobs are sent as -9999.0 (JSON has no infinity).
"""
from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.request import MAX_LOGPROBS, SamplingParams
from engine.tokenizer import Tokenizer

MAX_N = 16
MAX_STOP_STRINGS = 16
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
_LOGPROB_FLOOR = -9999.0


class BadRequest(InvalidRequestError):
    """An invalid request whose offending field is known (it goes into the error body's ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------------------------------------- requests


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI marks most fields nullable and clients send {"stream": null}: treat it as absent
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Model):
    include_usage: bool = False


class ResponseFormat(_Model):
    type: str


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def template_input(self) -> dict[str, Any]:
        """The message as a chat template expects it: plain string content, known roles only."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        return message | {k: v for k, v in (("name", self.name), ("tool_call_id", self.tool_call_id)) if v is not None}


class GenerationRequest(_Model):
    """Fields both endpoints share, and their conversion to engine SamplingParams."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM): 0 or -1 = off
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (vLLM)
    min_tokens: int = 0  # extension (vLLM)
    user: str | None = None  # accepted, unused
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> list[SamplingParams]:
        """One SamplingParams per choice; raises InvalidRequestError for what we cannot honour."""
        self.check_supported()
        base = SamplingParams(
            max_tokens=self.requested_max_tokens(max(1, max_model_len - num_prompt_tokens)),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            seed=self.seed,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
            min_tokens=self.min_tokens,
        )
        if self.seed is None:
            return [base] * self.n
        return [dataclasses.replace(base, seed=self.seed + i) for i in range(self.n)]

    def check_supported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise BadRequest(f"{name} is not supported (only 0)", name)
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported", "logit_bias")
        if self.response_format is not None and self.response_format.type != "text":
            raise BadRequest(f"response_format {self.response_format.type!r} is not supported (only 'text')",
                             "response_format")

    @abstractmethod
    def requested_max_tokens(self, rest_of_context: int) -> int:
        """max_tokens as the endpoint defines it (its own field names and default)."""

    @abstractmethod
    def requested_logprobs(self) -> int | None:
        """The engine's logprobs setting from the endpoint's own fields."""


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a string or token ids); a batch of prompts is refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise BadRequest("batched prompts are not supported; send one prompt per request", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise BadRequest("the prompt is empty", "prompt")
        return prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if self.best_of not in (None, self.n):
            raise BadRequest("best_of is not supported (only best_of == n)", "best_of")
        if self.echo and self.logprobs is not None:
            raise BadRequest("echo with logprobs is not supported (prompt logprobs are not computed)", "echo")

    def requested_max_tokens(self, rest_of_context: int) -> int:
        return DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise BadRequest("tools are not supported", "tools")
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs requires logprobs=true", "top_logprobs")

    def requested_max_tokens(self, rest_of_context: int) -> int:
        for value in (self.max_completion_tokens, self.max_tokens):
            if value is not None:
                return value
        return rest_of_context

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_input() for m in self.messages]


# ---------------------------------------------------------------------------------------------- choices


@dataclass
class Delta:
    """New text and tokens of one choice (one streamed chunk, or a whole choice when not streaming)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None = None


@dataclass
class ChoiceState:
    """Everything one choice has produced so far; ``error`` is set when it ended in error or abort."""

    index: int
    prefix_text: str = ""  # echo: the prompt text, sent before the first generated text
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, out: RequestOutput) -> Delta:
        text = ("" if self.text_parts else self.prefix_text) + out.new_text
        self.text_parts.append(text)
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        tops = out.new_top_logprobs or [{} for _ in out.new_logprobs]
        self.top_logprobs += tops
        self.num_output_tokens = out.num_output_tokens or len(self.token_ids)
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            if out.finish_reason not in ("stop", "length"):
                self.error = out.error or f"the request ended with {out.finish_reason!r}"
        return Delta(self.index, text, list(out.new_token_ids), list(out.new_logprobs), tops,
                     self.finish_reason if out.finished else None)

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

    def chunk(self, delta: Delta) -> dict[str, Any]:
        return self._chunk_of(self._choice(delta, streaming=True))

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return []

    def usage_chunk(self, choices: list[ChoiceState]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object_name), "choices": [], "usage": self.usage(choices)}

    def usage(self, choices: list[ChoiceState]) -> dict[str, Any]:
        completion_tokens = sum(c.num_output_tokens for c in choices)
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.num_prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": choices[0].num_cached_tokens if choices else 0}}

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
        tops = []
        for token_id, logprob, top in zip(delta.token_ids, delta.logprobs, delta.top_logprobs):
            # OpenAI: the n most likely tokens, plus the chosen one when it is not among them. Ids whose
            # strings collide (U+FFFD) keep the likeliest one's logprob.
            entries: dict[str, float] = {}
            for t, lp in _by_logprob({token_id: logprob} | top):
                entries.setdefault(self._token(t), _finite(lp))
            tops.append(entries)
        return {"tokens": tokens, "token_logprobs": [_finite(lp) for lp in delta.logprobs],
                "top_logprobs": tops, "text_offset": self._next_text_offsets(delta, tokens)}


class ChatResponses(ResponseBuilder):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """OpenAI opens each streamed chat choice with a chunk that carries only the role."""
        return [self._chunk_of({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}) for i in range(num_choices)]

    def _choice(self, delta: Delta, *, streaming: bool) -> dict[str, Any]:
        if streaming:
            key, message = "delta", {"content": delta.text} if delta.text else {}
        else:
            key, message = "message", {"role": "assistant", "content": delta.text}
        return {"index": delta.index, key: message, "logprobs": self._logprobs(delta),
                "finish_reason": delta.finish_reason}

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
