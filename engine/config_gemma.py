"""Gemma 2's fields of a config.json, read the way transformers' modeling code applies them (engine/config.py calls
:func:`read_gemma2` for ``Gemma2ForCausalLM``; the result is ``ModelConfig.gemma``).

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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ModelLoadError

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM",)
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


def read_gemma2(cfg: dict[str, Any]) -> GemmaFields:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act not in GELU_TANH:
        raise ModelLoadError(f"hidden_activation {act!r} is not supported for Gemma 2 (gelu_pytorch_tanh only)")
    return GemmaFields(embed_scale=True, norm_plus_one=True, sandwich_norms=True, gelu_tanh=True,
                       query_pre_attn_scalar=_cap(cfg, "query_pre_attn_scalar"),
                       attn_logit_softcapping=_cap(cfg, "attn_logit_softcapping"),
                       final_logit_softcapping=_cap(cfg, "final_logit_softcapping"))


def gemma2_layer_types(num_layers: int) -> list[str]:
    """transformers' default for Gemma 2: the even layers slide."""
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
