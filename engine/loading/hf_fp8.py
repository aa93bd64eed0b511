"""FP8 checkpoints' tensors (issue 49; the config: engine/models/config_fp8.py): each quantized layer's parts read
into one ``Fp8Weight``, which the loader dequantizes where the kernels have no FP8 GEMM (every CPU backend: the
engine counts it as a fallback, engine/model_runner.py) and kernels/fp8_gemm.py multiplies on a GPU.

A quantized layer is one whose ``<prefix>.weight`` is float8 e4m3 (safetensors ``F8_E4M3``) and that has its scale
(``<prefix>.weight_scale``, or ``weight_scale_inv`` for quant_method fp8); a static-activation compressed-tensors
checkpoint adds ``<prefix>.input_scale``, FBGEMM ``<prefix>.input_scale_ub`` (the activation bound, config-wide in
effect). A float layer (``ignore`` / ``modules_to_not_convert``) has a float weight and no scale. Scale shapes:
tensor [] or [1]; channel [rows, 1] (or [rows]); block [ceil(rows / bn), ceil(cols / bk)].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import ModelLoadError
from engine.models.config_fp8 import Fp8Fields

FP8_TYPE = "FP8"  # the tensor type engine/loading/quantized.py sees for a quantized layer's weight
_OPTIONAL = {"input_scale", "input_scale_ub"}


@dataclass(frozen=True)
class Fp8Weight:
    weight: torch.Tensor  # float8_e4m3fn [rows, cols]
    scale: torch.Tensor  # float32, broadcast per strategy: [1, 1] tensor, [rows, 1] channel, [rows/bn, cols/bk] block
    block: tuple[int, int] | None  # (bn, bk) for a block scale
    input_scale: torch.Tensor | None = None  # float32 [] (static activations), as the checkpoint gives it
    activations: str = "none"  # how a GEMM in FP8 quantizes the layer's input (Fp8Fields.activations)
    group_size: int = 0  # activations "dynamic-group": columns per scale
    scale_ub: float | None = None  # activations "dynamic-token" of fbgemm_fp8: the cap on a row's amax
    fmt: str = FP8_TYPE

    @property
    def rows(self) -> int:
        return self.weight.shape[0]

    @property
    def cols(self) -> int:
        return self.weight.shape[1]


def parts(spec: Fp8Fields) -> tuple[set[str], set[str]]:
    """A quantized layer's tensor suffixes: (required, optional)."""
    return {"weight", spec.scale_part}, set(_OPTIONAL)


def quantized_layers(dtypes: dict[str, str], spec: Fp8Fields) -> dict[str, set[str]]:
    """Layer prefix -> its parts, for every layer with an fp8 weight; a ModelLoadError for a scale without an fp8
    weight, or an fp8 weight without its scale."""
    layers: dict[str, set[str]] = {}
    for name, dtype in dtypes.items():
        prefix, _, part = name.rpartition(".")
        if part == "weight" and dtype == "F8_E4M3":
            layers.setdefault(prefix, set()).add(part)
        elif part in {spec.scale_part} | _OPTIONAL:
            layers.setdefault(prefix, set()).add(part)
    for prefix, have in layers.items():
        if "weight" not in have or dtypes.get(f"{prefix}.weight") != "F8_E4M3":
            got = dtypes.get(f"{prefix}.weight", "no weight")
            raise ModelLoadError(f"{prefix}: an FP8 layer's scale beside a {got} weight (expected F8_E4M3)")
        if spec.scale_part not in have:
            raise ModelLoadError(f"{prefix}: an F8_E4M3 weight without its {spec.scale_part}")
    stray = sorted({d for d in dtypes.values() if d.startswith("F8_") and d != "F8_E4M3"})
    if stray:
        raise ModelLoadError(f"FP8 checkpoint: tensors of type {', '.join(stray)} (only F8_E4M3 weights are read)")
    return layers


def unpack(spec: Fp8Fields, got: dict[str, torch.Tensor]) -> Fp8Weight:
    """One layer's tensors as an Fp8Weight, the scale's shape checked against the strategy."""
    weight = got["weight"]
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
    rows, cols = weight.shape
    scale = got[spec.scale_part].to(torch.float32)
    if spec.strategy == "tensor":
        if scale.numel() != 1:
            raise ValueError(f"a per-tensor {spec.scale_part} must hold one value, got {tuple(scale.shape)}")
        scale = scale.reshape(1, 1)
    elif spec.strategy == "channel":
        if scale.numel() != rows:
            raise ValueError(f"a per-channel {spec.scale_part} must hold {rows} values, got {tuple(scale.shape)}")
        scale = scale.reshape(rows, 1)
    else:
        bn, bk = spec.block
        want = (-(-rows // bn), -(-cols // bk))
        if tuple(scale.shape) != want:
            raise ValueError(f"a {bn}x{bk} block {spec.scale_part} of a {rows}x{cols} weight must be {want}, got "
                             f"{tuple(scale.shape)}")
    if not torch.isfinite(scale).all():
        raise ValueError(f"{spec.scale_part} holds non-finite values")
    input_scale = got.get("input_scale")
    if spec.activations == "static-tensor" and input_scale is None:
        raise ValueError("static activations (input_activations strategy tensor) without an input_scale")
    return Fp8Weight(weight, scale.contiguous(), spec.block,
                     None if input_scale is None else input_scale.to(torch.float32).reshape(()),
                     spec.activations, spec.group_size, spec.scale_ub)


def join_rows(parts: list[Fp8Weight]) -> Fp8Weight | None:
    """The pieces of a fused projection (q, k, v) as one weight, row-wise, when one GEMM computes exactly what the
    pieces would: the same activation scheme and no static input scale that differs, tensor or channel scales
    (a tensor scale becomes the same value on each of its rows: exact), or block scales whose blocks each piece
    fills (all rows but the last piece's a multiple of bn). None otherwise: the caller keeps them as parts."""
    first = parts[0]
    same = all((p.block, p.activations, p.group_size, p.scale_ub) == (first.block, first.activations,
                                                                      first.group_size, first.scale_ub)
               for p in parts)
    statics = {float(p.input_scale) for p in parts if p.input_scale is not None}
    if not same or len(statics) > 1:
        return None
    if first.block is not None:
        if any(p.rows % first.block[0] for p in parts[:-1]):
            return None
        scale = torch.cat([p.scale for p in parts])
    else:
        scale = torch.cat([p.scale.expand(p.rows, 1) for p in parts])
    return Fp8Weight(torch.cat([p.weight for p in parts]), scale.contiguous(), first.block, first.input_scale,
                     first.activations, first.group_size, first.scale_ub)


def expanded_scale(w: Fp8Weight) -> torch.Tensor:
    """The float32 scale of every weight, [rows, cols] (a block scale repeated over its block, cut at the edges)."""
    if w.block is None:
        return w.scale.expand(w.rows, w.cols)
    bn, bk = w.block
    return w.scale.repeat_interleave(bn, 0)[:w.rows].repeat_interleave(bk, 1)[:, :w.cols]


def dequantize(w: Fp8Weight) -> torch.Tensor:
    """[rows, cols] float32: float(q) * scale, one rounding (an e4m3 value is exact in fp32)."""
    return w.weight.to(torch.float32) * expanded_scale(w)
