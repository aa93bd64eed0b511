"""The OpenAI wire format of /v1/completions and /v1/chat/completions: request bodies in, bodies out.

Requests are pydantic models parsed in strict JSON mode (``"max_tokens": "5"`` is a 400, not a 5);
an explicit null means the field's default; fields we do not know are ignored, fields we know but cannot
honour (suffix, best_of != n) are refused with a 400 rather than silently dropped. Chat's ``tools``,
``tool_choice`` and the history's tool calls are router/openai/tools.py's; the message a choice's text becomes
(content, reasoning, tool calls) is router/openai/assistant_message.py's. ``n`` choices
run as n engine requests; with a seed, choice i gets ``seed + i`` so the choices differ and the response
is still reproducible. /v1/completions takes a list of prompts (strings or token-id lists, at most
``MAX_PROMPTS``, and at most ``MAX_CHOICES`` prompts × n): choice ``index = prompt_index * n + i``, as
OpenAI numbers them, each prompt with its own echo and prompt logprobs.

Penalties, ``logit_bias``, ``response_format`` (json_object / json_schema) and ``structured_outputs`` (vLLM's:
json, regex, choice, grammar) become engine
SamplingParams (engine/sampling/sampler.py, engine/sampling/structured.py apply them on whichever worker samples), and
so does ``cache_salt`` (vLLM's: a non-empty string of at most 256 characters that salts the request's block
hashes, so its prefix-cache hits come only from requests with the same salt; router/tenancy.py).
``echo`` with ``logprobs`` asks the engine for prompt logprobs: the prompt's tokens lead the choice's
logprobs with the first one null, as OpenAI sends them.

Response bodies (streamed or not) are built in router/openai/response_builder.py.
"""
from __future__ import annotations

import dataclasses
import json
from abc import abstractmethod
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from engine.errors import InvalidRequestError
from engine.request import (
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    SamplingParams,
    StructuredOutput,
)
from engine.sampling.structured import structured_output
from router.openai.base import BadRequest, StrictModel
from router.openai.tool_parsers import ToolFormat
from router.openai.tools import MAX_TOOLS, ToolCall, ToolChoice, ToolDef, ToolPlan, history_message

MAX_N = 16
MAX_PROMPTS = 256  # prompts in one /v1/completions request
MAX_CHOICES = 256  # prompts × n: what one request may fan out into
MAX_STOP_STRINGS = 16
MAX_TEMPLATE_KWARGS = 16
MAX_KWARG_CHARS = 4096
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token",
                                     "eos_token", "raise_exception", "strftime_now"})
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


# ---------------------------------------------------------------------------------------------- requests


class StreamOptions(StrictModel):
    include_usage: bool = False


class JsonSchemaFormat(StrictModel):
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced (constrained decoding), strict or not


class ResponseFormat(StrictModel):
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


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs``: exactly one constraint on the whole output — ``json`` (a JSON Schema, as
    an object or JSON text), ``regex``, ``choice`` (strings), ``grammar`` (Lark or GBNF) or ``json_object``.
    Keys we do not enforce (vLLM's whitespace and fallback switches) are refused, not ignored."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def structured(self):
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise BadRequest("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(k.rstrip('_') for k in given) or 'none'}", "structured_outputs")
        kind = given[0]
        if kind == "json_object":
            return structured_output("json_object")
        value = getattr(self, kind)
        text = {"json_": lambda v: v if isinstance(v, str) else json.dumps(v), "choice": json.dumps}.get(
            kind, lambda v: v)(value)
        try:
            return structured_output("json_schema" if kind == "json_" else kind, text)
        except InvalidRequestError as e:
            raise BadRequest(f"structured_outputs.{kind.rstrip('_')}: {e}", "structured_outputs") from None


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made (router/openai/tools.py)

    def template_input(self, where: str = "messages") -> dict[str, Any]:
        """The message as a chat template expects it: plain string content, known roles only, an assistant's
        tool calls with their arguments as objects."""
        if self.role == "tool" and not self.tool_call_id:
            raise BadRequest(f"{where}: a tool message needs the tool_call_id it answers", "messages")
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        message |= {k: v for k, v in (("name", self.name), ("tool_call_id", self.tool_call_id)) if v is not None}
        return message | history_message(self.role, self.tool_calls, where)


class GenerationRequest(StrictModel):
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
    structured_outputs: StructuredOutputs | None = None  # extension (vLLM): regex, choice, grammar, json
    # extension (vLLM): prefix-cache hits only between requests with the same salt (router/tenancy.py)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int, tenant_salt: str | None = None,
                        tool_constraint: StructuredOutput | None = None,
                        keep_special_tokens: bool = False) -> list[SamplingParams]:
        """One SamplingParams per choice; raises InvalidRequestError for what we cannot honour.
        ``tenant_salt``: the API key's (router/tenancy.py), when the router salts by key; ``tool_constraint``:
        the grammar that enforces the request's tool calls (router/openai/tools.py)."""
        self.check_supported()
        structured = self.structured()
        if tool_constraint is not None:
            if structured is not None:
                raise BadRequest("response_format / structured_outputs cannot be combined with tool calls that are "
                                 "enforced (tool_choice required or named, strict tools, or a model whose template "
                                 "has no tool format)", "tools")
            if self.ignore_eos:
                raise BadRequest("ignore_eos cannot be combined with enforced tool calls (the grammar ends with "
                                 "EOS)", "ignore_eos")
            structured = tool_constraint
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
            structured=structured,
            skip_special_tokens=not keep_special_tokens,
            cache_salt=self.cache_salt,
            tenant_salt=tenant_salt,
        )
        if self.seed is None:
            return [base] * self.n
        return [dataclasses.replace(base, seed=self.seed + i) for i in range(self.n)]

    def check_supported(self) -> None:
        if self.ignore_eos and self.structured() is not None:
            raise BadRequest("ignore_eos cannot be combined with a constrained output (response_format or "
                             "structured_outputs: the grammar ends with EOS)", "ignore_eos")

    def structured(self):
        """The engine's StructuredOutput from ``response_format`` or ``structured_outputs`` (not both)."""
        fmt = self.response_format.structured() if self.response_format else None
        if self.structured_outputs is None:
            return fmt
        if fmt is not None:
            raise BadRequest("response_format and structured_outputs cannot both constrain the output",
                             "structured_outputs")
        return self.structured_outputs.structured()

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
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # extension (vLLM): variables for the chat template, e.g. {"enable_thinking": false}
    chat_template_kwargs: Annotated[dict[str, bool | int | float | Annotated[str, Field(max_length=MAX_KWARG_CHARS)]],
                                    Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None

    def check_supported(self) -> None:
        super().check_supported()
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
        return [m.template_input(f"messages[{i}]") for i, m in enumerate(self.messages)]

    def tool_plan(self, fmt: ToolFormat) -> ToolPlan | None:
        return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls, fmt)

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, minus the names the server itself sets (a client cannot replace the messages)."""
        kwargs = dict(self.chat_template_kwargs or {})
        taken = sorted(RESERVED_TEMPLATE_NAMES & kwargs.keys())
        if taken:
            raise BadRequest(f"chat_template_kwargs cannot set {', '.join(taken)}", "chat_template_kwargs")
        return kwargs
