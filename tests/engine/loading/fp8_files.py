"""FP8 checkpoints for tests, written from a tiny float checkpoint as the formats' own tools lay them out, and each
format's dequantization written from its published formula, independently of duet's loader
(engine/loading/hf_fp8.py), which the tests check against these.

- compressed-tensors ``float-quantized`` (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK): written by the
  compressed-tensors library itself (its ``calculate_qparams`` on the min / max per tensor, row or block, and its
  ``FloatQuantizationCompressor.compress``); dequantized by its own ``decompress`` (scales in fp32).
- ``quant_method: fp8`` (transformers' FineGrainedFP8 / DeepSeek-V3): per block of [bn, bk], ``weight_scale_inv`` =
  amax / 448 and q = e4m3(w / scale_inv), as transformers' quantizer does; dequantized block by block,
  ``q[i:i+bn, j:j+bk] * scale_inv[i // bn, j // bk]`` (DeepSeek's ``weight_dequant``).
- ``quant_method: fbgemm_fp8``: per row, ``weight_scale`` [rows, 1] = amax / 448, ``input_scale_ub`` per layer;
  dequantized ``q * weight_scale``.
"""
from __future__ import annotations

import torch
from safetensors.torch import load_file

from tests.engine.loading.hf_quant_files import _copy_model, _quantized_layers

E4M3_MAX = 448.0


def write_compressed_tensors_fp8(src, out, strategy: str = "channel", activations: str = "dynamic-token",
                                 block: tuple[int, int] = (32, 32), float_layers: tuple[str, ...] = ()):
    """``strategy`` tensor | channel | block; ``activations`` dynamic-token (FP8_DYNAMIC), static-tensor (FP8, an
    ``input_scale`` per layer), dynamic-group (FP8_BLOCK, groups of 128) or none (weight only)."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    wargs = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False,
                             block_structure=list(block) if strategy == "block" else None)
    acts = {"dynamic-token": dict(strategy="token", dynamic=True), "static-tensor": dict(strategy="tensor"),
            "dynamic-group": dict(strategy="group", dynamic=True, group_size=128)}
    aargs = (QuantizationArgs(num_bits=8, type="float", symmetric=True, **acts[activations])
             if activations != "none" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=wargs, input_activations=aargs)
    weights = load_file(str(src / "model.safetensors"))
    tensors = dict(weights)
    for n, prefix in enumerate(_quantized_layers(weights, float_layers)):
        w = tensors.pop(f"{prefix}.weight").float()
        lo, hi = _ranges(w, strategy, block)
        scale, _ = calculate_qparams(lo, hi, wargs)
        state = {"weight": w, "weight_scale": scale}
        for part, t in FloatQuantizationCompressor.compress(state, scheme).items():
            tensors[f"{prefix}.{part}"] = t
        if activations == "static-tensor":  # a calibrated activation range: any positive value per layer
            tensors[f"{prefix}.input_scale"] = torch.tensor([0.01 * (n + 1)], dtype=torch.float32)
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="float-quantized",
                                quantization_status="compressed", ignore=["lm_head", *float_layers]).to_dict()
    return _copy_model(src, out, config, tensors)


def _ranges(w: torch.Tensor, strategy: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    if strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    blocks = _blocks(w, block)
    return blocks.amin((1, 3)), blocks.amax((1, 3))


def _blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[rows / bn, bn, cols / bk, bk], the edges padded with zeros."""
    bn, bk = block
    rows, cols = w.shape
    padded = torch.zeros(-(-rows // bn) * bn, -(-cols // bk) * bk, dtype=w.dtype)
    padded[:rows, :cols] = w
    return padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)


def compressed_tensors_fp8_dequantize(parts: dict[str, torch.Tensor], strategy: str,
                                      block: tuple[int, int] = (32, 32)) -> torch.Tensor:
    """[rows, cols] float32 by the library's own ``decompress``, the scale in fp32."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True,
                            block_structure=list(block) if strategy == "block" else None)
    state = {"weight": parts["weight"], "weight_scale": parts["weight_scale"].float()}
    return FloatQuantizationCompressor.decompress(state, QuantizationScheme(targets=["Linear"], weights=args))[
        "weight"].float()


def write_hf_fp8(src, out, block: tuple[int, int] = (48, 40)):
    """``quant_method: fp8`` with ``weight_block_size`` ``block``; every projection quantized, lm_head float."""
    weights = load_file(str(src / "model.safetensors"))
    tensors = dict(weights)
    for prefix in _quantized_layers(weights, ()):
        w = tensors.pop(f"{prefix}.weight").float()
        amax = _blocks(w, block).abs().amax((1, 3))
        scale_inv = (amax / E4M3_MAX).clamp(min=1e-12)
        expanded = scale_inv.repeat_interleave(block[0], 0)[:w.shape[0]].repeat_interleave(block[1], 1)[:, :w.shape[1]]
        tensors[f"{prefix}.weight"] = (w / expanded).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        tensors[f"{prefix}.weight_scale_inv"] = scale_inv
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return _copy_model(src, out, config, tensors)


def hf_fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek-V3's ``weight_dequant``, block by block in fp32."""
    bn, bk = block
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(0, q.shape[0], bn):
        for j in range(0, q.shape[1], bk):
            out[i:i + bn, j:j + bk] = q[i:i + bn, j:j + bk].float() * scale_inv[i // bn, j // bk]
    return out


def write_fbgemm_fp8(src, out, activation_scale_ub: float = 1200.0):
    """``quant_method: fbgemm_fp8``: rowwise e4m3 weights, ``weight_scale`` [rows, 1], ``input_scale_ub`` [1]."""
    weights = load_file(str(src / "model.safetensors"))
    tensors = dict(weights)
    for prefix in _quantized_layers(weights, ()):
        w = tensors.pop(f"{prefix}.weight").float()
        scale = (w.abs().amax(1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
        tensors[f"{prefix}.weight"] = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        tensors[f"{prefix}.weight_scale"] = scale
        tensors[f"{prefix}.input_scale_ub"] = torch.tensor([activation_scale_ub], dtype=torch.float32)
    config = {"quant_method": "fbgemm_fp8", "activation_scale_ub": activation_scale_ub,
              "modules_to_not_convert": ["lm_head"]}
    return _copy_model(src, out, config, tensors)
