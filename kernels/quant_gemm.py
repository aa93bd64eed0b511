"""quant_gemm: ``y = x @ W.T (+ bias)`` with W a packed quantized weight (kernels/quant_gpu.py ``GpuQuant``: the
GGUF block types, GPTQ / AWQ / compressed-tensors groups): W4A16 / W8A16 (and 5, 6 bits), x fp16 / bf16 / fp32,
fp32 accumulation, W never dequantized in memory.

The kernel is kernels/gemm.py's tiled GEMM (grouped program order, configs by M, split-K for skinny M with fp32
partials summed by torch) with the weight tile decoded in registers between its load and ``tl.dot``. A K tile is
walked in *units* of 16 or 32 consecutive weights of each of the tile's columns: a unit lies in one group (and
sub-group, and 32-weight high-bit run), so its scale, min or zero is one load per column, broadcast over the unit.
4-, 5- and 6-bit quants are nibble pairs (byte j of a ``span`` run holds weights j and j + span / 2): one byte
load per column and unit gives two units, each its own ``tl.dot`` against the x columns it multiplies (x read
through ``perm`` for act order). 8 bits: one load, one dot per unit. The dequantized unit is rounded to x's dtype
for the dot, as a dense engine holding the dequantized weights in that dtype multiplies them; fp32 x gets 3xTF32
dots (kernels/_triton_utils.py ``dot_precision``).

Large M falls back to dequantize + cuBLAS (``DEQUANT_GEMM_ROWS``): the weight dequantized into x's dtype by
kernels/quant_rows.py (in tiles of rows of at most ``_TILE_BYTES``), then ``torch.nn.functional.linear``. The
threshold is a placeholder until measured on a GPU (bench/kernels/quant_gemm.py prints the crossover): 256 rows,
past the decode batch sizes where the weight-bound quantized kernel is expected to win (Marlin's int4 is 0.6-0.74x
fp16 from batch 256 on) and before our untuned prefill tiles could cost several times cuBLAS.

Configs by M, without autotuning, checked to compile for sm_90 without register spills in fp16 / bf16
(tests/kernels/sm90_compile.py), not tuned on a GPU. Nothing is read on the host: it replays in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _quant_values as qv
from kernels import _triton_utils as tu
from kernels.fused import _round
from kernels.gemm import _GemmConfig, _grouped_tile, split_k
from kernels.quant_gpu import GpuQuant, dequantize_ref
from kernels.quant_rows import quant_rows

DEQUANT_GEMM_ROWS = 256  # M from which quant_gemm dequantizes for cuBLAS: a placeholder (module docstring)
_TILE_BYTES = 256 << 20  # the fallback's dequantized weight, at most this much at a time


def quant_gemm_ref(x: torch.Tensor, p: GpuQuant, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., cols] @ dequantize_ref(p).T (+ bias)`` -> [..., rows] float32."""
    return torch.nn.functional.linear(x.float(), dequantize_ref(p), None if bias is None else bias.float())


@triton.jit
def _dot_unit(acc, x_ptr, rows, kk, perm_ptr, stride_xm, w, HAS_PERM: tl.constexpr, UPCAST: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """acc += x[rows, kk] @ w, w the [UNIT, BLOCK_N] fp32 weights of columns kk (input columns perm[kk])."""
    if HAS_PERM:
        kk = tl.load(perm_ptr + kk)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :])
    if UPCAST:
        x = x.to(tl.float32)
    return tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)


@triton.jit
def _quant_gemm_kernel(
    x_ptr,  # [M, K] fp16 / bf16 / fp32
    qs_ptr,  # [N, K // 2] uint8 nibbles | [N, K] int8 / uint8
    qh_ptr,  # [K // 32 * (BITS - 4), N] int32 (read only when 4 < BITS < 8)
    scales_ptr, sub_scales_ptr, mins_ptr, sub_mins_ptr, zeros_ptr,  # [groups, N] / [sub-groups, N]
    perm_ptr,  # [K] int32 (read only when HAS_PERM)
    bias_ptr,  # [N] (read only when HAS_BIAS)
    y_ptr,  # [M, N] dtype of x; [SPLIT_K, M, N] fp32 partials when SPLIT_K > 1
    M, N, K, offset,
    stride_xm, stride_qn, stride_ym,
    k_per_split,  # a multiple of BLOCK_K
    BITS: tl.constexpr,
    SPAN: tl.constexpr,
    UNIT: tl.constexpr,  # weights per unit: 16 or 32, inside one group, sub-group and high-bit run
    GROUP: tl.constexpr,
    SUB_GROUP: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of SPAN (nibbles) and UNIT, dividing K
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RNE_BF16: tl.constexpr,  # the interpreter: round the bf16 output to nearest even (kernels/fused.py _round)
):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_m % M).to(tl.int64)  # wrapped onto valid rows / columns: loads unmasked, the store masked
    n = (offs_n % N).to(tl.int64)[None, :]
    j = tl.arange(0, UNIT)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if BITS == 8:
            for u in tl.static_range(BLOCK_K // UNIT):
                kb = k0 + u * UNIT
                q = tl.load(qs_ptr + n * stride_qn + (kb + j)[:, None]).to(tl.int32)
                w = qv.affine(q, n, kb, offset, scales_ptr, sub_scales_ptr, mins_ptr, sub_mins_ptr, zeros_ptr,
                              N, GROUP, SUB_GROUP, MODE)
                acc = _dot_unit(acc, x_ptr, rows, kb + j, perm_ptr, stride_xm, w, HAS_PERM, UPCAST, DOT_PRECISION)
        else:
            byte0 = tl.multiple_of(k0 // 2, 16)  # k0 is a multiple of BLOCK_K >= 32: the byte loads vectorize
            for r in tl.static_range(BLOCK_K // SPAN):
                for u in tl.static_range(SPAN // 2 // UNIT):
                    k_lo = k0 + r * SPAN + u * UNIT  # the unit of low nibbles; the high ones are half further
                    k_hi = k_lo + SPAN // 2
                    b = tl.load(qs_ptr + n * stride_qn + (byte0 + r * (SPAN // 2) + u * UNIT + j)[:, None])
                    lo = b.to(tl.int32) & 15
                    hi = b.to(tl.int32) >> 4
                    if BITS > 4:
                        lo = qv.with_high_bits(lo, qh_ptr, n, k_lo // 32, (k_lo % 32 + j)[:, None], N,
                                               BITS - 4)
                        hi = qv.with_high_bits(hi, qh_ptr, n, k_hi // 32, (k_hi % 32 + j)[:, None], N,
                                               BITS - 4)
                    w = qv.affine(lo, n, k_lo, offset, scales_ptr, sub_scales_ptr, mins_ptr, sub_mins_ptr,
                                  zeros_ptr, N, GROUP, SUB_GROUP, MODE)
                    acc = _dot_unit(acc, x_ptr, rows, k_lo + j, perm_ptr, stride_xm, w, HAS_PERM, UPCAST,
                                    DOT_PRECISION)
                    w = qv.affine(hi, n, k_hi, offset, scales_ptr, sub_scales_ptr, mins_ptr, sub_mins_ptr,
                                  zeros_ptr, N, GROUP, SUB_GROUP, MODE)
                    acc = _dot_unit(acc, x_ptr, rows, k_hi + j, perm_ptr, stride_xm, w, HAS_PERM, UPCAST,
                                    DOT_PRECISION)

    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n).to(tl.float32)
        tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
                 _round(acc, y_ptr.dtype.element_ty, RNE_BF16), mask=out_mask)
    else:
        part = y_ptr + pid_k.to(tl.int64) * M * N
        tl.store(part + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc, mask=out_mask)


def unit(p: GpuQuant) -> int:
    """Weights per unit: the nibble half-run, the finest group, at most 32."""
    return min(p.span // 2 if p.span else 32, p.sub_group or p.group_size, 32)


def pick_config(m: int, n: int, k: int, dtype: torch.dtype, num_sms: int) -> _GemmConfig:
    """Tile config by M (decode: narrow tiles plus split-K; then wider), no autotuning; ``block_k`` a target the
    launcher fits to the format and K."""
    if tu.INTERPRET:  # big tiles, few programs: the interpreter pays per program
        return _GemmConfig(min(64, max(16, tu.next_pow2(m))), min(128, max(16, tu.next_pow2(n))), 256, 4, 1)
    if m <= 16:
        cfg = _GemmConfig(16, 64, 128, 4, 3)  # 4 stages spill a register at M = 16 (sm_90 check)
    elif m <= 64:
        cfg = _GemmConfig(64, 64, 128, 4, 3)
    else:
        cfg = _GemmConfig(128, 128, 64, 8, 3)
    if dtype == torch.float32:  # the correctness path: 3xTF32 dots need more registers
        cfg = _GemmConfig(min(cfg.block_m, 64), 64, 64, 4, 2)
    split = split_k(triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), k, cfg.block_k, num_sms)
    return _GemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, split)


def _block_k(p: GpuQuant, target: int) -> int:
    """The largest K tile <= ``target`` (at least one span) that is a multiple of the span and unit and divides K."""
    step = max(p.span, unit(p))
    block = max(step, target)  # powers of two: halving reaches the step, which divides K
    while p.cols % block:
        block //= 2
    return block


def _launch(x2: torch.Tensor, p: GpuQuant, bias: torch.Tensor | None, cfg: _GemmConfig) -> torch.Tensor:
    m, n, k = x2.shape[0], p.rows, p.cols
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    block_k = _block_k(p, cfg.block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x2.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    _quant_gemm_kernel[grid](
        x2, p.qs, *qv.pointer_args(p), p.perm if p.perm is not None else p.qs, bias if bias is not None else p.scales, out,
        m, n, k, p.offset,
        x2.stride(0), p.qs.stride(0), y.stride(0),
        k_per_split,
        BITS=p.bits, SPAN=p.span, UNIT=unit(p), GROUP=p.group_size, SUB_GROUP=p.sub_group, MODE=qv.mode(p),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=8, SPLIT_K=split,
        HAS_BIAS=bias is not None, HAS_PERM=p.perm is not None, UPCAST=tu.INTERPRET,
        DOT_PRECISION=tu.dot_precision(x2.dtype), RNE_BF16=tu.INTERPRET and x2.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        acc = out.sum(0)
        if bias is not None:
            acc += bias.float()
        y.copy_(acc)
    return y


def _dequant_gemm(x2: torch.Tensor, p: GpuQuant, bias: torch.Tensor | None) -> torch.Tensor:
    """The large-M fallback: W dequantized into x's dtype (tiles of rows), then cuBLAS (torch's linear)."""
    tile_rows = max(1, _TILE_BYTES // (p.cols * x2.element_size()))
    if p.rows <= tile_rows:
        return torch.nn.functional.linear(x2, quant_rows(p, None, x2.dtype), bias)
    y = torch.empty(x2.shape[0], p.rows, dtype=x2.dtype, device=x2.device)
    for r0 in range(0, p.rows, tile_rows):
        ids = torch.arange(r0, min(r0 + tile_rows, p.rows), device=x2.device)
        y[:, r0:r0 + ids.numel()] = torch.nn.functional.linear(x2, quant_rows(p, ids, x2.dtype))
    return y + bias if bias is not None else y


def quant_gemm(x: torch.Tensor, p: GpuQuant, bias: torch.Tensor | None = None, *,
               cfg: _GemmConfig | None = None) -> torch.Tensor:
    """``x [..., cols] @ W.T (+ bias [rows])`` -> [..., rows] in x's dtype; same semantics as ``quant_gemm_ref``.
    From ``DEQUANT_GEMM_ROWS`` rows of x: dequantize + cuBLAS. ``cfg`` forces a tile config (tests, benchmarks;
    never the fallback)."""
    if not isinstance(p, GpuQuant):
        raise TypeError(f"p must be a kernels.quant_gpu.GpuQuant, got {type(p).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.dtype not in tu.FLOAT_DTYPES:
        raise ValueError(f"x must be a float tensor [..., K], got {getattr(x, 'dtype', type(x))} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    if x.shape[-1] != p.cols:
        raise ValueError(f"x has {x.shape[-1]} input features but the {p.fmt} weight [N, K] has K={p.cols}")
    if bias is not None:
        tu.check_tensor("bias", bias, 1, (x.dtype,))
        tu.check_shape("bias", bias, (p.rows,))
        if p.rows > 1 and bias.stride(0) != 1:
            raise ValueError(f"bias must be contiguous, got stride {bias.stride()}")
    tu.check_device(x=x, qs=p.qs, bias=bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, p.cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0 or p.rows == 0:
        return x2.new_empty(*lead, p.rows)
    if cfg is None and m >= DEQUANT_GEMM_ROWS:
        return _dequant_gemm(x2, p, bias).view(*lead, p.rows)
    cfg = cfg or pick_config(m, p.rows, p.cols, x.dtype, tu.num_sms(x.device))
    return _launch(x2, p, bias, cfg).view(*lead, p.rows)
