"""The OpenAI wire format of /v1/completions and /v1/chat/completions: request bodies in, bodies out.

Requests are pydantic models parsed in strict JSON mode (``"max_tokens": "5"`` is a 400, not a 5);
an explicit null means the field's default; fields we do not know are ignored, fields we know but cannot
honour (tools, suffix, best_of != n) are refused with a 400 rather than silently dropped. ``n`` choices
run as n engine requests; with a seed, choice i gets ``seed + i`` so the choices differ and the response
is still reproducible. /v1/completions takes a list of prompts (strings or token-id lists, at most
``MAX_PROMPTS``, and at most ``MAX_CHOICES`` prompts × n): choice ``index = prompt_index * n + i``, as
OpenAI numbers them, each prompt with its own echo and prompt logprobs.

Penalties, ``logit_bias`` and ``response_format`` (json_object / json_schema) become engine
SamplingParams (engine/sampler.py, engine/structured.py apply them on whichever worker samples), and so
does ``cache_salt`` (vLLM's: a non-empty string of at most 256 characters that salts the request's block
hashes, so its prefix-cache hits come only from requests with the same salt; router/tenancy.py).
``echo`` with ``logprobs`` asks the engine for prompt logprobs: the prompt's tokens lead the choice's
logprobs with the first one null, as OpenAI sends them.

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
import json
import math
from abc import ABC, abstractmethod
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.request import MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_REPETITION_PENALTY, SamplingParams
from engine.structured import structured_output
from engine.tokenizer import Tokenizer

MAX_N = 16
MAX_PROMPTS = 256  # prompts in one /v1/completions request
MAX_CHOICES = 256  # prompts × n: what one request may fan out into
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


class JsonSchemaFormat(_Model):
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced (constrained decoding), strict or not


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self):
        """engine StructuredOutput, or None for text; BadRequest naming what is wrong with the schema."""
        if self.type != "json_schema" and self.json_schema is not None:
            raise BadRequest(f"response_format.json_schema is only for type 'json_schema', not {self.type!r}",
                             "response_format")
        if self.type == "text":
            return None
        if self.type == "json_object":
            return structured_output("json_object")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise BadRequest("response_format type 'json_schema' needs json_schema.schema", "response_format")
        try:
            return structured_output("json_schema", json.dumps(self.json_schema.schema_))
        except InvalidRequestError as e:
            raise BadRequest(f"response_format.json_schema.schema: {e}", "response_format") from None


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
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0, le=MAX_REPETITION_PENALTY)  # extension (vLLM)
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None  # token id (a string) -> bias
    response_format: ResponseFormat | None = None
    # extension (vLLM): prefix-cache hits only between requests with the same salt (router/tenancy.py)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int,
                        tenant_salt: str | None = None) -> list[SamplingParams]:
        """One SamplingParams per choice; raises InvalidRequestError for what we cannot honour.
        ``tenant_salt``: the API key's (router/tenancy.py), when the router salts by key."""
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
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.token_bias(),
            prompt_logprobs=self.requested_prompt_logprobs(),
            structured=self.response_format.structured() if self.response_format else None,
            cache_salt=self.cache_salt,
            tenant_salt=tenant_salt,
        )
        if self.seed is None:
            return [base] * self.n
        return [dataclasses.replace(base, seed=self.seed + i) for i in range(self.n)]

    def check_supported(self) -> None:
        if self.response_format is not None and self.response_format.type != "text" and self.ignore_eos:
            raise BadRequest("ignore_eos cannot be combined with a JSON response_format (the grammar ends "
                             "with EOS)", "ignore_eos")

    def token_bias(self) -> dict[int, float]:
        """logit_bias with its keys as token ids (OpenAI sends them as strings)."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise BadRequest(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            bias[int(key)] = value
        return bias

    def requested_prompt_logprobs(self) -> int | None:
        return None

    @abstractmethod
    def requested_max_tokens(self, rest_of_context: int) -> int:
        """max_tokens as the endpoint defines it (its own field names and default)."""

    @abstractmethod
    def requested_logprobs(self) -> int | None:
        """The engine's logprobs setting from the endpoint's own fields."""


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: nothing generated (echo: the prompt's logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts (strings or token-id lists), one or a batch; BadRequest when empty or over the bounds."""
        prompt = self.prompt
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if len(batch) > MAX_PROMPTS:
            raise BadRequest(f"at most {MAX_PROMPTS} prompts per request, got {len(batch)}", "prompt")
        if len(batch) * self.n > MAX_CHOICES:
            raise BadRequest(f"prompts × n may be at most {MAX_CHOICES}, got {len(batch)} × {self.n}", "prompt")
        for i, p in enumerate(batch):
            if not p:
                raise BadRequest("the prompt is empty" if len(batch) == 1 else f"prompt {i} is empty", "prompt")
        return batch

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if self.best_of not in (None, self.n):
            raise BadRequest("best_of is not supported (only best_of == n)", "best_of")

    def requested_max_tokens(self, rest_of_context: int) -> int:
        return DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
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

    def chunk(self, delta: Delta) -> dict[str, Any]:
        return self._chunk_of(self._choice(delta, streaming=True))

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
