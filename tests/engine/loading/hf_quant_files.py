"""Quantized Hugging Face checkpoints for tests, written from a tiny float checkpoint the way the formats' own tools
lay them out, and each format's dequantization written from its published formula — independently of duet's loader
(engine/loading/hf_quantized.py), which the tests check against these.

- GPTQ (AutoGPTQ / GPTQModel's ``pack``): round-to-nearest per group with GPTQ's quantizer (the range widened to take
  0; symmetric: zero 2^(bits-1)), act-order as GPTQ produces it (a column order per input — one for q/k/v, one for
  gate/up — its groups consecutive in that order, ``g_idx`` recording each column's group); ``qweight`` packed along
  the inputs, ``qzeros`` along the outputs, v1 format storing zero - 1 (zeros kept >= 1, as GPTQModel clamps);
  dequantization (AutoGPTQ's torch path): ``scales[g_idx] * (weight - zeros[g_idx])`` with zeros + 1 for v1.
- AWQ (AutoAWQ's ``WQLinear_GEMM.from_linear``): asymmetric round-to-nearest per group, values packed along the
  outputs in the order [0, 2, 4, 6, 1, 3, 5, 7]; dequantization (vLLM's ``awq_dequantize`` reference): unpack, undo
  the order with [0, 4, 1, 5, 2, 6, 3, 7], ``(iweights - izeros) * scales``.
- compressed-tensors: written by the compressed-tensors library itself (``PackedQuantizationCompressor.compress``,
  its own ``calculate_qparams``); dequantized by its own ``decompress``.
Layers listed in ``float_layers`` stay float in the file (an ignore list / ``modules_to_not_convert``).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
_AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]


def _copy_model(src: Path, out: Path, quantization_config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def _quantized_layers(weights: dict[str, torch.Tensor], float_layers: tuple[str, ...]) -> list[str]:
    return [name[:-len(".weight")] for name in weights if name.endswith(".weight")
            and any(name.endswith(f"{p}.weight") for p in PROJECTIONS)
            and not any(name.startswith(f) for f in float_layers)]


def _act_order(weights: dict[str, torch.Tensor], prefix: str, seed: int, shared: bool = True) -> torch.Tensor:
    """A column order per layer input: q/k/v share the attention's, gate/up the MLP's, as GPTQ's Hessian (of the
    layer's input) gives; ``shared`` False: one per layer (what GPTQ never writes; the loader's fallback)."""
    owner, name = prefix.rsplit(".", 1)
    key = owner + "." + ({"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                          "up_proj": "gate_up"}.get(name, name) if shared else name)
    gen = torch.Generator().manual_seed(seed + sum(map(ord, key)))
    return torch.randperm(weights[f"{prefix}.weight"].shape[1], generator=gen)


def gptq_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool, order: torch.Tensor | None,
                  v1: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [rows, cols], scales fp16 [groups, rows], zeros [groups, rows], g_idx [cols]) by GPTQ's quantizer."""
    rows, cols = w.shape
    group_size = cols if group_size == -1 else group_size
    maxq = 2 ** bits - 1
    g_idx = torch.arange(cols) // group_size
    if order is not None:  # column order[k] falls in group k // group_size
        g_idx = torch.empty(cols, dtype=torch.int64)
        g_idx[order] = torch.arange(cols) // group_size
    q = torch.empty(rows, cols, dtype=torch.int32)
    scales, zeros = [], []
    for g in range(cols // group_size):
        cols_g = (g_idx == g).nonzero().flatten()
        x = w[:, cols_g]
        xmin, xmax = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = -xmax
        scale = ((xmax - xmin) / maxq).clamp(min=1e-6).half().float()
        zero = torch.full_like(scale, (maxq + 1) // 2) if sym else torch.round(-xmin / scale)
        zero = zero.clamp(1 if v1 else 0, maxq)  # v1 stores zero - 1: GPTQModel keeps it >= 0
        q[:, cols_g] = torch.clamp(torch.round(x / scale[:, None]) + zero[:, None], 0, maxq).int()
        scales.append(scale.half())
        zeros.append(zero.int())
    return q, torch.stack(scales), torch.stack(zeros), g_idx.int()


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] values -> [K / pf, N] int32, value j of each pf consecutive rows at bits j * bits (GPTQ's qweight)."""
    pf = 32 // bits
    v = values.to(torch.int64).reshape(-1, pf, values.shape[1])
    words = sum(v[:, j] << (bits * j) for j in range(pf))
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the word's bits as a signed int32


def _pack_cols(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """[K, N] -> [K, N / pf] int32 along the columns (GPTQ's qzeros; AWQ's, with its ``order``)."""
    pf = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0], -1, pf)
    words = sum(v[..., (order or range(pf))[j]] << (bits * j) for j in range(pf))
    return (words - ((words >> 31) << 32)).to(torch.int32)


def write_gptq(src: Path, out: Path, bits: int = 4, group_size: int = 32, sym: bool = True, desc_act: bool = False,
               v2: bool = False, float_layers: tuple[str, ...] = (), shared_order: bool = True, seed: int = 0) -> Path:
    weights = load_file(str(src / "model.safetensors"))
    tensors = dict(weights)
    for prefix in _quantized_layers(weights, float_layers):
        w = tensors.pop(f"{prefix}.weight")
        order = _act_order(weights, prefix, seed, shared_order) if desc_act else None
        q, scales, zeros, g_idx = gptq_quantize(w, bits, group_size, sym, order, v1=not v2)
        tensors[f"{prefix}.qweight"] = _pack_rows(q.T, bits)
        tensors[f"{prefix}.qzeros"] = _pack_cols(zeros - (0 if v2 else 1), bits)
        tensors[f"{prefix}.scales"], tensors[f"{prefix}.g_idx"] = scales, g_idx
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
              "damp_percent": 0.01, "true_sequential": True, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    return _copy_model(src, out, config, tensors)


def gptq_dequantize(qweight, qzeros, scales, g_idx, bits: int, v1: bool) -> torch.Tensor:
    """[rows, cols] float32 by AutoGPTQ's formula: scales[g_idx] * (weight - zeros[g_idx]) (zeros + 1 for v1)."""
    wf = torch.arange(0, 32, bits, dtype=torch.int32)
    zeros = (qzeros.unsqueeze(2) >> wf.view(1, 1, -1)) & (2 ** bits - 1)
    zeros = zeros.reshape(scales.shape) + (1 if v1 else 0)
    weight = (qweight.unsqueeze(1) >> wf.view(1, -1, 1)) & (2 ** bits - 1)
    weight = weight.reshape(-1, weight.shape[2])
    g = g_idx.long()
    return (scales.float()[g] * (weight - zeros[g]).float()).T


def write_awq(src: Path, out: Path, group_size: int = 32, float_layers: tuple[str, ...] = ()) -> Path:
    weights = load_file(str(src / "model.safetensors"))
    tensors = dict(weights)
    for prefix in _quantized_layers(weights, float_layers):
        w = tensors.pop(f"{prefix}.weight")  # [rows, cols]
        x = w.reshape(w.shape[0], -1, group_size)
        hi, lo = x.amax(-1), x.amin(-1)
        scales = ((hi - lo).clamp(min=1e-5) / 15).half().float()
        zeros = (-torch.round(lo / scales)).clamp(0, 15)
        q = torch.clamp(torch.round(x / scales[..., None]) + zeros[..., None], 0, 15).reshape(w.shape)
        tensors[f"{prefix}.qweight"] = _pack_cols(q.T, 4, _AWQ_ORDER)  # [cols, rows / 8]
        tensors[f"{prefix}.qzeros"] = _pack_cols(zeros.T, 4, _AWQ_ORDER)  # [groups, rows / 8]
        tensors[f"{prefix}.scales"] = scales.T.half().contiguous()  # [groups, rows]
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": list(float_layers) or None}
    return _copy_model(src, out, config, tensors)


def awq_dequantize(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """[rows, cols] float32 by vLLM's awq_dequantize reference."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    iweights = (qweight[:, :, None] >> shifts[None, None, :]).view(qweight.shape[0], -1)
    iweights = iweights.view(-1, 8)[:, _AWQ_REVERSE].view(qweight.shape[0], -1) & 15
    izeros = (qzeros[:, :, None] >> shifts[None, None, :]).view(qzeros.shape[0], -1)
    izeros = izeros.view(-1, 8)[:, _AWQ_REVERSE].view(qzeros.shape[0], -1) & 15
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return ((iweights - izeros).float() * scales.float().repeat_interleave(group_size, dim=0)).T


def write_compressed_tensors(src: Path, out: Path, bits: int = 4, group_size: int | None = 32, sym: bool = True,
                             float_layers: tuple[str, ...] = ()) -> Path:
    """By the compressed-tensors library: its ``calculate_qparams`` (min / max per group or row) and its
    ``PackedQuantizationCompressor.compress``; the config is its ``QuantizationConfig``. ``group_size`` None: the
    channel strategy. Scales come in the checkpoint's dtype."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, group_size=group_size,
                            strategy="group" if group_size else "channel")
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    weights = load_file(str(src / "model.safetensors"))
    tensors = dict(weights)
    for prefix in _quantized_layers(weights, float_layers):
        w = tensors.pop(f"{prefix}.weight")
        x = w.reshape(w.shape[0], -1, group_size or w.shape[1])
        scale, zero_point = calculate_qparams(x.amin(-1), x.amax(-1), args)
        state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}
        for part, t in PackedQuantizationCompressor.compress(state, scheme).items():
            tensors[f"{prefix}.{part}"] = t
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                quantization_status="compressed", ignore=["lm_head", *float_layers]).to_dict()
    return _copy_model(src, out, config, tensors)


def compressed_tensors_dequantize(parts: dict[str, torch.Tensor], bits: int, group_size: int | None,
                                  sym: bool) -> torch.Tensor:
    """[rows, cols] float32 by the library's own ``decompress``, with the scale in fp32: its formula,
    (x_q - zero_point) * scale, computed in fp32 (the library computes it in the scale's dtype)."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, group_size=group_size,
                            strategy="group" if group_size else "channel")
    state = {**parts, "weight_scale": parts["weight_scale"].float()}
    return PackedQuantizationCompressor.decompress(state, QuantizationScheme(targets=["Linear"], weights=args))[
        "weight"].float()
