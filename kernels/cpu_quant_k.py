"""GGUF k-quants (Q4_K, Q5_K, Q6_K: 256-weight super-blocks) on the CPU, kept packed: their 8-row layout and C calls
(kernels/cpu/quant_k.c: fp32 activations, dequantize; quant_k_int8.c: int8 activations). kernels/cpu_quant.py's
``pack`` / ``unpack`` / ``linear`` / ``rows`` hand a k-quant weight here.

``pack``: rows in groups of 8 (the last padded with zero rows), and per group and super-block one group-block with
the 8 rows' super-blocks field by field in the file's order, each field [chunk][8 rows][e bytes] (e = 8 for the
quants, 2 for fp16, 1 for the scales; kernels/cpu/quant_k.h draws it): one 64-byte load is 8 bytes of the same
weights of all 8 rows, llama.cpp's 8x8 interleave. Same bytes as the file, plus the padding rows; ``unpack`` gives
the file's bytes back exactly and ``dequantize`` gives exactly ``dequantize_ref``.

``linear``: activations "fp32" (the default): per sub-block sum(x * q) in fp32 times the reference's own d * sc,
minus dmin * mn * sum(x); within 2 * gamma_n * sum_j |x_j| (|d sc q_j| + |dmin mn|) of ``quant_linear_ref`` per
output (gamma_n = n u / (1 - n u), n = cols, u = 2^-24; tests/kernels/test_cpu_quant_k.py). "int8": x quantized
per 256 (llama.cpp's q8_K: amax / 127, sums per 16), integer dot products (VNNI's vpdpbusd where the CPU has it);
within sum_j |w_j| dx_j / 2 (dx_j: x_j's block scale) plus fp32 rounding. "fp32" with AVX512-VNNI and one row of x
(``PLANES_MAX_ROWS``): kernels/cpu/quant_k_planes.c, x as 24-bit fixed point per 256 in three int8 digit planes and
the int8 kernel's exact integer dots three times: within 2^-22 of each super-block's largest |x| per element plus
fp32 rounding (tests/kernels/test_cpu_quant_k_planes.py), 1.15-1.75x the widened kernel at M=1. Both: each packed byte read from memory
once per call for up to 4 rows of x (2 on AVX2), OpenMP over groups of 8 rows (torch.get_num_threads()); the
instruction set is kernels/cpu_quant_isa.py's.

Measured on this 2-vCPU machine (lscpu: an Intel Xeon, AVX-512 + VNNI; KVM), ``python -m bench.kernels.quant_gemv
--model 1.5b --no-dense --threads 1 2`` (a 1.5B Llama's Q4_K_M shapes, 512 MB of packed copies per shape: from
memory), packed GB/s at M=1 — see the table in kernels/cpu_quant.py's docstring.
"""
from __future__ import annotations

import torch

from kernels.cpu_build import NativeKernelError
from kernels.cpu_quant_isa import PLANES_LEVEL, in_huge_pages, lib
from kernels.quant import GGUF_BLOCKS, QuantWeight

# per format, its fields as (file offset, end, element bytes), in the file's order (kernels/cpu/quant_k.h)
# the digit-plane kernel at M <= this (measured, 2 threads, weights cold, us: Q4_K 8192x2048 M=1 293 vs the widened
# quants' 510, M=2 408 vs 562, M=3 607 vs 619; Q6_K 2048x8192 M=1 1039 vs 1193, M=2 1925 vs 1400; Q4_K 2048x2048
# M=2 114 vs 110: past M=1 its three planes of dots per row of x weigh more than the widened quants' shared work)
PLANES_MAX_ROWS = 1
_FIELDS = {
    "Q4_K": ((0, 2, 2), (2, 4, 2), (4, 16, 1), (16, 144, 8)),
    "Q5_K": ((0, 2, 2), (2, 4, 2), (4, 16, 1), (16, 48, 8), (48, 176, 8)),
    "Q6_K": ((0, 128, 8), (128, 192, 8), (192, 208, 1), (208, 210, 2)),
}


def pack(w: QuantWeight) -> torch.Tensor:
    """``w``'s super-blocks as uint8 [groups, nb, 8 * block_bytes] group-blocks (once, at load; in huge pages:
    kernels/cpu_quant_isa.py ``in_huge_pages``)."""
    bb, nb, groups = GGUF_BLOCKS[w.fmt].block_bytes, w.num_blocks, -(-w.rows // 8)
    blocks = w.data.reshape(w.rows, nb, bb)
    if groups * 8 > w.rows:
        blocks = torch.cat([blocks, blocks.new_zeros(groups * 8 - w.rows, nb, bb)])
    blocks = blocks.reshape(groups, 8, nb, bb)
    return in_huge_pages(torch.cat([blocks[..., lo:hi].reshape(groups, 8, nb, (hi - lo) // e, e)
                                    .permute(0, 2, 3, 1, 4).reshape(groups, nb, -1) for lo, hi, e in _FIELDS[w.fmt]],
                                   dim=-1).contiguous())


def unpack(fmt: str, rows: int, cols: int, qs: torch.Tensor) -> QuantWeight:
    """The file's bytes ``qs`` was packed from, byte for byte."""
    groups, nb = qs.shape[0], qs.shape[1]
    parts, at = [], 0
    for lo, hi, e in _FIELDS[fmt]:
        n = hi - lo
        parts.append(qs[..., at:at + 8 * n].reshape(groups, nb, n // e, 8, e).permute(0, 3, 1, 2, 4)
                     .reshape(groups * 8, nb, n))
        at += 8 * n
    return QuantWeight(fmt, rows, cols, torch.cat(parts, dim=-1).reshape(groups * 8, -1)[:rows].contiguous())


def dequantize_rows_into(out: torch.Tensor, ggml_type: int, qs: torch.Tensor, ids: torch.Tensor | None, row0: int,
                         level: int) -> None:
    """``out`` [count, cols] float32 (contiguous) = rows ``ids`` (or ``row0`` .. ``row0 + count``) dequantized,
    exactly gguf-py's."""
    if out.shape[0]:
        lib().duet_quant_k_dequantize(ggml_type, qs.data_ptr(), out.shape[1],
                                      ids.data_ptr() if ids is not None else None, row0, out.shape[0],
                                      out.data_ptr(), level, torch.get_num_threads())


def linear_into(out: torch.Tensor, x: torch.Tensor, ggml_type: int, qs: torch.Tensor, rows: int,
                bias: torch.Tensor | None, activations: str, level: int) -> None:
    """``out [M, rows] = x [M, cols] @ Wᵀ (+ bias)`` through the GEMV of ``activations`` ("fp32" or "int8");
    shapes checked by the caller (kernels/cpu_quant.py ``linear``)."""
    c = lib()
    if activations == "int8":
        fn = c.duet_quant_k_linear_int8
    else:  # AVX512-VNNI, one row of x: three int8 digit planes (kernels/cpu/quant_k_planes.c); else widened quants
        planes = level >= PLANES_LEVEL and x.shape[0] <= PLANES_MAX_ROWS
        fn = c.duet_quant_k_linear_planes if planes else c.duet_quant_k_linear_f32
    rc = fn(ggml_type, qs.data_ptr(), rows, x.shape[1], x.data_ptr(), x.stride(0), x.shape[0],
            bias.data_ptr() if bias is not None else None, out.data_ptr(), out.stride(0), level,
            torch.get_num_threads())
    if rc:
        raise NativeKernelError(f"duet_quant_k_linear ({activations}) failed (code {rc}: no scratch memory)")
