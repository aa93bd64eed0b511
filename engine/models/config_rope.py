"""RoPE fields of a config.json: ``rope_parameters`` (transformers >= 5; flat, or nested per layer type) and
``rope_theta`` + ``rope_scaling`` (< 5) read into one (type, theta, parameters), a conflict between spellings
refused (engine/models/config.py's rule 2). Which RoPE types run is here (:data:`ROPE_TYPES`); their arithmetic is
engine/models/layers.py's.

``partial_rotary_factor`` (RoPE on the first ``int(head_dim * factor)`` dims of each head, the rest passed
through) is read in both spellings too: top level (transformers < 5, and 5 writes it there as well) and inside
``rope_parameters`` (5). Of the architectures duet runs only transformers' Phi-3 applies it (Phi-4-mini:
0.75); the others' modeling code ignores it or fails on it, so a factor other than 1 is refused for them."""
from __future__ import annotations

from typing import Any

from engine.errors import ModelLoadError

# RoPE: the parameters each supported type reads (required, optional with transformers' default).
ROPE_TYPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor"), ("original_max_position_embeddings",)),
    # Phi-3: per-frequency divisors, short below the pre-training length, long beyond it (engine/models/layers.py)
    "longrope": (("short_factor", "long_factor"), ("original_max_position_embeddings", "factor", "attention_factor")),
}
# Parameters other RoPE types read: carrying one under a type that ignores it means the file is not what it
# says (transformers would silently drop it), so it is refused.
_ROPE_VOCABULARY = {"factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow",
                    "short_factor", "long_factor", "mscale", "mscale_all_dim", "truncate", "mrope_section",
                    "mrope_interleaved", "original_max_position_embeddings"}


def read_rope(cfg: dict[str, Any], layer_types: tuple[str, ...], max_pos: int, theta_default: float = 1e4,
              legacy_longrope: bool = False, partial_rotary: bool = False) -> tuple[str, float, tuple, float]:
    """(rope_type, rope_theta, type parameters, partial_rotary_factor) from rope_parameters and/or rope_theta +
    rope_scaling (+ partial_rotary_factor); a factor other than 1 only where ``partial_rotary`` (Phi-3)."""
    sources: list[tuple[str, dict[str, Any]]] = []
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ModelLoadError(f"rope_parameters must be an object, got {params!r}")
        if params and all(isinstance(v, dict) or v is None for v in params.values()):
            params = _one_rope_for_all_layers(params, layer_types)
        sources.append(("rope_parameters", params))
    scaling = cfg.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ModelLoadError(f"rope_scaling must be an object, got {scaling!r}")
        sources.append(("rope_scaling", scaling))
    for key in ("rope_theta", "partial_rotary_factor"):
        if cfg.get(key) is not None:
            sources.append((key, {key: cfg[key]}))
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for source, values in sources:
        for key, value in values.items():
            key = "rope_type" if key == "type" else key
            if key in merged and merged[key] != value:
                raise ModelLoadError(f"config.json gives RoPE's {key} twice with different values: "
                                     f"{merged[key]!r} in {origin[key]} and {value!r} in {source}")
            merged[key], origin[key] = value, source
    rope_type = merged.pop("rope_type", "default")
    if legacy_longrope and rope_type in ("su", "yarn"):  # Phi-3's early names for LongRoPE (transformers maps them)
        rope_type = "longrope"
    theta = float(merged.pop("rope_theta", theta_default))
    partial = merged.pop("partial_rotary_factor", 1.0)
    if partial != 1.0 and not partial_rotary:
        raise ModelLoadError(f"partial_rotary_factor={partial!r} (rotary on part of each head) is not supported "
                             "for this architecture (Phi3ForCausalLM only)")
    if isinstance(partial, bool) or not isinstance(partial, (int, float)):
        raise ModelLoadError(f"partial_rotary_factor must be a number, got {partial!r}")
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope_type {rope_type!r} (in {origin.get('rope_type')}); "
                             f"supported: {', '.join(ROPE_TYPES)}")
    required, optional = ROPE_TYPES[rope_type]
    if "original_max_position_embeddings" in optional:  # Phi-3 keeps it at the top level too
        top = cfg.get("original_max_position_embeddings")
        if top is not None and merged.setdefault("original_max_position_embeddings", top) != top:
            raise ModelLoadError(f"config.json gives original_max_position_embeddings={top!r} and "
                                 f"{merged['original_max_position_embeddings']!r} in {origin['original_max_position_embeddings']}")
        merged.setdefault("original_max_position_embeddings", max_pos)  # transformers' fallback
    stray = sorted(k for k in merged if k in _ROPE_VOCABULARY and k not in required + optional)
    if stray:
        raise ModelLoadError(f"RoPE parameter(s) {stray} mean nothing for rope_type {rope_type!r}; "
                             "the file is inconsistent (which RoPE did its authors train with?)")
    frozen = {k: tuple(v) if isinstance(v, list) else v for k, v in merged.items()}  # factor lists, hashable
    return rope_type, theta, tuple(sorted((k, frozen[k]) for k in required + optional if k in frozen)), float(partial)


def _one_rope_for_all_layers(nested: dict[str, Any], layer_types: tuple[str, ...]) -> dict[str, Any]:
    """rope_parameters nested per layer type: duet runs one RoPE, so every type in use must agree."""
    used = sorted(set(layer_types))
    missing = [t for t in used if nested.get(t) is None]
    if missing:
        raise ModelLoadError(f"rope_parameters is nested by layer type but has no entry for {missing}")
    first = nested[used[0]]
    for t in used[1:]:
        if nested[t] != first:
            raise ModelLoadError(f"rope_parameters differ between layer types ({used[0]}: {first}, {t}: "
                                 f"{nested[t]}); duet applies one RoPE to every layer")
    return first
