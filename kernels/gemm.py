"""gemm: ``y = x @ weight.T (+ bias)`` with nn.Linear's weight layout ``[out_features, in_features]``.

``w8a16_gemm`` is the int8 weight-only variant: ``weight ≈ qweight * scales`` per output channel
(``scales[N, 1]``) or per group of ``group_size`` input features (``scales[N, K // group_size]``).

Triton path: one tiled kernel for both (``QUANT`` picks the int8 variant), with grouped program order so
consecutive programs share x rows in L2. The int8 weight tile is dequantized in the inner loop right after
loading and fed to the same ``tl.dot`` as a float GEMM: with per-group scales each [BLOCK_K, BLOCK_N] tile is
multiplied by its group's scales (a K tile never straddles two groups: BLOCK_K divides the group size) and
rounded to the activation dtype; with per-channel scales the int8 values convert exactly and the scales
multiply the fp32 accumulator once at the end (cheaper, and no rounding of the dequantized weight).

Configs are picked by M, without autotuning: skinny decode shapes (small M) are weight-bandwidth bound and
get narrow tiles plus split-K (fp32 partials summed by torch) when the tile grid alone would leave SMs idle;
prefill shapes (large M) get large tensor-core tiles. They were checked to compile for sm_90 without
register spills (tests/kernels/sm90_compile.py), not tuned on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import _triton_utils as tu


def gemm_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    return torch.nn.functional.linear(x, weight, bias)


def quantize_weight_int8(
    weight: torch.Tensor,  # [N, K] float
    group_size: int | None = None,  # None: per output channel
) -> tuple[torch.Tensor, torch.Tensor]:  # qweight [N, K] int8, scales [N, K // group_size] fp32
    n, k = weight.shape
    g = k if group_size is None else group_size
    if k % g:
        raise ValueError(f"in_features {k} is not a multiple of group_size {g}")
    w = weight.float().view(n, k // g, g)
    scales = (w.abs().amax(dim=-1) / 127.0).clamp(min=1e-8)
    q = torch.round(w / scales.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q.view(n, k), scales


def dequantize_weight_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = qweight.shape
    g = k // scales.shape[1]
    return (qweight.float().view(n, -1, g) * scales.unsqueeze(-1)).view(n, k)


def w8a16_gemm_ref(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    qweight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N, K // group_size] fp32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], dtype of x
    w = dequantize_weight_int8(qweight, scales)
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (row tile, column tile), walking GROUP_M row tiles together so their x rows stay in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_pid_n)) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_rows
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_rows
    return pid_m, pid_n


@triton.jit
def _gemm_kernel(
    x_ptr,  # [M, K] fp16/bf16/fp32
    w_ptr,  # [N, K] dtype of x, or int8 when QUANT
    scales_ptr,  # [N, K // group_size] fp32 (read only when QUANT)
    bias_ptr,  # [N] (read only when HAS_BIAS)
    y_ptr,  # [M, N] dtype of x; [SPLIT_K, M, N] fp32 partials when SPLIT_K > 1
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    group_size,  # K for per-channel scales
    k_per_split,  # multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # every K tile is full: no K mask
    HAS_BIAS: tl.constexpr,
    QUANT: tl.constexpr,
    PER_GROUP: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # wrap out-of-range rows/cols onto valid ones: loads need no M/N mask, the store is masked
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] view of w.T

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = offs_k < k_end - (k0 - k_start)
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0)
        if UPCAST:
            x = x.to(tl.float32)
        if PER_GROUP:  # dequantize the tile: one group per K tile, so one scale per column
            scale = tl.load(scales_ptr + cols * stride_sn + k0 // group_size)
            w = (w.to(tl.float32) * scale[None, :]).to(x.dtype)
        else:
            w = w.to(x.dtype)  # int8 -> fp16/bf16/fp32 is exact; per-channel scales apply at the end
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if QUANT and not PER_GROUP:
        acc = acc * tl.load(scales_ptr + cols * stride_sn)[None, :]

    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = y_ptr + pid_k.to(tl.int64) * M * N
        tl.store(part + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc, mask=out_mask)


@dataclass(frozen=True)
class _GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1


def _pick_config(m: int, n: int, k: int, dtype: torch.dtype, num_sms: int) -> _GemmConfig:
    """Tile config by shape: skinny decode (M <= 16), mid, and prefill (large M); no autotuning."""
    if tu.INTERPRET:
        return _GemmConfig(32, 32, 32, 4, 1)  # big tiles, few programs: the interpreter pays per program
    if dtype == torch.float32:
        return _GemmConfig(64, 64, 32, 4, 3)
    if m <= 16:
        cfg = _GemmConfig(16, 64, 64, 4, 4)  # BLOCK_K 128 spills a register at M=16 (sm_90 check)
    elif m <= 64:
        cfg = _GemmConfig(64, 64, 64, 4, 4)
    elif m <= 256:
        cfg = _GemmConfig(128, 128, 64, 8, 3)
    else:
        cfg = _GemmConfig(128, 256, 64, 8, 3)
    split = split_k(triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), k, cfg.block_k, num_sms)
    return _GemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, split)


def split_k(num_tiles: int, k: int, block_k: int, num_sms: int) -> int:
    """K splits for a grid of ``num_tiles`` output tiles: weight-bound shapes split K until ~2 programs per SM,
    keeping >= 4 K tiles per split (kernels/quant_gemm.py's configs too)."""
    split = 1
    while num_tiles * split * 2 <= 2 * num_sms and k // (split * 2) >= 4 * block_k:
        split *= 2
    return split


def _launch_gemm(x, w, scales, bias, group_size: int | None, cfg: _GemmConfig | None = None) -> torch.Tensor:
    """Shared launcher body (arguments already checked); ``cfg`` lets tests force a config."""
    lead = x.shape[:-1]
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.view(*lead, n)
    if k == 0:
        y.zero_()
        return (y + bias).view(*lead, n) if bias is not None else y.view(*lead, n)
    cfg = cfg or _pick_config(m, n, k, x.dtype, tu.num_sms(x.device))
    block_k = cfg.block_k
    per_group = scales is not None and scales.shape[1] > 1
    if per_group:
        block_k = min(block_k, group_size & -group_size)  # largest power of two dividing the group size
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    out = y if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    upcast = tu.INTERPRET  # the interpreter gets bf16 arithmetic wrong: compute in fp32 after loading
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split_k)
    _gemm_kernel[grid](
        x2, w, scales if scales is not None else w, bias if bias is not None else w, out,
        m, n, k,
        x2.stride(0), w.stride(0), scales.stride(0) if scales is not None else 0, y.stride(0),
        group_size or k, k_per_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=8,
        SPLIT_K=split_k,
        EVEN_K=k % block_k == 0 and k_per_split % block_k == 0,
        HAS_BIAS=bias is not None,
        QUANT=scales is not None,
        PER_GROUP=per_group,
        UPCAST=upcast,
        DOT_PRECISION=tu.dot_precision(x.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split_k > 1:
        acc = out.sum(0)
        if bias is not None:
            acc += bias.float()
        y.copy_(acc)
    return y.view(*lead, n)


def _check_x_bias(x: torch.Tensor, n: int, bias: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x must have >= 2 dims [..., K], got shape {tuple(x.shape)}")
    if x.dtype not in tu.FLOAT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}, expected one of {[str(d) for d in tu.FLOAT_DTYPES]}")
    if bias is not None:
        tu.check_tensor("bias", bias, 1, (x.dtype,))
        tu.check_shape("bias", bias, (n,))
        if n > 1 and bias.stride(0) != 1:
            raise ValueError(f"bias must be contiguous, got stride {bias.stride()}")


def gemm(
    x: torch.Tensor,  # [..., K] (2-D [M, K] in the engine)
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N], dtype of x
    """Triton ``x @ weight.T + bias``; same semantics as ``gemm_ref``."""
    tu.check_tensor("weight", weight, 2, tu.FLOAT_DTYPES)
    n, k = weight.shape
    _check_x_bias(x, n, bias)
    tu.check_device(x=x, weight=weight, bias=bias)
    if weight.dtype != x.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} but x has {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features but weight [N, K] has K={k}")
    tu.check_last_dim_contiguous("weight", weight)
    return _launch_gemm(x, weight, None, bias, None)


def w8a16_gemm(
    x: torch.Tensor,  # [..., K] fp16/bf16/fp32
    qweight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N, K // group_size] fp32 ([N, 1]: per output channel)
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N], dtype of x
    """Triton int8 weight-only GEMM; same semantics as ``w8a16_gemm_ref``."""
    tu.check_tensor("qweight", qweight, 2, (torch.int8,))
    tu.check_tensor("scales", scales, 2, (torch.float32,))
    n, k = qweight.shape
    _check_x_bias(x, n, bias)
    tu.check_device(x=x, qweight=qweight, scales=scales, bias=bias)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features but qweight [N, K] has K={k}")
    num_groups = scales.shape[1]
    if scales.shape[0] != n or num_groups < 1 or k % num_groups:
        raise ValueError(f"scales has shape {tuple(scales.shape)}, expected [{n}, K // group_size] with K={k}")
    group_size = k // num_groups
    if num_groups > 1 and group_size % 16:
        raise ValueError(f"group_size {group_size} (K={k} / {num_groups} groups) must be a multiple of 16")
    tu.check_last_dim_contiguous("qweight", qweight)
    tu.check_last_dim_contiguous("scales", scales)
    return _launch_gemm(x, qweight, scales, bias, group_size)
