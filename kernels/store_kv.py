"""store_kv: write new K/V rows into their slots of the paged cache.

The Triton kernel runs one program per token and copies all of its KV heads (a [kv_heads, head_dim] tile)
for K and V at once; a slot of -1 (padding, or a token whose KV is not kept) is skipped. The caches are the
engine's strided per-layer views, so the kernel addresses them through their strides; values are cast to the
cache dtype on store, as the reference does.

A quantized cache (int8 / fp8 values and one fp32 scale per token and KV head, kernels/kv_quant.py): the kernel
quantizes each (token, head) row as ``kv_quant.quantize_ref`` does and writes the same bytes. The reference's
arithmetic is all correctly rounded fp32, so the kernel's is too: amax / qmax and x / scale with ``div_rn`` (a plain
``/`` compiles to the approximate ``div.full.f32`` for sm_90: tests/kernels/sm90_compile.py counts them), the clamp
to +-qmax, then the rounding onto the stored grid in fp32 (``_round_to_grid``), so that the final cast only converts
a value the grid holds (exact). Why not let the cast round: Triton 3.9's interpreter rounds fp32 -> fp8 wrongly
(7.97 -> 4.0 in e4m3, the carry lost: tests/kernels/test_triton_kv_quant.py
``test_the_interpreters_own_fp8_cast_is_why_the_store_rounds_first``), so the interpreter tests would not check
what a GPU runs; with the rounding done first, both run the same fp32 operations. In the sm_90 PTX the grid
rounding stays two ``add.f32`` (not folded), and the casts are ``cvt.rzi.s16.f32`` / ``cvt.rn.satfinite.e4m3x2.f32``
of values on the grid (read from the PTX of the compile check's store cases, 2026-11-28).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _triton_utils as tu
from kernels.kv_quant import QMAX, quantize_ref

# the stored value grids: (mantissa bits, exponent of the smallest normal) of each fp8, int8 as (0, 0)
_GRID = {torch.int8: (0, 0), torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


def store_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided view)
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided view)
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset; -1 = skip
    *,
    key_scales: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32: a quantized cache
    value_scales: torch.Tensor | None = None,
) -> None:
    """With scales (a quantized cache, kernels/kv_quant.py): each row quantized with its own scale per KV head."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    if key_scales is None:
        key_cache[blocks, offsets] = key[keep].to(key_cache.dtype)
        value_cache[blocks, offsets] = value[keep].to(value_cache.dtype)
        return
    for x, cache, scales in ((key, key_cache, key_scales), (value, value_cache, value_scales)):
        q, s = quantize_ref(x[keep], cache.dtype)
        cache[blocks, offsets] = q
        scales[blocks, offsets] = s


@triton.jit
def _round_to_grid(q, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """fp32 ``q`` (|q| <= qmax) rounded half to even onto the stored grid, still in fp32: the integers (int8:
    MANTISSA 0), or the fp8 values with MANTISSA bits whose smallest normal is 2^MIN_EXP (the spacing near |q| is
    2^k, k = max(exponent(q), MIN_EXP) - MANTISSA). Adding then subtracting 1.5 * 2^(k + 23) rounds to a multiple
    of 2^k in one correctly rounded fp32 add (ties to the even multiple), exact while |q| < 2^(k + 22)."""
    if MANTISSA == 0:
        return (q + 12582912.0) - 12582912.0  # 1.5 * 2^23: |q| <= 127 lands in [2^23, 2^24), spacing 1
    bits = q.to(tl.int32, bitcast=True)
    k = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP) - MANTISSA
    magic = (((k + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (tl.abs(q) + magic) - magic
    return tl.where(bits < 0, -r, r)  # the sign bit put back (-0.0 stays -0.0, as torch's cast keeps it)


@triton.jit
def _store_quantized(x, cache_ptrs, scale_ptrs, mask, h_mask, QMAX: tl.constexpr, MANTISSA: tl.constexpr,
                     MIN_EXP: tl.constexpr):
    """One token's rows ``x`` [BLOCK_H, BLOCK_D] (fp32, padding lanes 0) quantized into ``cache_ptrs``, one scale
    per head into ``scale_ptrs`` [BLOCK_H]: ``quantize_ref``'s arithmetic, each step correctly rounded."""
    scale = tl.math.div_rn(tl.max(tl.abs(x), 1), QMAX)
    safe = tl.where(scale > 0, scale, 1.0)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, safe[:, None]), -QMAX), QMAX)
    tl.store(cache_ptrs, _round_to_grid(q, MANTISSA, MIN_EXP).to(cache_ptrs.dtype.element_ty), mask=mask)
    tl.store(scale_ptrs, scale, mask=h_mask)


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    key_scales_ptr,  # [num_blocks, block_size, num_kv_heads] fp32 (written only when QUANT)
    value_scales_ptr,  # [num_blocks, block_size, num_kv_heads] fp32, key_scales' strides
    slot_mapping_ptr,  # [num_tokens]
    stride_kt, stride_kh,  # key
    stride_vt, stride_vh,  # value
    stride_kcb, stride_kcs, stride_kch,  # key_cache
    stride_vcb, stride_vcs, stride_vch,  # value_cache
    stride_sb, stride_ss,  # key_scales / value_scales (the head stride is 1)
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXP: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < num_kv_heads
    mask = h_mask[:, None] & (offs_d[None, :] < head_dim)
    tok = token.to(tl.int64)

    k = tl.load(key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    kc = key_cache_ptr + block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    v = tl.load(value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    vc = value_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    if QUANT:
        row = block * stride_sb + offset * stride_ss + offs_h
        _store_quantized(k.to(tl.float32), kc, key_scales_ptr + row, mask, h_mask, QMAX, MANTISSA, MIN_EXP)
        _store_quantized(v.to(tl.float32), vc, value_scales_ptr + row, mask, h_mask, QMAX, MANTISSA, MIN_EXP)
    else:
        tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided view)
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided view)
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (or int32), block_id * block_size + offset; -1 = skip
    *,
    key_scales: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32: a quantized cache
    value_scales: torch.Tensor | None = None,
) -> None:
    """In place: ``key_cache[slot // B, slot % B] = key`` (same for value) for every slot >= 0; into a quantized
    cache, each row quantized with its own scale per KV head (``store_kv_ref``'s bytes)."""
    tu.check_tensor("key", key, 3, tu.FLOAT_DTYPES)
    tu.check_tensor("value", value, 3, tu.FLOAT_DTYPES)
    quantized = tu.check_kv_cache(key_cache, value_cache, key_scales, value_scales)
    tu.check_tensor("slot_mapping", slot_mapping, 1, tu.INDEX_DTYPES)
    device = tu.check_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                             slot_mapping=slot_mapping, key_scales=key_scales, value_scales=value_scales)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_tokens = key.shape[0]
    tu.check_shape("key", key, (num_tokens, num_kv_heads, head_dim))
    tu.check_shape("value", value, (num_tokens, num_kv_heads, head_dim))
    tu.check_shape("slot_mapping", slot_mapping, (num_tokens,))
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        tu.check_last_dim_contiguous(name, t)
    if slot_mapping.stride(0) != 1 and num_tokens > 1:
        raise ValueError(f"slot_mapping must be contiguous, got stride {slot_mapping.stride()}")
    if tu.value_checks_enabled(device) and num_tokens:
        slots = slot_mapping.to("cpu", torch.int64)
        bad = (slots < -1) | (slots >= num_blocks * block_size)
        if bool(bad.any()):
            raise ValueError(f"slot_mapping holds slots outside [-1, {num_blocks * block_size}): "
                             f"{slots[bad][:8].tolist()}")
    if num_tokens == 0:
        return
    ks, vs, stride_sb, stride_ss = tu.kv_scale_args(key_cache, key_scales, value_scales)
    mantissa, min_exp = _GRID.get(key_cache.dtype, (0, 0))
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, ks, vs, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        stride_sb, stride_ss,
        num_kv_heads, head_dim, block_size,
        BLOCK_H=tu.next_pow2(num_kv_heads),
        BLOCK_D=tu.next_pow2(head_dim),
        QUANT=quantized,
        QMAX=QMAX.get(key_cache.dtype, 0.0),
        MANTISSA=mantissa,
        MIN_EXP=min_exp,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
