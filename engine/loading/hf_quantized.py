"""Hugging Face quantized checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized; issue 48): each quantized
layer's tensors unpacked into one ``GroupQuantWeight`` (kernels/quant_group.py: w = (q - z) * s in fp32), which
engine/loading/quantized.py keeps packed for the kernels or weights.py dequantizes into the float parameter.

The layouts, as the formats' own code writes and reads them (AutoGPTQ / GPTQModel, AutoAWQ, compressed-tensors'
``pack_to_int32``, and vLLM's loaders), for a layer of ``rows`` outputs and ``cols`` inputs, pf = 32 / bits values
per int32 word, value j of a word in its bits [bits * j, bits * (j + 1)):
- GPTQ: ``qweight`` int32 [cols / pf, rows] (packed along the inputs), ``qzeros`` int32 [groups, rows / pf]
  (along the outputs), ``scales`` [groups, rows], ``g_idx`` int32 [cols] (each input column's group).
  w[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o]; the v1 format ("gptq") stores z - 1, "gptq_v2" z.
- AWQ (gemm): ``qweight`` int32 [cols, rows / 8] (along the outputs, in the order [0, 2, 4, 6, 1, 3, 5, 7]: word
  value k is output column order[k] of its 8), ``qzeros`` int32 [groups, rows / 8] alike, ``scales`` [groups,
  rows]; column i is in group i // group_size. w[o, i] = (q - z) * s.
- compressed-tensors: ``weight_packed`` int32 [rows, cols / pf] (along the inputs), values stored as
  q + 2^(bits - 1) (signed quants made unsigned), ``weight_scale`` [rows, groups], ``weight_shape`` [2],
  asymmetric: ``weight_zero_point`` int32 [rows / pf, groups] (packed along the outputs, offset alike),
  act-order: ``weight_g_idx``. w = (q - zp) * s, the same in the unsigned domain (both carry the offset);
  symmetric: zp = 0, i.e. z = 2^(bits - 1).
A g_idx that is not ``i // group_size`` (act-order) becomes a column permutation (kernels/quant_group.py).
FP8 checkpoints (an ``Fp8Fields`` spec) go through the same three steps with engine/loading/hf_fp8.py's parts and
``Fp8Weight``.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.errors import ModelLoadError
from engine.loading import hf_fp8
from engine.models.config_fp8 import Fp8Fields
from engine.models.config_quant import QuantFields
from kernels.quant_group import GROUP_FORMATS, GroupQuantWeight

# each method's tensor suffixes: (required, optional)
PARTS = {
    "gptq": ({"qweight", "qzeros", "scales"}, {"g_idx"}),
    "awq": ({"qweight", "qzeros", "scales"}, set()),
    "compressed-tensors": ({"weight_packed", "weight_scale", "weight_shape"}, {"weight_zero_point", "weight_g_idx"}),
}
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # word value k holds output column _AWQ_ORDER[k] of its 8


def _parts(spec: QuantFields | Fp8Fields) -> tuple[set[str], set[str]]:
    return hf_fp8.parts(spec) if isinstance(spec, Fp8Fields) else PARTS[spec.method]


def _split(name: str, spec: QuantFields | Fp8Fields) -> tuple[str, str] | None:
    """(layer prefix, part) when ``name`` is a part of a quantized layer of ``spec``'s method; else None."""
    required, optional = _parts(spec)
    prefix, _, part = name.rpartition(".")
    return (prefix, part) if part in required | optional else None


def quantized_layers(names: Iterable[str] | dict[str, str], spec: QuantFields | Fp8Fields) -> dict[str, set[str]]:
    """Layer prefix -> the parts the checkpoint has for it, for every quantized layer; a ModelLoadError when a
    layer lacks a required part (a truncated or mislabelled checkpoint). FP8: ``names`` maps each tensor to its
    safetensors dtype (an fp8 weight is told from a float one by it)."""
    if isinstance(spec, Fp8Fields):
        return hf_fp8.quantized_layers(dict(names), spec)
    layers: dict[str, set[str]] = {}
    for name in names:
        hit = _split(name, spec)
        if hit is not None:
            layers.setdefault(hit[0], set()).add(hit[1])
    required = PARTS[spec.method][0]
    for prefix, parts in layers.items():
        if not required <= parts:
            raise ModelLoadError(f"{prefix}: a {spec.method} layer without {', '.join(sorted(required - parts))}")
    if spec.method == "compressed-tensors" and not spec.sym and any("weight_zero_point" not in p
                                                                    for p in layers.values()):
        raise ModelLoadError("compressed-tensors: an asymmetric scheme whose layers lack weight_zero_point")
    return layers


def tensor_types(dtypes: dict[str, str], spec: QuantFields | Fp8Fields) -> dict[str, str]:
    """HF weight name -> its type: G4 / G8 for a quantized layer's (``<prefix>.weight``, a name the file does not
    hold), the safetensors dtype (F32, F16, BF16) for a float one; quantized.py's ``packed_params`` reads these.
    ``dtypes``: every tensor of the checkpoint -> its safetensors dtype."""
    fmt = hf_fp8.FP8_TYPE if isinstance(spec, Fp8Fields) else GROUP_FORMATS[spec.bits]
    types = {f"{prefix}.weight": fmt for prefix in quantized_layers(dtypes, spec)}
    for name, dtype in dtypes.items():
        if name.endswith(".weight") and name not in types:
            types[name] = dtype
    return types


def assemble(items: Iterator[tuple[str, torch.Tensor]], spec: QuantFields | Fp8Fields,
             layers: dict[str, set[str]]) -> Iterator[tuple[str, object]]:
    """The checkpoint's (name, tensor) stream with each quantized layer's parts replaced by one
    (``<prefix>.weight``, GroupQuantWeight), yielded when its last part arrives; other tensors pass through."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in items:
        hit = _split(name, spec)
        if hit is None or hit[0] not in layers:
            yield name, tensor
            continue
        prefix, part = hit
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if set(parts) == layers[prefix]:
            del pending[prefix]
            try:
                yield f"{prefix}.weight", unpack(spec, parts)
            except (RuntimeError, ValueError) as e:  # shapes that do not fit together
                raise ModelLoadError(f"{prefix}: {spec.method} tensors do not fit together: {e}") from None


def unpack(spec: QuantFields | Fp8Fields, parts: dict[str, torch.Tensor]) -> GroupQuantWeight | hf_fp8.Fp8Weight:
    """One layer's tensors (suffix -> tensor) as a GroupQuantWeight (an Fp8Weight for FP8)."""
    if isinstance(spec, Fp8Fields):
        return hf_fp8.unpack(spec, parts)
    if spec.method == "gptq":
        q = _unpack_words(_int32(parts["qweight"], "qweight"), spec.bits, dim=0).T
        zeros = _unpack_words(_int32(parts["qzeros"], "qzeros"), spec.bits, dim=1).T + spec.zero_offset
        scales, g_idx = parts["scales"].T, parts.get("g_idx")
    elif spec.method == "awq":
        q = _awq_columns(_unpack_words(_int32(parts["qweight"], "qweight"), 4, dim=1)).T
        zeros = _awq_columns(_unpack_words(_int32(parts["qzeros"], "qzeros"), 4, dim=1)).T
        scales, g_idx = parts["scales"].T, None
    else:
        rows, cols = (int(v) for v in parts["weight_shape"].tolist())
        q = _unpack_words(_int32(parts["weight_packed"], "weight_packed"), spec.bits, dim=1)[:rows, :cols]
        scales, g_idx = parts["weight_scale"], parts.get("weight_g_idx")
        if "weight_zero_point" in parts:
            zeros = _unpack_words(_int32(parts["weight_zero_point"], "weight_zero_point"), spec.bits, dim=0)[:rows]
        else:
            zeros = torch.full(scales.shape, 1 << (spec.bits - 1), dtype=torch.int32)
    rows, cols = q.shape
    groups = scales.shape[1]
    if scales.dim() != 2 or scales.shape[0] != rows or tuple(zeros.shape) != (rows, groups) or cols % groups:
        raise ValueError(f"weights {rows} x {cols}, scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}")
    group_size = cols // groups
    if spec.group_size != -1 and group_size != spec.group_size:
        raise ValueError(f"{groups} groups of {group_size} columns, the config says group_size {spec.group_size}")
    perm = _permutation(g_idx, groups, group_size, cols)
    q = q.to(torch.uint8)
    if perm is not None:
        q = q[:, perm]
    return GroupQuantWeight(spec.bits, group_size, q.contiguous(), scales.contiguous(),
                            zeros.to(torch.int16).contiguous(), perm)


def _int32(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype != torch.int32 or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
    return t


def _unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> int32 values (unsigned, < 2^bits), each word's 32 / bits values laid out along ``dim``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:  # [K, N] -> [K * pf, N]
        v = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
        return v.reshape(-1, words.shape[1])
    v = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [K, N] -> [K, N * pf]
    return v.reshape(words.shape[0], -1)


def _awq_columns(v: torch.Tensor) -> torch.Tensor:
    """[K, N] values in AWQ's word order -> the outputs' order (value k of each 8 is column _AWQ_ORDER[k])."""
    out = torch.empty_like(v)
    out.view(v.shape[0], -1, 8)[..., _AWQ_ORDER] = v.view(v.shape[0], -1, 8)
    return out


def _permutation(g_idx: torch.Tensor | None, groups: int, group_size: int, cols: int) -> torch.Tensor | None:
    """None when ``g_idx`` is absent or puts column i in group i // group_size; else the stable sort of the columns
    by group (each group must hold group_size columns)."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    if tuple(g_idx.shape) != (cols,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"g_idx must map each of the {cols} columns to one of {groups} groups")
    if torch.equal(g_idx, torch.arange(cols) // group_size):
        return None
    if not torch.all(torch.bincount(g_idx, minlength=groups) == group_size):
        raise ValueError(f"g_idx puts unequal numbers of columns in the groups (each needs {group_size})")
    return torch.argsort(g_idx, stable=True)
