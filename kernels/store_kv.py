"""store_kv: write new K/V rows into their slots of the paged cache.

The Triton kernel runs one program per token and copies all of its KV heads (a [kv_heads, head_dim] tile)
for K and V at once; a slot of -1 (padding, or a token whose KV is not kept) is skipped. The caches are the
engine's strided per-layer views, so the kernel addresses them through their strides; values are cast to the
cache dtype on store, as the reference does. The reference also stores into a quantized cache (values and their
per-token, per-head scales: kernels/kv_quant.py); the Triton kernel does not yet (the engine refuses the pairing).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _triton_utils as tu
from kernels.kv_quant import quantize_ref


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
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens]
    stride_kt, stride_kh,  # key
    stride_vt, stride_vh,  # value
    stride_kcb, stride_kcs, stride_kch,  # key_cache
    stride_vcb, stride_vcs, stride_vch,  # value_cache
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    tok = token.to(tl.int64)

    k = tl.load(key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    kc = key_cache_ptr + block * stride_kcb + offset * stride_kcs
    tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :], k.to(key_cache_ptr.dtype.element_ty), mask=mask)

    v = tl.load(value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    vc = value_cache_ptr + block * stride_vcb + offset * stride_vcs
    tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :], v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided view)
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided view)
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (or int32), block_id * block_size + offset; -1 = skip
) -> None:
    """In place: ``key_cache[slot // B, slot % B] = key`` (same for value) for every slot >= 0."""
    tu.check_tensor("key", key, 3, tu.FLOAT_DTYPES)
    tu.check_tensor("value", value, 3, tu.FLOAT_DTYPES)
    tu.check_tensor("key_cache", key_cache, 4, tu.FLOAT_DTYPES)
    tu.check_tensor("value_cache", value_cache, 4, tu.FLOAT_DTYPES)
    tu.check_tensor("slot_mapping", slot_mapping, 1, tu.INDEX_DTYPES)
    device = tu.check_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                             slot_mapping=slot_mapping)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_tokens = key.shape[0]
    tu.check_shape("value_cache", value_cache, key_cache.shape)
    tu.check_shape("key", key, (num_tokens, num_kv_heads, head_dim))
    tu.check_shape("value", value, (num_tokens, num_kv_heads, head_dim))
    tu.check_shape("slot_mapping", slot_mapping, (num_tokens,))
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache dtype {value_cache.dtype} differs from key_cache dtype {key_cache.dtype}")
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
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        num_kv_heads, head_dim, block_size,
        BLOCK_H=tu.next_pow2(num_kv_heads),
        BLOCK_D=tu.next_pow2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
