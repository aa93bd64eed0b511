"""Structured output: constrained decoding to JSON (``json_object``), a JSON Schema (``json_schema``), a regular
expression (``regex``), one of a list of strings (``choice``) or a Lark / GBNF grammar (``grammar``).

The grammar library is llguidance (MIT, Rust with Python bindings, no Python dependencies): of the
libraries that import no torch (the router validates schemas) it had the lowest measured per-token cost on
SmolLM2's 49,152-token vocabulary and the only one that handles free JSON; xgrammar's masks are ~5 µs/token
cheaper but it imports torch and compiled a pattern-heavy schema in 0.6 s (docs/benchmarks.md,
"Structured output: grammar library choice"; ``python -m bench.engine.grammar_overhead``).

- **Validation** (:func:`check_structured_output`, torch-free, called by the router for an HTTP 400):
  the schema must be JSON text holding an object, pass jsonschema's meta-schema check (its ``$schema``
  draft, 2020-12 by default), and compile with llguidance (no tokenizer needed, well under 1 ms).
  llguidance refuses what it cannot enforce (``not``, ``if``/``then``, ``uniqueItems``, unknown
  ``format``s, remote ``$ref``s, unsatisfiable bounds) rather than ignoring it: what it accepts it
  enforces.
- **Objects are closed by default** (:func:`close_objects`): an object schema that lists its ``properties`` and
  says nothing of others (no ``additionalProperties``, ``patternProperties`` or ``unevaluatedProperties``) gets
  no others, and an array with ``prefixItems`` and no ``items`` no more items — what xgrammar's strict mode, vLLM's
  default, does. JSON Schema's default lets the model invent keys: SmolLM2, asked for a LangChain
  ``with_structured_output`` tool (no ``additionalProperties``), wrote the two fields and then schema keywords as
  keys until ``max_tokens`` cut the call. Branches of an ``allOf`` stay open (closing each would reject the
  others' keys). What the schema states is kept.
- **Integers are bounded by default**: a schema's ``"type": "integer"`` without a ``minimum`` / ``maximum`` gets
  ±(2^53 − 1), JavaScript's safe range (and within int64), where the JSON Schema says nothing
  (:func:`bound_integers`). Unbounded, a small model repeats digits (SmolLM2 wrote ``"population":11112222333…``
  until ``max_tokens`` cut the document) into numbers no JSON client can hold; bounded, the grammar closes the
  number after 16 digits at most. Bounds the schema states are kept; ``number`` (fractions) is not bounded.
- **Regex, choice, grammar** (vLLM's ``structured_outputs``): the whole output must match; a grammar is Lark
  (llguidance's dialect) or GBNF (llama.cpp's, converted to Lark).
- **Whitespace is compact**: ``,`` and ``:`` with no whitespace anywhere outside strings (what
  ``json.dumps(separators=(",", ":"))`` writes). Free whitespace lets a small model loop on spaces and
  newlines until max_tokens; with none, every token the mask allows makes progress.
- **Token bytes** come from our own :class:`~engine.text.tokenizer.Tokenizer` (``token_bytes()``), so GGUF
  checkpoints work like HF directories. Special tokens are marked special, so no special token can spell
  grammar text. Ids past the tokenizer's vocabulary (padding rows of a larger lm_head) are empty tokens,
  never allowed.
- **EOS**: the tokenizer's EOS ids are the grammar's stop tokens. The mask allows EOS only where the
  document is complete; once nothing can extend it, EOS is the only token allowed. ``is_terminated`` then
  says so (the engine may finish the request without sampling). A request cut by max_tokens ends with an
  incomplete document, as in every server.
- **State is the output tokens**: a matcher is a pure function of the tokens it accepted, so the decode
  worker rebuilds it after a KV handoff or a migration by feeding the output tokens (``matcher(spec,
  output_token_ids)``); matchers are never pickled or sent between workers.
- **Cost** (2-vCPU dev VM, SmolLM2): compiling a schema takes 0.3-3 ms; the LRU keeps a fresh matcher per
  spec and hands out deep copies (~0.06 ms). Per token ~30 µs: the mask 6-10 µs (median; up to ~80 µs
  inside long free strings, where most of the vocabulary is allowed), applying it ~19 µs (a 0 / -inf bias
  looked up per mask byte and added: constant time, unlike ``masked_fill_``), accepting 1-2 µs.
  :func:`mask_logits_batch` (what the sampler calls) does several rows at once.
- **Tool-call lists** (``CallListOutput``) also end at their first repeated call: engine/sampling/call_lists.py.
- **Threads**: one matcher is used by one thread at a time (the engine thread); the backend's cache is
  locked, so matchers may be created from any thread.
"""
from __future__ import annotations

import functools
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import jsonschema
import llguidance
import numpy as np

from engine.errors import InvalidRequestError
from engine.request import StructuredOutput
from engine.sampling.call_lists import CallListOutput, RepeatGuard, TokenTable

if TYPE_CHECKING:  # torch only where logits are touched: the router imports this module for the check
    import torch

    from engine.text.tokenizer import Tokenizer

# llguidance's JSON compile options: no free whitespace, json.dumps' compact separators.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
JSON_OBJECT_SCHEMA = {"type": "object"}
MAX_CACHED_GRAMMARS = 64
MAX_CHOICES = 1024
SAFE_INTEGER = 2**53 - 1  # the default bound of a schema's integers (JavaScript's Number.MAX_SAFE_INTEGER)
_WHAT = {"json_object": "the JSON object", "json_schema": "the JSON schema", "regex": "the regex",
         "choice": "the choice", "grammar": "the grammar"}
# llguidance's pool gets 80% of the CPUs; below this, handing masks to it costs more than it saves (2-vCPU VM:
# 17 µs vs 5 µs per mask).
_MIN_CPUS_FOR_PARALLEL_MASKS = 4


def structured_output(kind: str, schema: str | None = None) -> StructuredOutput:
    """A checked spec, what the front doors build: InvalidRequestError as :func:`check_structured_output`."""
    spec = StructuredOutput(kind, schema)
    check_structured_output(spec)
    return spec


def check_structured_output(spec: StructuredOutput) -> None:
    """Torch-free. Raise :class:`InvalidRequestError` naming the problem when the schema is not JSON, not a
    valid JSON Schema, or uses something llguidance cannot enforce."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(_grammar_of(spec))
    if is_error:
        raise InvalidRequestError(f"{_WHAT[spec.kind]} cannot be enforced: {messages[0]}")


def _grammar_of(spec: StructuredOutput) -> str:
    """llguidance grammar text (a JSON document) for the spec; checks the constraint on the way."""
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, overrides=COMPACT_JSON)
    if spec.kind != "json_schema":
        return _grammar_of_text(spec)
    try:
        schema = json.loads(spec.schema)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}") from e
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"the JSON schema must be a JSON object, got {type(schema).__name__}")
    _check_meta_schema(schema)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(generation_schema(schema), overrides=COMPACT_JSON)
    except ValueError as e:
        raise InvalidRequestError(f"the JSON schema cannot be enforced: {e}") from e


def _grammar_of_text(spec: StructuredOutput) -> str:
    """regex / choice / grammar: llguidance grammar text; InvalidRequestError naming what is wrong."""
    text = spec.schema
    if spec.kind == "choice":
        try:
            choices = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"the choice list is not valid JSON: {e}") from e
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings")
        if len(choices) > MAX_CHOICES:
            raise InvalidRequestError(f"choice may list at most {MAX_CHOICES} strings, got {len(choices)}")
    elif not text.strip():
        raise InvalidRequestError(f"{_WHAT[spec.kind]} is empty")
    try:
        return llguidance.grammar_from({"regex": "regex", "choice": "choice", "grammar": "grammar"}[spec.kind], text)
    except ValueError as e:  # a regex or grammar llguidance cannot parse (GBNF conversion errors included)
        raise InvalidRequestError(f"{_WHAT[spec.kind]} cannot be enforced: {e}") from e


def generation_schema(schema: dict) -> dict:
    """The schema a grammar is built from: objects closed, integers bounded (both documented above)."""
    return bound_integers(close_objects(schema))


_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_VALUE_KEYS = ("const", "enum", "default", "examples")  # JSON values, not schemas: never rewritten
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")  # name -> schema


def _rewrite(schema, fix, in_all_of: bool = False):
    """A copy of ``schema`` with ``fix(node, copy, in_all_of)`` applied to every subschema's copy, bottom-up —
    in properties, items, combinators and definitions alike (a mapping of names to schemas is not a schema)."""
    if isinstance(schema, list):
        return [_rewrite(s, fix, in_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _VALUE_KEYS:
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _rewrite(sub, fix) for name, sub in v.items()}
        else:
            out[k] = _rewrite(v, fix, in_all_of=k == "allOf")
    fix(schema, out, in_all_of)
    return out


def close_objects(schema):
    """A copy of ``schema`` where every object schema with ``properties`` and none of ``_OPEN_KEYS`` gets
    ``"additionalProperties": false``, and every array schema with ``prefixItems`` and no ``items`` /
    ``unevaluatedItems`` gets ``"items": false`` — except the direct branches of an ``allOf``."""
    def close(node: dict, out: dict, in_all_of: bool) -> None:
        if in_all_of or "allOf" in node:
            return
        if isinstance(node.get("properties"), dict) and not any(k in node for k in _OPEN_KEYS):
            out["additionalProperties"] = False
        if isinstance(node.get("prefixItems"), list) and "items" not in node and "unevaluatedItems" not in node:
            out["items"] = False

    return _rewrite(schema, close)


def bound_integers(schema):
    """A copy of ``schema`` where every ``"type": "integer"`` (or a type list holding it) without a lower or
    upper bound gets ±``SAFE_INTEGER`` there. Bounds the schema states (``minimum``, ``exclusiveMinimum``, ...)
    are kept, and so is a ``const`` / ``enum`` (already finite)."""
    def bound(node: dict, out: dict, _in_all_of: bool) -> None:
        kind = node.get("type")
        if not (kind == "integer" or isinstance(kind, list) and "integer" in kind) or "const" in node \
                or "enum" in node:
            return
        if "minimum" not in node and "exclusiveMinimum" not in node:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in node and "exclusiveMaximum" not in node:
            out["maximum"] = SAFE_INTEGER

    return _rewrite(schema, bound)


def _check_meta_schema(schema: dict) -> None:
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "the root"
        raise InvalidRequestError(f"not a valid JSON Schema: {e.message} (at {where})") from e


class GrammarBackend:
    """One per engine, built lazily on the first structured request (building it reads the vocabulary
    once, ~0.2 s for 49k tokens). Hands out :class:`GrammarMatcher` s; compiled grammars are cached."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        token_bytes = tokenizer.token_bytes()
        self._token_bytes, self._special_ids = token_bytes, tokenizer.special_token_ids
        if vocab_size < len(token_bytes):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(token_bytes)} ids")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        if not self.eos_token_ids:
            raise ValueError("structured output needs at least one EOS token id")
        wrapped = _TokenizerView(tokenizer, token_bytes + [b""] * (vocab_size - len(token_bytes)),
                                 self.eos_token_ids[0])
        self._ll_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapped),
                                                    eos_token=list(self.eos_token_ids))
        self._num_mask_words = (vocab_size + 31) // 32
        self._fresh: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._table: TokenTable | None = None  # the repeat rule's view of the vocabulary, built on first use

    def matcher(self, spec: StructuredOutput, output_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher at the start of the output, or after ``output_token_ids`` (rebuilding one after a
        handoff). InvalidRequestError if the spec does not compile."""
        with self._lock:
            fresh = self._fresh.get(spec)
            if fresh is None:
                fresh = self._compile(spec)
                self._fresh[spec] = fresh
                if len(self._fresh) > MAX_CACHED_GRAMMARS:
                    self._fresh.popitem(last=False)
            else:
                self._fresh.move_to_end(spec)
            ll_matcher = fresh.deep_copy()
        guard = RepeatGuard(self._token_table(), spec.list_depth) if isinstance(spec, CallListOutput) else None
        matcher = GrammarMatcher(ll_matcher, self._num_mask_words, self.vocab_size, guard)
        for token_id in output_token_ids:
            matcher.accept(token_id)
        return matcher

    def _token_table(self) -> TokenTable:
        with self._lock:
            if self._table is None:
                self._table = TokenTable(self._token_bytes, self._special_ids)
            return self._table

    def _compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        ll_matcher = llguidance.LLMatcher(self._ll_tokenizer, _grammar_of(spec), log_level=0)
        if ll_matcher.is_error():
            raise InvalidRequestError(f"{_WHAT[spec.kind]} cannot be enforced: {ll_matcher.get_error()}")
        return ll_matcher


class GrammarMatcher:
    """One request's grammar state. Not thread-safe, not picklable: rebuild with
    ``GrammarBackend.matcher(spec, output_token_ids)``."""

    def __init__(self, ll_matcher: llguidance.LLMatcher, num_mask_words: int, vocab_size: int,
                 guard: RepeatGuard | None = None):
        self._ll = ll_matcher
        self._guard = guard  # a tool-call list's repeat rule (engine/sampling/call_lists.py), narrowing the masks
        self._bitmask = np.empty((1, num_mask_words), dtype=np.int32)  # one bit per token id, 1 = allowed
        self._vocab_size = vocab_size

    def accept(self, token_id: int) -> None:
        """Advance by one sampled token; RuntimeError if the grammar did not allow it."""
        if not self._ll.consume_token(token_id):
            raise RuntimeError(f"token {token_id} is not allowed by the grammar: {self._ll.get_error()}")
        if self._guard is not None:
            self._guard.accept(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepts (speculative decoding's refused drafts)."""
        self._ll.rollback(num_tokens)
        if self._guard is not None:
            self._guard.rollback(num_tokens)

    def mask_logits(self, logits_row: torch.Tensor) -> None:
        """In place: -inf on every token the grammar forbids now. ``logits_row``: [vocab_size] float."""
        self.fill_bitmask(self._bitmask[0])
        apply_token_bitmask_(logits_row.unsqueeze(0), self._bitmask, [0])

    def fill_bitmask(self, bitmask_row: np.ndarray) -> None:
        """Write the next-token mask into ``bitmask_row``: [ceil(vocab_size / 32)] int32, contiguous; bit t
        of the little-endian words is 1 where token t is allowed."""
        if bitmask_row.dtype != np.int32 or bitmask_row.shape != self._bitmask.shape[1:] \
                or not bitmask_row.flags.c_contiguous:
            raise ValueError(f"bitmask_row must be contiguous int32 of shape {self._bitmask.shape[1:]}")
        self._ll.unsafe_compute_mask_ptr(bitmask_row.ctypes.data, bitmask_row.nbytes)
        self._raise_if_error()
        if self._guard is not None:
            self._guard.restrict(bitmask_row)

    @property
    def is_terminated(self) -> bool:
        """The document is complete and nothing can extend it (only EOS may follow), or EOS was accepted."""
        return self._ll.is_stopped()

    def allowed_token_ids(self) -> list[int]:
        """The ids the next mask allows (for tests and debugging; the engine uses mask_logits)."""
        self.fill_bitmask(self._bitmask[0])
        return np.flatnonzero(_unpack(self._bitmask[0], self._vocab_size)).tolist()

    def _raise_if_error(self) -> None:
        if self._ll.is_error():
            raise RuntimeError(f"grammar matcher failed: {self._ll.get_error()}")


def mask_logits_batch(matchers: Sequence[GrammarMatcher], logits: torch.Tensor, rows: Sequence[int]) -> None:
    """``matchers[i].mask_logits(logits[rows[i]])`` for all i: the masks are computed on llguidance's thread
    pool (GIL released) where there are cores for it, and applied together (one host-to-device copy and one
    ``index_add_`` on a GPU). ``logits``: [num_rows, vocab_size]."""
    if not matchers:
        return
    bitmask = np.empty((len(matchers), matchers[0]._bitmask.shape[1]), dtype=np.int32)
    if len(matchers) > 1 and (os.cpu_count() or 1) >= _MIN_CPUS_FOR_PARALLEL_MASKS:
        _executor().unsafe_compute_mask_ptr([(m._ll, i) for i, m in enumerate(matchers)],
                                            bitmask.ctypes.data, bitmask.shape[1] * 4, len(matchers))
        for m, row in zip(matchers, bitmask):
            m._raise_if_error()
            if m._guard is not None:
                m._guard.restrict(row)
    else:
        for m, row in zip(matchers, bitmask):
            m.fill_bitmask(row)
    apply_token_bitmask_(logits, bitmask, rows)


@functools.lru_cache(maxsize=1)
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: np.ndarray, rows: Sequence[int]) -> None:
    """``logits[rows[i], t] = -inf`` where bit t of ``bitmask[i]`` is 0. ``logits``: [num_rows, vocab_size]
    on any device; ``bitmask``: [len(rows), ceil(vocab_size / 32)] int32 on the host, bit t of the
    little-endian words = token t. Adds a 0 / -inf bias looked up per mask byte: constant time whatever the
    mask (``masked_fill_`` with a bool mask costs 2-20x more on CPU, depending on the pattern)."""
    import torch

    num_rows, vocab_size = len(rows), logits.shape[-1]
    mask_bytes = bitmask.view(np.uint8).reshape(num_rows, -1)
    if logits.device.type == "cpu":
        bias = torch.from_numpy(np.take(_BYTE_BIAS, mask_bytes, axis=0).reshape(num_rows, -1))
    else:
        index = torch.from_numpy(mask_bytes).to(logits.device).long()
        bias = _byte_bias_on(logits.device)[index].reshape(num_rows, -1)
    bias = bias[:, :vocab_size].to(logits.dtype)
    if logits.device.type == "cpu" or num_rows == 1:  # CPU: row adds beat index_add_
        for i, row in enumerate(rows):
            logits[row].add_(bias[i])
    else:
        logits.index_add_(0, torch.as_tensor(rows, device=logits.device), bias)


# Row b: the bias of the 8 tokens that mask byte b covers, 0 where its bit is set (allowed), else -inf.
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"),
                      np.float32(0), np.float32("-inf"))


@functools.lru_cache(maxsize=8)
def _byte_bias_on(device: torch.device) -> torch.Tensor:
    import torch

    return torch.from_numpy(_BYTE_BIAS).to(device)


def _unpack(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[..., words] int32 -> [..., vocab_size] bool, bit t of the little-endian words at index t."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, count=vocab_size, bitorder="little")
    return bits.view(np.bool_)


class _TokenizerView:
    """What llguidance.TokenizerWrapper reads from a tokenizer: token bytes, special ids, EOS/BOS, encode."""

    def __init__(self, tokenizer: Tokenizer, token_bytes: list[bytes], eos_token_id: int):
        self._tokenizer = tokenizer
        self.tokens = token_bytes
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False)
