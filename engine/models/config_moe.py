"""Mixture-of-experts fields of a config.json (Mixtral, Qwen2-MoE, Qwen3-MoE), read the way transformers' modeling
code applies them, both generations of its spellings. engine/models/config.py calls :func:`read_moe` for these
architectures; the result is a few ``ModelConfig`` fields (``MoeFields``).

- Experts: ``num_local_experts`` (Mixtral; Qwen3-MoE since transformers 5) or ``num_experts`` (Qwen2-MoE;
  Qwen3-MoE before 5). A file giving both with different values is refused.
- Router: fp32 softmax over the experts, top ``num_experts_per_tok``, renormalised to sum 1 when
  ``norm_topk_prob`` (Qwen) — Mixtral always. Qwen casts the weights to the model dtype before they scale the
  experts' outputs; Mixtral scales in fp32 (``router_weights_fp32``).
- Experts are SwiGLU MLPs of ``moe_intermediate_size`` (Qwen) or ``intermediate_size`` (Mixtral).
- Which layers are sparse (Qwen): layer i unless i is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``;
  the others run a dense MLP of ``intermediate_size``. Mixtral: every layer.
- Qwen2-MoE adds a shared expert of ``shared_expert_intermediate_size`` on every sparse layer, scaled by
  ``sigmoid(shared_expert_gate(x))``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ModelLoadError

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class MoeFields:
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_weights_fp32: bool = False
    shared_expert_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()


def _pos_int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"config.json field {key!r} must be a positive integer, got {value!r}")
    return value


def _num_experts(cfg: dict[str, Any]) -> int:
    given = {k: cfg[k] for k in ("num_local_experts", "num_experts") if cfg.get(k) is not None}
    if not given:
        raise ModelLoadError("config.json names no experts (num_local_experts / num_experts)")
    if len(set(given.values())) > 1:
        raise ModelLoadError(f"config.json gives the number of experts twice with different values: {given}")
    key = next(iter(given))
    return _pos_int(given, key)


def read_moe(cfg: dict[str, Any], arch: str, num_layers: int) -> MoeFields:
    experts, top_k = _num_experts(cfg), _pos_int(cfg, "num_experts_per_tok")
    if top_k > experts:
        raise ModelLoadError(f"num_experts_per_tok {top_k} > the {experts} experts")
    if arch == "MixtralForCausalLM":
        return MoeFields(experts, top_k, _pos_int(cfg, "intermediate_size"), norm_topk_prob=True,
                         router_weights_fp32=True, sparse_layers=tuple(range(num_layers)))
    step = _pos_int(cfg, "decoder_sparse_step") if cfg.get("decoder_sparse_step") is not None else 1
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
        raise ModelLoadError(f"mlp_only_layers must be a list of layer indices, got {dense!r}")
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = _pos_int(cfg, "shared_expert_intermediate_size")
    elif cfg.get("shared_expert_intermediate_size"):
        raise ModelLoadError(f"shared_expert_intermediate_size={cfg['shared_expert_intermediate_size']!r}: "
                             f"{arch} has no shared expert; the file is not what it says")
    norm = cfg.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ModelLoadError(f"norm_topk_prob must be true or false, got {norm!r}")
    return MoeFields(experts, top_k, _pos_int(cfg, "moe_intermediate_size"), norm_topk_prob=norm,
                     shared_expert_intermediate_size=shared,
                     sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0))
