"""Gemma 2's and Gemma 3's (text) fields of a config.json, read the way transformers' modeling code applies them
(engine/models/config.py calls :func:`read_gemma` for these architectures; the result is ``ModelConfig.gemma``).

What Gemma 2 does beyond Llama, each a field here:
- the embeddings are scaled by sqrt(hidden_size), rounded to the model dtype (``embed_scale``);
- RMSNorm multiplies by (1 + weight) — the loader stores 1 + weight, so the norm code is Llama's
  (``norm_plus_one``);
- four norms per layer ("sandwich"): before and after attention, before and after the MLP, the residual added
  after each post-norm (``sandwich_norms``);
- the MLP gates with GELU, tanh approximation (``hidden_activation`` gelu_pytorch_tanh);
- attention scores are scaled by ``query_pre_attn_scalar`` ** -0.5 instead of head_dim ** -0.5, and soft-capped:
  tanh(s / c) * c before the mask and softmax (``attn_logit_softcapping``);
- the logits are soft-capped the same way (``final_logit_softcapping``);
- sliding and full attention alternate (the even layers slide, transformers' default ``layer_types``).

Gemma 3 keeps all of it but the soft-caps (off by default), adds Qwen3's per-head q/k norms (with Gemma's
1 + weight), slides on 5 layers of every 6 (``sliding_window_pattern``), and gives the sliding layers their own
RoPE: ``rope_parameters`` nested per layer type (transformers 5) or ``rope_local_base_freq`` beside the global
``rope_theta`` / ``rope_scaling`` (before) — :func:`gemma3_rope_sources` separates the two for the RoPE reader.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ModelLoadError

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass(frozen=True)
class GemmaFields:
    embed_scale: bool = False
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    gelu_tanh: bool = False
    query_pre_attn_scalar: float | None = None  # None: head_dim ** -0.5 scales the scores
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None


def _cap(cfg: dict[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ModelLoadError(f"config.json field {key!r} must be a positive number or null, got {value!r}")
    return float(value)


def read_gemma(cfg: dict[str, Any]) -> GemmaFields:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act not in GELU_TANH:
        raise ModelLoadError(f"hidden_activation {act!r} is not supported for Gemma (gelu_pytorch_tanh only)")
    return GemmaFields(embed_scale=True, norm_plus_one=True, sandwich_norms=True, gelu_tanh=True,
                       query_pre_attn_scalar=_cap(cfg, "query_pre_attn_scalar"),
                       attn_logit_softcapping=_cap(cfg, "attn_logit_softcapping"),
                       final_logit_softcapping=_cap(cfg, "final_logit_softcapping"))


def gemma_layer_types(cfg: dict[str, Any], arch: str, num_layers: int) -> list[str]:
    """transformers' default: Gemma 2's even layers slide; Gemma 3 slides but on every 6th (its pattern)."""
    pattern = 2 if arch == "Gemma2ForCausalLM" else cfg.get("sliding_window_pattern", 6)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ModelLoadError(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def gemma3_rope_sources(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the config as the global layers' RoPE reads it, the same for the sliding layers')."""
    nested = cfg.get("rope_parameters")
    local: dict[str, Any] = {}
    if cfg.get("rope_local_base_freq") is not None:
        local["rope_theta"] = cfg["rope_local_base_freq"]  # checked against the nested one by the RoPE reader
    if isinstance(nested, dict) and nested and set(nested) <= {"full_attention", "sliding_attention"}:
        glob = {**cfg, "rope_parameters": nested.get("full_attention") or {}}
        local["rope_parameters"] = nested.get("sliding_attention") or {}
    else:
        glob = dict(cfg)
        local.setdefault("rope_theta", 10000.0)
    glob.pop("rope_local_base_freq", None)
    return glob, local  # the global theta's default is 1e6 (the caller's), the local one's 10,000
