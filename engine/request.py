"""A request: the one object that carries a sequence through the engine, owned by the scheduler.

"There is no prefill phase or decode phase": each step schedules ``num_tokens - num_computed_tokens``
tokens of a request (a whole prompt, a chunk of it, or the one token sampled last step) and the
request's computed-token count catches up with its token count. A preempted request drops its blocks,
resets ``num_computed_tokens`` to 0 and later recomputes prompt + outputs (outputs are never resampled).
"""
from __future__ import annotations

import dataclasses
import enum
import math
import time
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # decode role: blocks allocated, KV in flight
    WAITING_FOR_TIER_LOAD = "waiting_for_tier_load"  # prefix blocks being loaded from the host / disk tier
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    FINISHED_REMOTE = "remote"  # prefill role: first token sampled, KV handed off to a decode worker

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_REMOTE}

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries per request (OpenAI does not state a bound; one is needed)
MAX_REPETITION_PENALTY = 10.0
MAX_CACHE_SALT_CHARS = 256
ROPE_FACTOR_SETS = ("short", "long")  # LongRoPE's two sets (SamplingParams.rope_factors)
LONG_ROPE_SALT = "longrope:long"  # the block-hash salt part of the long set
LORA_SALT = "\x1flora="  # + the adapter's name: the block-hash salt part of a request served with a LoRA adapter
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")  # StructuredOutput.kind


@dataclass(frozen=True)
class ResumeState:
    """A request continued on another worker after the one generating it died (the router's migration).

    The new prompt is the original prompt followed by the ``num_output_tokens`` tokens already generated;
    ``num_emitted_chars`` of their text already reached the client. The engine replays those tokens through
    a fresh detokenizer (so text held back for a stop string or an unfinished UTF-8 character is emitted
    exactly once) and numbers its samples from ``num_output_tokens`` (so a seeded request draws the same
    noise as it would have without the move). ``max_tokens`` and ``min_tokens`` are what remains."""

    num_output_tokens: int
    num_emitted_chars: int


@dataclass(frozen=True)
class StructuredOutput:
    """Constrained decoding: the output must be JSON (``json_object``), JSON valid against a JSON Schema
    (``json_schema``), match a regular expression (``regex``), be one of a list of strings (``choice``: the
    list as JSON text) or derive from a Lark / GBNF grammar (``grammar``). ``schema`` holds the constraint as
    text (none for ``json_object``), so the params stay hashable and picklable. engine/sampling/structured.py compiles
    it into a token mask; the mask is rebuilt from the output tokens on whichever worker samples (after a
    handoff or a migration)."""

    kind: str  # one of STRUCTURED_KINDS
    schema: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                                      f"got {self.kind!r}")
        if (self.kind != "json_object") != isinstance(self.schema, str):
            raise InvalidRequestError(f"a {self.kind} structured output needs its constraint as text"
                                      if self.kind != "json_object" else "a json_object structured output takes "
                                      "no schema")



@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: also the n most likely
    min_tokens: int = 0
    # penalties (engine/sampling/sampler.py has the formulas): OpenAI's presence/frequency over the generated tokens,
    # transformers'/vLLM's multiplicative repetition penalty over prompt + generated tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted by id
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob (+ the k most likely)
    structured: StructuredOutput | None = None
    # False: special tokens are written into the text (vLLM's field) — set by the router when the chat template's
    # tool-call or thinking marker is one (Mistral's [TOOL_CALLS]); the EOS that ends a request never is
    skip_special_tokens: bool = True
    resume: ResumeState | None = None  # set by the router when it migrates a request, never by clients
    # tenant isolation (engine/kv/hashing.py): both enter the block-hash root, so blocks are shared only by
    # requests with the same two values. cache_salt is the client's (vLLM's field); tenant_salt is derived
    # from the API key by the router (router/tenancy.py), never sent by clients. Kept out of repr (logs).
    cache_salt: str | None = field(default=None, repr=False)
    tenant_salt: str | None = field(default=None, repr=False)
    # LongRoPE's factor set (``ROPE_FACTOR_SETS``), chosen once at admission (``admit_rope_factors``) by the
    # router or the engine, never by clients, and kept by every worker that touches the request; None for a
    # model without LongRoPE. The long set enters the block-hash salt (``hash_salt``).
    rope_factors: str | None = None
    # the LoRA adapter this request runs with (engine/lora/; a name of EngineConfig.lora_modules); None: the base
    # model. It enters the block-hash salt (``hash_salt``): no prefix sharing across adapters, sharing within one.
    lora: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise bad(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if self.lora is not None and not (isinstance(self.lora, str) and self.lora):
            raise bad(f"lora must be a non-empty adapter name or null, got {self.lora!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise bad(f"skip_special_tokens must be true or false, got {self.skip_special_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative integers")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2 <= value <= 2:
                raise bad(f"{name} must be in [-2, 2], got {value!r}")
        if not _finite(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise bad(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {self.repetition_penalty!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for token_id, value in self.logit_bias:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise bad(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            if not _finite(value) or not -100 <= value <= 100:
                raise bad(f"logit_bias values must be in [-100, 100], got {value!r} for token {token_id}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise bad("logit_bias names a token more than once")
        if self.prompt_logprobs is not None and not (
                isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise bad(f"structured must be a StructuredOutput, got {self.structured!r}")
            if self.ignore_eos or self.min_tokens:
                raise bad("ignore_eos and min_tokens cannot be combined with structured output (the grammar "
                          "decides where the output ends)")
        for name in ("cache_salt", "tenant_salt"):
            salt = getattr(self, name)
            if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
                raise bad(f"{name} must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                          f"got {_describe(salt)}")
        r = self.resume
        if r is not None and not (isinstance(r, ResumeState) and isinstance(r.num_output_tokens, int)
                                  and r.num_output_tokens >= 1 and isinstance(r.num_emitted_chars, int)
                                  and r.num_emitted_chars >= 0):
            raise bad(f"resume must be a ResumeState with num_output_tokens >= 1, got {r!r}")
        if self.rope_factors is not None and self.rope_factors not in ROPE_FACTOR_SETS:
            raise bad(f"rope_factors must be one of {', '.join(ROPE_FACTOR_SETS)}, got {self.rope_factors!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def hash_salt(self) -> tuple[str, ...]:
        """The salt of this request's block hashes (engine/kv/hashing.py ``salted_root``): () when unsalted,
        else (tenant salt, cache salt) with "" for the one that is absent; LongRoPE's long factor set adds a
        part (its blocks hold other K values for the same tokens), the short set none (so a model served
        within its pre-training length hashes as it always did); a LoRA adapter adds ``LORA_SALT`` + its name
        (its K and V differ from the base's and from every other adapter's)."""
        extra = (LONG_ROPE_SALT,) if self.rope_factors == "long" else ()
        if self.lora is not None:
            extra += (LORA_SALT + self.lora,)
        if self.tenant_salt is None and self.cache_salt is None and not extra:
            return ()
        return (self.tenant_salt or "", self.cache_salt or "", *extra)


def admit_rope_factors(params: SamplingParams, num_prompt_tokens: int,
                       longrope_original_len: int | None) -> SamplingParams:
    """``params`` with LongRoPE's factor set chosen, from what the request can reach: the short factors when
    prompt + max_tokens stay within the pre-training length ``longrope_original_len``, else the long ones
    (transformers' rule, applied to the request's whole reach instead of each forward pass: one set per
    request is what stays consistent across a handoff, a migration, TP ranks and a draft model; see
    docs/ARCHITECTURE.md "LongRoPE"). A set already chosen (by the router, or before a migration) is kept.
    ``longrope_original_len`` None: the model has no LongRoPE, and a chosen set is an error."""
    if longrope_original_len is None:
        if params.rope_factors is not None:
            raise InvalidRequestError(f"rope_factors={params.rope_factors!r} given for a model without LongRoPE")
        return params
    if params.rope_factors is not None:
        return params
    reach = num_prompt_tokens + params.max_tokens
    return dataclasses.replace(params, rope_factors="long" if reach > longrope_original_len else "short")


def check_prompt(prompt_token_ids, params: SamplingParams, *, vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt as a list, or InvalidRequestError when it is empty, holds ids outside the vocabulary, or
    does not fit the context with ``params.max_tokens``. Pure: the engine and the router both call it."""
    ids = list(prompt_token_ids)
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise InvalidRequestError(f"logit_bias token ids out of range [0, {vocab_size}): {bad[:5]}")
    total = len(ids) + params.max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens; the request needs "
            f"{total} ({len(ids)} in the prompt + {params.max_tokens} max_tokens)")
    return ids


def _describe(value: object) -> str:
    """A rejected value for an error message: strings by length only (a salt is a secret)."""
    return f"a string of {len(value)} characters" if isinstance(value, str) else type(value).__name__


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's sampling seed (its own, or one the engine drew)
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # when a step first ran it (not counting a preemption's restart)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # params.prompt_logprobs: one entry per prompt token, the first None (nothing precedes it)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    grammar: object | None = None  # engine.sampling.structured.GrammarMatcher for params.structured
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at the first scheduling
    blocks: list = field(default_factory=list)  # engine.kv.block_pool.Block, in sequence order
    block_hashes: list[int] = field(default_factory=list)  # of every full block of all_token_ids
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_preemptions: int = 0
    lora_passed_over: int = 0  # requests of other adapters that took a slot while its adapter found none
    lora_reserved: bool = False  # it was passed over enough to reserve the next slot (engine/sched/scheduler.py)
    stop_reason: int | str | None = None
    error: str | None = None
    detokenizer: object | None = None  # engine.text.tokenizer.IncrementalDetokenizer when text is produced
    text: str = ""
    num_stop_held_chars: int = 0  # trailing text withheld because it may begin a stop string
    num_prior_output_tokens: int = 0  # a resumed request: outputs generated before (the prompt's tail)
    remote_decode: bool = False  # prefill role: hand the KV off after the first token
    abort_pending: bool = False  # aborted while its KV was in flight: free blocks once the transfer ends
    peer_blocks: object | None = None  # engine.kv.handoff.PeerBlocks lent by a peer for the prefix, until admitted
    # speculative decoding (engine/speculative/decoder.py): drafts proposed for the next step, verified by it (never
    # part of all_token_ids: only the accepted ones are appended)
    spec_token_ids: list[int] = field(default_factory=list)
    # prompt + outputs as one list, kept in step by append_output_token (read on every step: no copies)
    all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def generated_token_ids(self) -> list[int]:
        """Every token this request generated, including those before a migration (the prompt's tail)."""
        n = self.num_prior_output_tokens
        return (self.prompt_token_ids[-n:] + self.output_token_ids) if n else self.output_token_ids

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed (a prefix-cache hit would skip their logits)."""
        # not after a token was sampled: a decode worker recomputing a handed-off prompt (the prefill
        # worker sent them) or a migrated request (sent before the move)
        return (self.params.prompt_logprobs is not None and self.params.resume is None
                and not self.output_token_ids and len(self.prompt_logprobs) < self.num_prompt_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def ttft_parts(self) -> dict[str, float] | None:
        """Queue and compute time of this request's first token here (None for one that arrived with its KV)."""
        start = self.first_scheduled_time
        if start is None:
            return None
        return {"queue_s": start - self.arrival_time, "compute_s": time.monotonic() - start}
