"""``SpeculativeConfig``: the ``--speculative-config`` JSON, as vLLM users write it.

Keys (vLLM's ``vllm/config/speculative.py`` names, defaults and checks unless said otherwise):

- ``method``: ``ngram``, ``suffix`` or ``draft_model``. Absent: ``ngram`` when ``model`` is ``"ngram"``,
  ``draft_model`` when another ``model`` is given (vLLM also sniffs EAGLE / MTP / Medusa from the draft
  checkpoint; duet has none of those, so any other method is refused by name).
- ``num_speculative_tokens`` (>= 1): required for ``ngram`` and ``draft_model`` (vLLM would take a draft
  checkpoint's ``n_predict``; duet reads no draft checkpoint); for ``suffix`` it defaults to
  ``suffix_decoding_max_tree_depth`` and is the most drafts per step (vLLM's rule).
- ``model``: the draft checkpoint, required by ``draft_model``; ``ngram`` / ``suffix`` take none or their own
  name (what vLLM fills in).
- ``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram, >= 1): both absent -> 5 and 5 (vLLM's defaults,
  "arbitrarily chosen" in its source); one given -> the other equals it (vLLM's code; its field doc says
  min defaults to 1); min <= max.
- ``suffix_decoding_max_tree_depth`` (24, >= 1), ``suffix_decoding_max_cached_requests`` (10000, >= 0; 0
  turns the worker cache of finished outputs off), ``suffix_decoding_max_spec_factor`` (1.0, >= 0),
  ``suffix_decoding_min_token_prob`` (0.1, in [0, 1]).
- ``suffix_decoding_max_cached_nodes`` (duet's own, 262144, >= 1): the node bound of that cache, i.e. its
  memory bound (~0.4 KB a node in Python, so ~100 MB); vLLM's C++ cache is bounded by requests only.

Stricter than vLLM, by design: an unknown key (vLLM's other keys included, e.g. ``draft_tensor_parallel_size``)
and a key of another method (``prompt_lookup_max`` with ``suffix``) are a ``ConfigError`` naming the key, where
vLLM would ignore the second kind; a bool is not a number.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

from engine.errors import ConfigError

METHODS = ("ngram", "suffix", "draft_model")
SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_cached_nodes", "suffix_decoding_max_spec_factor",
               "suffix_decoding_min_token_prob")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, when neither bound is given
DEFAULT_MAX_TREE_DEPTH = 24
DEFAULT_MAX_CACHED_REQUESTS = 10000
DEFAULT_MAX_CACHED_NODES = 1 << 18
DEFAULT_MAX_SPEC_FACTOR = 1.0
DEFAULT_MIN_TOKEN_PROB = 0.1


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None  # set (both) for ngram, None otherwise
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH
    suffix_decoding_max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS
    suffix_decoding_max_cached_nodes: int = DEFAULT_MAX_CACHED_NODES
    suffix_decoding_max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR
    suffix_decoding_min_token_prob: float = DEFAULT_MIN_TOKEN_PROB

    def __post_init__(self) -> None:
        _check_method(self.method)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.model is not None and not (isinstance(self.model, str) and self.model):
            raise ConfigError(f"speculative config: model must be a non-empty string, got {self.model!r}")
        if self.method == "draft_model" and self.model is None:
            raise ConfigError("speculative config: method draft_model needs a model (the draft checkpoint)")
        if self.method in ("ngram", "suffix") and self.model not in (None, self.method):
            raise ConfigError(f"speculative config: method {self.method} takes no model, got {self.model!r}")
        if self.method == "ngram":
            _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
            _check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ConfigError(f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                                  f"prompt_lookup_max ({self.prompt_lookup_max})")
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            key = "prompt_lookup_min" if self.prompt_lookup_min is not None else "prompt_lookup_max"
            raise ConfigError(f"speculative config: {key} applies to method ngram only, not {self.method!r}")
        _check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1)
        _check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0)
        _check_int("suffix_decoding_max_cached_nodes", self.suffix_decoding_max_cached_nodes, 1)
        _check_float("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor, 0.0, math.inf)
        _check_float("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob, 0.0, 1.0)

    @property
    def needs_draft_model(self) -> bool:
        """Whether proposing needs a second model (``method`` draft_model: engine/spec/draft.py)."""
        return self.method == "draft_model"

    @classmethod
    def from_json(cls, text: str) -> "SpeculativeConfig":
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"speculative config is not valid JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> "SpeculativeConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"speculative config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(f"speculative config: unknown key {key!r} (duet knows {', '.join(sorted(known))})")
        d = dict(data)
        method = d.get("method")
        if method is None:
            model = d.get("model")
            if model is None:
                raise ConfigError("speculative config needs a method (ngram, suffix or draft_model) or a model")
            method = d["method"] = "ngram" if model == "ngram" else "draft_model"
        _check_method(method)
        if method != "suffix":
            for key in SUFFIX_KEYS:
                if key in d:
                    raise ConfigError(f"speculative config: {key} applies to method suffix only, not {method!r}")
        for key in ("prompt_lookup_min", "prompt_lookup_max", SUFFIX_KEYS[0]):
            if d.get(key) is not None:  # checked before it stands in for another key, so the error names it
                _check_int(key, d[key], 1)
        if method == "ngram":
            lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            d["prompt_lookup_min"] = hi if lo is None else lo
            d["prompt_lookup_max"] = lo if hi is None else hi
        if method == "suffix" and d.get("num_speculative_tokens") is None:
            d["num_speculative_tokens"] = d.get("suffix_decoding_max_tree_depth", DEFAULT_MAX_TREE_DEPTH)
        if d.get("num_speculative_tokens") is None:
            raise ConfigError(f"speculative config: method {method} needs num_speculative_tokens")
        return cls(**d)


def _check_method(method: Any) -> None:
    if not isinstance(method, str) or method not in METHODS:
        raise ConfigError(f"speculative config: method must be one of {', '.join(METHODS)}, got {method!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"speculative config: {name} must be an integer >= {minimum}, got {value!r}")


def _check_float(name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        bounds = f">= {lo}" if hi == math.inf else f"in [{lo}, {hi}]"
        raise ConfigError(f"speculative config: {name} must be a finite number {bounds}, got {value!r}")
