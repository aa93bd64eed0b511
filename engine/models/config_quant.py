"""A Hugging Face checkpoint's ``quantization_config``, read and checked against what duet implements (issue 48).
engine/models/config.py calls :func:`read_quantization`; the result is ``ModelConfig.quantization`` (None: a float
checkpoint). engine/loading/hf_quantized.py unpacks the tensors; kernels/quant_group.py is their dequantization.

Implemented, weight-only integer quantization of the linear layers, groups of input columns with a scale and an
integer zero each (``w = (q - z) * s``):
- ``gptq``: bits 4 or 8; ``group_size`` -1 (one group per row) or a multiple of 32; ``desc_act`` (act-order, the
  ``g_idx`` tensors) or not; ``sym`` true or false; ``checkpoint_format`` (or GPTQModel's ``format``) ``gptq``
  (zeros stored minus one, as AutoGPTQ wrote them: z = stored + 1, vLLM's reading) or ``gptq_v2`` (zeros as they
  are); ``pack_dtype`` int32.
- ``awq``: ``version`` gemm, bits 4, ``zero_point`` true, ``group_size`` a multiple of 32 (128 in practice), the
  ``autoawq`` backend's packing; ``modules_to_not_convert`` are float in the file and stay so.
- ``compressed-tensors``: format ``pack-quantized`` (at the top or in the group), one config group targeting
  ``Linear`` with integer weights of 4 or 8 bits, strategy ``group`` (size a multiple of 32) or ``channel``,
  symmetric or not (zero points), ``actorder`` none / weight / static, or group (a ``weight_g_idx`` per layer);
  ``quantization_status`` compressed; the ``ignore`` list's layers are float in the file and stay so.
FP8 checkpoints (``fp8``, ``fbgemm_fp8``, compressed-tensors with float weights) are read by
engine/models/config_fp8.py into an ``Fp8Fields``.
Which layers are quantized is read from the tensors (a layer with ``qweight`` / ``weight_packed`` is, a layer
with ``weight`` is not), so an ignore list needs no pattern matching here.

Anything else is a ModelLoadError naming the field and value: other methods (bitsandbytes, hqq, marlin, ...),
other bit widths, group sizes that are not whole 32-weight blocks, quantized integer activations (W8A8), a KV
cache scheme, sparsity or transforms, GPTQModel's per-module ``dynamic`` overrides, other AWQ versions and
backends, other compressed-tensors formats and statuses, several config groups, targets other than Linear.
Fields that only describe calibration (dataset, damp_percent, true_sequential, observers, ...) are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ModelLoadError
from engine.models.config_fp8 import Fp8Fields, compressed_tensors_fp8, fbgemm_fp8, hf_fp8, is_float_scheme

METHODS = ("gptq", "awq", "compressed-tensors", "fp8", "fbgemm_fp8")


@dataclass(frozen=True)
class QuantFields:
    method: str  # one of METHODS
    bits: int  # 4 | 8
    group_size: int  # input columns per scale; -1: one group per row (per-channel)
    sym: bool
    zero_offset: int = 0  # added to a stored zero: 1 for GPTQ's v1 checkpoint format (zero - 1 stored)


def read_quantization(cfg: dict[str, Any]) -> QuantFields | Fp8Fields | None:
    """``cfg['quantization_config']`` checked and read; None when the checkpoint has none."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise ModelLoadError(f"quantization_config must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method not in METHODS:
        raise ModelLoadError(f"quantization_config quant_method {method!r} is not supported (supported: "
                             f"{', '.join(METHODS)}; or a GGUF file, or --quantization int8 | int4 on a float "
                             f"checkpoint)")
    return {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors, "fp8": hf_fp8,
            "fbgemm_fp8": fbgemm_fp8}[method](quant)


def _refuse(method: str, key: str, value: Any, supported: str) -> ModelLoadError:
    return ModelLoadError(f"quantization_config ({method}): {key}={value!r} is not supported ({supported})")


def _bits(method: str, value: Any, allowed: tuple[int, ...]) -> int:
    if isinstance(value, bool) or value not in allowed:
        raise _refuse(method, "bits", value, " or ".join(map(str, allowed)))
    return value


def _group_size(method: str, value: Any, per_row_ok: bool = True) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (
            (value == -1 and per_row_ok) or (value > 0 and value % 32 == 0)):
        raise _refuse(method, "group_size", value, "a multiple of 32" + (", or -1: one group per row"
                                                                          if per_row_ok else ""))
    return value


def _gptq(q: dict[str, Any]) -> QuantFields:
    fmt, old = q.get("checkpoint_format"), q.get("format")
    if fmt is not None and old is not None and fmt != old:
        raise ModelLoadError(f"quantization_config (gptq): checkpoint_format={fmt!r} and format={old!r} disagree")
    fmt = fmt if fmt is not None else (old if old is not None else "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", "checkpoint_format", fmt, "gptq or gptq_v2")
    if q.get("dynamic"):
        raise _refuse("gptq", "dynamic", q["dynamic"], "per-module overrides are not implemented")
    if q.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise _refuse("gptq", "pack_dtype", q["pack_dtype"], "int32")
    sym = q.get("sym", True)
    if not isinstance(sym, bool):
        raise _refuse("gptq", "sym", sym, "true or false")
    return QuantFields("gptq", _bits("gptq", q.get("bits"), (4, 8)), _group_size("gptq", q.get("group_size", 128)),
                       sym, zero_offset=1 if fmt == "gptq" else 0)


def _awq(q: dict[str, Any]) -> QuantFields:
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("awq", "version", q.get("version"), "gemm")
    backend = q.get("backend", "autoawq")
    if backend not in (None, "autoawq"):
        raise _refuse("awq", "backend", backend, "autoawq")
    if q.get("zero_point", True) is not True:
        raise _refuse("awq", "zero_point", q.get("zero_point"), "true")
    bits = _bits("awq", q.get("bits", q.get("w_bit")), (4,))
    return QuantFields("awq", bits, _group_size("awq", q.get("group_size", q.get("q_group_size")), False), sym=False)


def _compressed_tensors(q: dict[str, Any]) -> QuantFields | Fp8Fields:
    m = "compressed-tensors"
    for key in ("kv_cache_scheme", "sparsity_config", "moe_sparsity_config", "transform_config"):
        if q.get(key):
            raise _refuse(m, key, q[key], "weight-only quantization of the linear layers")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(m, "quantization_status", status, "compressed")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        got = f"{len(groups)} groups ({', '.join(groups)})" if isinstance(groups, dict) else repr(groups)
        raise ModelLoadError(f"quantization_config ({m}): config_groups must hold exactly one scheme, got {got}")
    (name, scheme), = groups.items()
    if not isinstance(scheme, dict):
        raise _refuse(m, f"config_groups.{name}", scheme, "an object")
    if scheme.get("targets") != ["Linear"]:
        raise _refuse(m, f"config_groups.{name}.targets", scheme.get("targets"), '["Linear"]')
    if is_float_scheme(scheme):
        return compressed_tensors_fp8(q, name, scheme)
    fmt = scheme.get("format") or q.get("format")
    if fmt != "pack-quantized":
        raise _refuse(m, "format", fmt, "pack-quantized")
    for key in ("input_activations", "output_activations"):
        if scheme.get(key):
            raise _refuse(m, f"config_groups.{name}.{key}", scheme[key], "weight-only: W4A16 or W8A16")
    w = scheme.get("weights")
    if not isinstance(w, dict):
        raise _refuse(m, f"config_groups.{name}.weights", w, "an object")
    if w.get("type", "int") != "int":
        raise _refuse(m, "weights.type", w.get("type"), "int, or float for FP8")
    if w.get("dynamic", False) is not False:
        raise _refuse(m, "weights.dynamic", w.get("dynamic"), "false")
    strategy = w.get("strategy")
    if strategy == "group":
        group_size = _group_size(m, w.get("group_size"), per_row_ok=False)
    elif strategy == "channel":
        group_size = -1
    else:
        raise _refuse(m, "weights.strategy", strategy, "group or channel")
    if w.get("actorder") not in (None, "weight", "static", "group", "dynamic"):
        raise _refuse(m, "weights.actorder", w.get("actorder"), "none, weight, static or group")
    sym = w.get("symmetric", True)
    if not isinstance(sym, bool):
        raise _refuse(m, "weights.symmetric", sym, "true or false")
    return QuantFields(m, _bits(m, w.get("num_bits"), (4, 8)), group_size, sym)
