"""An FP8 checkpoint's ``quantization_config`` (issue 49), read and checked: weights stored as float8 e4m3 with
float scales, as the three layouts people download write them. engine/models/config_quant.py hands these methods
here; engine/loading/hf_fp8.py reads the tensors.

- compressed-tensors, format ``float-quantized`` (llm-compressor's FP8, FP8_DYNAMIC and FP8_BLOCK presets; also
  ``naive-quantized`` with float weights): one config group targeting Linear, weights ``type: float``,
  ``num_bits: 8``, symmetric, static; strategy ``tensor`` (one ``weight_scale``), ``channel`` ([rows, 1]) or
  ``block`` (``block_structure`` [bn, bk]: [ceil(rows / bn), ceil(cols / bk)]). Input activations: none (weight
  only), float 8 bits dynamic per ``token`` or per ``group`` of 128, or static per ``tensor`` (an ``input_scale``
  per layer).
- ``quant_method: fp8`` (transformers' FineGrainedFP8 and DeepSeek-V3's layout): ``weight_block_size`` [bn, bk],
  each weight's ``weight_scale_inv`` [ceil(rows / bn), ceil(cols / bk)] (despite the name, w = q * scale_inv),
  ``activation_scheme`` dynamic (per token group of bk), ``fmt`` e4m3.
- ``quant_method: fbgemm_fp8`` (FBGEMM rowwise): ``weight_scale`` [rows, 1], activations dynamic per token below
  ``activation_scale_ub``.
Every quantized weight dequantizes as ``w = float(q) * scale`` in fp32 (the scale of the weight's block, row or
tensor): an fp8 value is exact in fp32, so the one product is the only rounding.

Anything else is a ModelLoadError naming the field and value: e5m2 weights, other bit widths, asymmetric or dynamic
weights, other activation strategies, several config groups, a KV cache scheme.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ModelLoadError

STRATEGIES = ("tensor", "channel", "block")
ACTIVATIONS = ("none", "dynamic-token", "dynamic-group", "static-tensor")


@dataclass(frozen=True)
class Fp8Fields:
    origin: str  # "compressed-tensors" | "fp8" | "fbgemm_fp8": the config's quant_method
    strategy: str  # one of STRATEGIES: what one weight scale covers
    activations: str  # one of ACTIVATIONS: how the format quantizes a layer's input (a GPU FP8 GEMM follows it)
    block: tuple[int, int] | None = None  # (rows, cols) per scale, strategy "block"
    scale_part: str = "weight_scale"  # the scale tensor's suffix ("weight_scale_inv" for quant_method fp8)
    group_size: int = 0  # activations "dynamic-group": input columns per scale
    scale_ub: float | None = None  # fbgemm_fp8: the cap on a row's activation amax (activation_scale_ub)
    method: str = "fp8"  # what the loader dispatches on (config_quant.QuantFields.method's counterpart)


def _refuse(origin: str, key: str, value: Any, supported: str) -> ModelLoadError:
    return ModelLoadError(f"quantization_config ({origin}): {key}={value!r} is not supported ({supported})")


def _block(origin: str, key: str, value: Any) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise _refuse(origin, key, value, "two positive integers [rows, cols]")
    return int(value[0]), int(value[1])


def hf_fp8(q: dict[str, Any]) -> Fp8Fields:
    """``quant_method: fp8`` (transformers' FineGrainedFP8Config, DeepSeek-V3's config)."""
    if q.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fp8", "fmt", q.get("fmt"), "e4m3")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse("fp8", "activation_scheme", q.get("activation_scheme"), "dynamic")
    block = _block("fp8", "weight_block_size", q.get("weight_block_size"))
    return Fp8Fields("fp8", "block", "dynamic-group", block, "weight_scale_inv", group_size=block[1])


def fbgemm_fp8(q: dict[str, Any]) -> Fp8Fields:
    """``quant_method: fbgemm_fp8``: rowwise weight scales, dynamic per-token activations."""
    ub = q.get("activation_scale_ub", 1200.0)
    if isinstance(ub, bool) or not isinstance(ub, (int, float)) or ub <= 0:
        raise _refuse("fbgemm_fp8", "activation_scale_ub", ub, "a positive number")
    return Fp8Fields("fbgemm_fp8", "channel", "dynamic-token", scale_ub=float(ub))


def is_float_scheme(scheme: dict[str, Any]) -> bool:
    """A compressed-tensors config group whose weights are floats (FP8): this module's, not the integer reader's."""
    w = scheme.get("weights")
    return isinstance(w, dict) and w.get("type") == "float"


def compressed_tensors_fp8(q: dict[str, Any], name: str, scheme: dict[str, Any]) -> Fp8Fields:
    """One compressed-tensors config group (``name``: its key) with float weights."""
    m = "compressed-tensors"
    fmt = scheme.get("format") or q.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(m, "format", fmt, "float-quantized for float weights")
    w = scheme["weights"]
    if w.get("num_bits") != 8:
        raise _refuse(m, "weights.num_bits", w.get("num_bits"), "8: float8 e4m3")
    if w.get("symmetric", True) is not True:
        raise _refuse(m, "weights.symmetric", w.get("symmetric"), "true")
    if w.get("dynamic", False) is not False:
        raise _refuse(m, "weights.dynamic", w.get("dynamic"), "false")
    strategy = w.get("strategy")
    if strategy not in STRATEGIES:
        raise _refuse(m, "weights.strategy", strategy, ", ".join(STRATEGIES))
    block = _block(m, "weights.block_structure", w.get("block_structure")) if strategy == "block" else None
    if scheme.get("output_activations"):
        raise _refuse(m, f"config_groups.{name}.output_activations", scheme["output_activations"], "none")
    a = scheme.get("input_activations")
    if not a:
        return Fp8Fields(m, strategy, "none", block)
    if not isinstance(a, dict) or a.get("type") != "float" or a.get("num_bits") != 8:
        raise _refuse(m, f"config_groups.{name}.input_activations", a, "float 8 bits, or none")
    kind = (a.get("strategy"), bool(a.get("dynamic")))
    if kind == ("token", True):
        return Fp8Fields(m, strategy, "dynamic-token", block)
    if kind == ("group", True):
        size = a.get("group_size")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise _refuse(m, "input_activations.group_size", size, "a positive integer")
        return Fp8Fields(m, strategy, "dynamic-group", block, group_size=size)
    if kind == ("tensor", False):
        return Fp8Fields(m, strategy, "static-tensor", block)
    raise _refuse(m, "input_activations", f"strategy {kind[0]}, dynamic {kind[1]}",
                  "dynamic per token or per group, or static per tensor")
