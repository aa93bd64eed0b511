"""The dequantization steps both quantized Triton kernels share (kernels/quant_gemm.py, kernels/quant_rows.py): a
weight's high bits and its group's affine map, in kernels/quant_gpu.py's layout and formulas.

Per-group arrays are group-major, [groups, rows] (so ``R``, the weight's row count, is their stride): value (n, g)
at ``g * R + n``. Both helpers broadcast: the GEMM passes one run's first column as a scalar (a run of 16 or 32 weights shares its
groups and its high-bit word, so the scales are loaded once per column of the tile) and the row kernel one column
per element.
"""
from __future__ import annotations

import triton
import triton.language as tl

MODE_OFFSET, MODE_ZERO, MODE_MIN = 0, 1, 2  # w = (q - offset) * s | (q - zero) * s | q * s + m


@triton.jit
def with_high_bits(q, qh_ptr, n, run, bit, R, PLANES: tl.constexpr):
    """``q`` (the low 4 bits, int32) with bits 4.. from the high-bit words of 32-weight run ``run`` of rows ``n``;
    ``bit``: the weight's place in its run."""
    for p in tl.static_range(PLANES):
        word = tl.load(qh_ptr + (run * PLANES + p) * R + n)
        q = q | (((word >> bit) & 1) << (4 + p))
    return q


@triton.jit
def affine(q, n, k, offset, scales_ptr, sub_scales_ptr, mins_ptr, sub_mins_ptr, zeros_ptr, R,
           GROUP: tl.constexpr, SUB_GROUP: tl.constexpr, MODE: tl.constexpr):
    """int32 quants ``q`` of rows ``n`` in the groups of column ``k`` -> fp32 weights. The order of operations is
    the formats' (kernels/quant_gpu.py): s = scale (* sub-scale), then one product (and a sum for a min); the
    caller decides on FMA contraction (the row kernel turns it off: exact)."""
    g = (k // GROUP) * R + n
    s = tl.load(scales_ptr + g).to(tl.float32)
    if SUB_GROUP > 0:
        sg = (k // SUB_GROUP) * R + n
        s = s * tl.load(sub_scales_ptr + sg).to(tl.float32)
    if MODE == 2:
        m = tl.load(mins_ptr + g).to(tl.float32)
        if SUB_GROUP > 0:
            m = m * tl.load(sub_mins_ptr + sg).to(tl.float32)
        w = q.to(tl.float32) * s + m
    elif MODE == 1:
        w = (q - tl.load(zeros_ptr + g).to(tl.int32)).to(tl.float32) * s
    else:
        w = (q - offset).to(tl.float32) * s
    return w


def mode(p) -> int:
    """The affine map of a kernels/quant_gpu.py ``GpuQuant``."""
    return MODE_MIN if p.mins is not None else MODE_ZERO if p.zeros is not None else MODE_OFFSET


def pointer_args(p) -> tuple:
    """The kernels' (qh, scales, sub_scales, mins, sub_mins, zeros) pointers, the scales standing in where absent."""
    return tuple(t if t is not None else p.scales for t in (p.qh, p.scales, p.sub_scales, p.mins, p.sub_mins, p.zeros))
