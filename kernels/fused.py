"""Fused per-token ops of the Triton backend: RMSNorm (with the residual add), in-place RoPE, SwiGLU.

In the eager torch code of engine/models/layers.py each of these is three to six kernels with a temporary between
each: on a GPU a decode step of a small model is mostly such launches. Here each is one kernel, and the
arithmetic is the torch code's, rounding to the model dtype where torch's separate ops round (bf16/fp16: the
math in fp32 between those points; the same results as the eager ops, see tests/kernels/test_fused.py):
- ``rms_norm``: ``weight * (x * rsqrt(mean(x²) + eps)).to(dtype)``; with ``residual``: ``residual += x`` (in
  place, rounded to the dtype as torch's add) and the sum normalized. One program per row.
- ``rotary_``: rotate-half RoPE in place on the first ``num_heads`` heads of each row of the fused qkv output
  (the q and k heads): ``x * cos + rotate_half(x) * sin`` with the tables cast to the dtype first, over the
  first ``rotary_dim`` dims of each head (all of them but under partial rotary; the rest are not touched).
  One program per row, all its heads as one [heads, rotary_dim / 2] tile.
- ``silu_mul``: ``silu(gate) * up`` on rows holding gate then up. Programs over (row, column tile).
The signatures are those of the CPU path's C kernels (kernels/cpu_native.py) on the ``KernelOps`` seam.
Data checks (positions inside the tables) read values on the host, so they run on CPU tensors only (or with
``DUET_KERNEL_CHECKS=1``): the CUDA path stays free of syncs and can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _triton_utils as tu


@triton.jit
def _round(x, dt: tl.constexpr, RNE_BF16: tl.constexpr):
    """fp32 ``x`` rounded to ``dt``. Triton's interpreter truncates fp32 → bf16 (the GPU rounds to nearest even):
    with ``RNE_BF16`` (set in the interpreter only) the rounding is done on the bits first, so the cast is exact."""
    if RNE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dt)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    stride_x, stride_r, stride_o,
    n, eps,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        h = _round(x + r, res_ptr.dtype.element_ty, RNE_BF16)  # the stream in its dtype, as torch's add rounds it
        tl.store(res_ptr + row * stride_r + offs, h, mask=mask)
        x = h.to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / n + eps)
    dt = out_ptr.dtype.element_ty
    h = _round(x * inv, dt, RNE_BF16).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, _round(w * h, dt, RNE_BF16), mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_x, stride_table,
    num_heads, head_dim, rotary_dim,  # rotary_dim <= head_dim: the dims rotated, at the front of each head
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    half = rotary_dim // 2
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < half
    mask = (offs_h[:, None] < num_heads) & d_mask[None, :]
    pos = tl.load(pos_ptr + row).to(tl.int64)
    dt = x_ptr.dtype.element_ty
    table = pos * stride_table + offs_d
    c1 = _round(tl.load(cos_ptr + table, mask=d_mask, other=0.0), dt, RNE_BF16).to(tl.float32)[None, :]
    c2 = _round(tl.load(cos_ptr + table + half, mask=d_mask, other=0.0), dt, RNE_BF16).to(tl.float32)[None, :]
    s1 = _round(tl.load(sin_ptr + table, mask=d_mask, other=0.0), dt, RNE_BF16).to(tl.float32)[None, :]
    s2 = _round(tl.load(sin_ptr + table + half, mask=d_mask, other=0.0), dt, RNE_BF16).to(tl.float32)[None, :]
    p1 = x_ptr + row * stride_x + offs_h[:, None] * head_dim + offs_d[None, :]
    p2 = p1 + half
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each product and the sum rounded as torch does
    o1 = _round(x1 * c1, dt, RNE_BF16).to(tl.float32) + _round(-x2 * s1, dt, RNE_BF16).to(tl.float32)
    o2 = _round(x2 * c2, dt, RNE_BF16).to(tl.float32) + _round(x1 * s2, dt, RNE_BF16).to(tl.float32)
    tl.store(p1, _round(o1, dt, RNE_BF16), mask=mask)
    tl.store(p2, _round(o2, dt, RNE_BF16), mask=mask)


@triton.jit
def _silu_mul_kernel(
    x_ptr, out_ptr,
    stride_x, stride_o,
    n,
    BLOCK_N: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < n
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    s = _round(g / (1.0 + tl.exp(-g)), dt, RNE_BF16).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, _round(s * u, dt, RNE_BF16), mask=mask)


def _rne(x: torch.Tensor) -> bool:
    return tu.INTERPRET and x.dtype == torch.bfloat16


def _check_rows(name: str, t: torch.Tensor, width: int | None = None) -> None:
    tu.check_tensor(name, t, 2, tu.FLOAT_DTYPES)
    tu.check_last_dim_contiguous(name, t)
    if width is not None and t.shape[1] != width:
        raise ValueError(f"{name} has rows of {t.shape[1]}, expected {width}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * x / sqrt(mean(x²) + eps)`` per row of ``x [T, n]``; with ``residual`` the row normalized is
    ``residual + x``, and ``residual`` is updated in place to it. Returns a new [T, n] tensor of x's dtype."""
    tu.check_tensor("weight", weight, 1, tu.FLOAT_DTYPES)
    n = weight.shape[0]
    _check_rows("x", x, n)
    if weight.dtype != x.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} but x has {x.dtype}")
    if n > 1 and weight.stride(0) != 1:
        raise ValueError("weight must be contiguous")
    if residual is not None:
        _check_rows("residual", residual, n)
        tu.check_shape("residual", residual, tuple(x.shape))
        if residual.dtype != x.dtype:
            raise TypeError(f"residual has dtype {residual.dtype} but x has {x.dtype}")
    tu.check_device(x=x, weight=weight, residual=residual)
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = tu.next_pow2(n)
        _rms_norm_kernel[(x.shape[0],)](
            x, residual if residual is not None else x, weight, out,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
            n, float(eps), BLOCK_N=block, HAS_RESIDUAL=residual is not None, RNE_BF16=_rne(x),
            num_warps=8 if block >= 4096 else 4 if block >= 1024 else 1)
    return out


def rotary_(x: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, rotary_dim: int | None = None) -> None:
    """Rotate-half RoPE, in place, on the first ``rotary_dim`` (default: all ``head_dim``) dims of each of the
    first ``num_heads`` heads of every row of ``x [T, >= num_heads * head_dim]``, row t at ``positions[t]``; the
    other dims of a head pass through (partial rotary); ``cos``/``sin``: [max_positions, rotary_dim] tables
    (float32)."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    _check_rows("x", x)
    if num_heads < 1 or head_dim < 2 or head_dim % 2 or x.shape[1] < num_heads * head_dim:
        raise ValueError(f"x {tuple(x.shape)} has no room for {num_heads} heads of an even head_dim {head_dim}")
    if not 2 <= rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and in [2, head_dim {head_dim}]")
    tu.check_tensor("positions", positions, 1, (torch.int64,))
    tu.check_shape("positions", positions, (x.shape[0],))
    if x.shape[0] > 1 and positions.stride(0) != 1:
        raise ValueError("positions must be contiguous")
    for name, table in (("cos", cos), ("sin", sin)):
        tu.check_tensor(name, table, 2, (torch.float32,))
        if table.shape[1] != rotary_dim or not table.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [max_positions, {rotary_dim}] table, "
                             f"got {tuple(table.shape)}")
    tu.check_shape("sin", sin, tuple(cos.shape))
    device = tu.check_device(x=x, positions=positions, cos=cos, sin=sin)
    if tu.value_checks_enabled(device) and positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos.shape[0]:
            raise ValueError(f"positions must be in [0, {cos.shape[0]}), got [{lo}, {hi}]")
    if x.shape[0]:
        block_h = tu.next_pow2(num_heads)
        _rotary_kernel[(x.shape[0],)](
            x, positions, cos, sin, x.stride(0), cos.stride(0), num_heads, head_dim, rotary_dim,
            BLOCK_H=block_h, BLOCK_HALF=tu.next_pow2(rotary_dim // 2), RNE_BF16=_rne(x),
            num_warps=4 if block_h * rotary_dim >= 2048 else 1)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up`` for ``x [T, 2n]`` holding gate then up in each row → a new ``[T, n]``."""
    _check_rows("x", x)
    if x.shape[1] % 2:
        raise ValueError(f"x must hold gate and up halves, got shape {tuple(x.shape)}")
    tu.check_device(x=x)
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] and n:
        block = min(1024, tu.next_pow2(n)) if not tu.INTERPRET else tu.next_pow2(n)  # interpreter: fewest programs
        _silu_mul_kernel[(x.shape[0], triton.cdiv(n, block))](
            x, out, x.stride(0), out.stride(0), n, BLOCK_N=block, RNE_BF16=_rne(x), num_warps=4 if block >= 512 else 1)
    return out
