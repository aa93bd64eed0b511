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

Response bodies (streamed or not) are built in router/openai_responses.py.
"""
from __future__ import annotations

import dataclasses
import json
from abc import abstractmethod
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.errors import InvalidRequestError
from engine.request import MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_REPETITION_PENALTY, SamplingParams
from engine.structured import structured_output

MAX_N = 16
MAX_PROMPTS = 256  # prompts in one /v1/completions request
MAX_CHOICES = 256  # prompts × n: what one request may fan out into
MAX_STOP_STRINGS = 16
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


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
