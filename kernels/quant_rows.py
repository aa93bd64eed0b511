"""quant_rows: rows of a packed quantized weight (kernels/quant_gpu.py ``GpuQuant``) gathered and dequantized in
one kernel: a quantized token table's lookup (``ids``), or the whole weight (``ids`` None) for the large-M
fallback of kernels/quant_gemm.py (dequantize, then cuBLAS).

One program per tile of [BLOCK_T rows, BLOCK_C columns], each weight decoded on its own (its byte, its nibble,
its high bits, its groups' scale / min / zero), columns of an act-order weight stored back to their input
positions. Exact: compiled without FMA contraction (``enable_fp_fusion=False``), so q * s + m rounds twice as
the formats do, and a float32 result equals ``quant_rows_ref`` bit for bit (fp16 / bf16: that value rounded to
nearest even once). Reads nothing on the host on CUDA (the id range check runs on CPU tensors, or with
``DUET_KERNEL_CHECKS=1``), so it replays in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _quant_values as qv
from kernels import _triton_utils as tu
from kernels.fused import _round
from kernels.quant_gpu import GpuQuant, dequantize_ref

_BLOCK_T, _BLOCK_C = 8, 256  # a program's rows x columns on a GPU: 16 weights per thread of 4 warps (no spills)


def quant_rows_ref(p: GpuQuant, ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[len(ids) or rows, cols] in ``dtype``: rows ``ids`` of ``dequantize_ref(p)``."""
    w = dequantize_ref(p)
    return (w if ids is None else w[ids.reshape(-1).long().cpu()].to(p.device)).to(dtype)


@triton.jit
def _quant_rows_kernel(
    ids_ptr,  # [T] int32 / int64 (read only when HAS_IDS)
    qs_ptr,  # [rows, cols // 2] uint8 nibbles | [rows, cols] int8 / uint8
    qh_ptr,  # [cols // 32 * (BITS - 4), rows] int32 (read only when 4 < BITS < 8)
    scales_ptr, sub_scales_ptr, mins_ptr, sub_mins_ptr, zeros_ptr,  # [groups, rows] / [sub-groups, rows]
    perm_ptr,  # [cols] int32 (read only when HAS_PERM)
    out_ptr,  # [T, cols]
    T, rows, cols, offset,
    stride_qn, stride_on,
    BITS: tl.constexpr,
    SPAN: tl.constexpr,
    GROUP: tl.constexpr,
    SUB_GROUP: tl.constexpr,
    MODE: tl.constexpr,
    HAS_IDS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (t < T)[:, None] & (c < cols)[None, :]
    t_in = t % T  # wrapped onto valid rows / columns: every load in bounds, only the store is masked
    if HAS_IDS:
        n = tl.load(ids_ptr + t_in).to(tl.int64)[:, None]
    else:
        n = t_in.to(tl.int64)[:, None]
    k = (c % cols)[None, :]
    if BITS == 8:
        q = tl.load(qs_ptr + n * stride_qn + k).to(tl.int32)
    else:
        j = k % SPAN  # byte j % (SPAN / 2) of the run; the high nibble from SPAN / 2 on
        b = tl.load(qs_ptr + n * stride_qn + (k // SPAN) * (SPAN // 2) + j % (SPAN // 2)).to(tl.int32)
        q = (b >> ((j // (SPAN // 2)) * 4)) & 15
        if BITS > 4:
            q = qv.with_high_bits(q, qh_ptr, n, k // 32, k % 32, rows, BITS - 4)
    w = qv.affine(q, n, k, offset, scales_ptr, sub_scales_ptr, mins_ptr, sub_mins_ptr, zeros_ptr, rows,
                  GROUP, SUB_GROUP, MODE)
    if HAS_PERM:
        k = tl.load(perm_ptr + k)
    tl.store(out_ptr + t[:, None].to(tl.int64) * stride_on + k, _round(w, out_ptr.dtype.element_ty, RNE_BF16),
             mask=mask)


def _check_packed(p: GpuQuant) -> None:
    if not isinstance(p, GpuQuant):
        raise TypeError(f"expected a kernels.quant_gpu.GpuQuant, got {type(p).__name__}")


def quant_rows(p: GpuQuant, ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``ids`` ([T] int32 / int64; None: every row) of ``p`` dequantized -> [T, cols] in ``dtype``;
    same values as ``quant_rows_ref``."""
    _check_packed(p)
    if dtype not in tu.FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {[str(d) for d in tu.FLOAT_DTYPES]}, got {dtype}")
    if ids is not None:
        tu.check_tensor("ids", ids.reshape(-1), 1, tu.INDEX_DTYPES)
        ids = ids.reshape(-1)
        if ids.numel() > 1 and ids.stride(0) != 1:
            ids = ids.contiguous()
    device = tu.check_device(qs=p.qs, ids=ids)
    count = p.rows if ids is None else ids.numel()
    if ids is not None and count and tu.value_checks_enabled(device):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= p.rows:
            raise ValueError(f"ids must be in [0, {p.rows}), got values in [{lo}, {hi}]")
    out = torch.empty(count, p.cols, dtype=dtype, device=device)
    if count == 0:
        return out
    if tu.INTERPRET:  # big tiles: the interpreter pays per program
        block_t, block_c = min(64, tu.next_pow2(count)), min(1024, tu.next_pow2(p.cols))
    else:
        block_t, block_c = _BLOCK_T, _BLOCK_C
    grid = (triton.cdiv(count, block_t), triton.cdiv(p.cols, block_c))
    _quant_rows_kernel[grid](
        ids if ids is not None else p.qs, p.qs, *qv.pointer_args(p), p.perm if p.perm is not None else p.qs, out,
        count, p.rows, p.cols, p.offset,
        p.qs.stride(0), out.stride(0),
        BITS=p.bits, SPAN=p.span, GROUP=p.group_size, SUB_GROUP=p.sub_group, MODE=qv.mode(p),
        HAS_IDS=ids is not None, HAS_PERM=p.perm is not None, BLOCK_T=block_t, BLOCK_C=block_c,
        RNE_BF16=tu.INTERPRET and dtype == torch.bfloat16, num_warps=4, enable_fp_fusion=False,
    )
    return out
