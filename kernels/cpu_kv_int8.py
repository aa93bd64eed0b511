"""The CPU path's kernels for a 1-byte KV cache — int8, fp8 e4m3, fp8 e5m2 — (kernels/cpu/attention_kv8.c), with the
signatures of the torch references (``key_scales`` / ``value_scales`` keyword arguments: kernels/kv_quant.py's
layout); the cache's dtype picks the C instantiation (``_SUFFIX``).

The store quantizes each new row (per token and KV head, amax / 127, round half to even: the same bytes as
``kv_quant.quantize_ref``); decode and prefill attention run the fp32 kernels' task loops on rows dequantized
as they are read (int8 × scale in fp32), with fp32 scores, softmax and accumulation; prefill's fresh K/V
(kernels/prefill_attention.py) are read from their rows as computed. Head sizes that are not a
multiple of 8 have no C path here: they run the torch references (dequantize, then SDPA), logged once.
"""
from __future__ import annotations

import logging

import torch

from kernels._triton_utils import check_fresh_kv
from kernels.cpu_build import NativeKernelError, load
from kernels.cpu_native import _check, _check_cache_args, _check_store_args
from kernels.decode_attention import paged_decode_attention_ref
from kernels.prefill_attention import prefill_attention_ref

log = logging.getLogger(__name__)
_warned: set[int] = set()
# the cache's dtype -> the suffix of its C kernels (kernels/cpu/attention_kv8.c)
_SUFFIX = {torch.int8: "i8", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
DTYPES = tuple(_SUFFIX)


def _suffix(cache: torch.Tensor) -> str:
    if cache.dtype not in _SUFFIX:
        raise ValueError(f"a 1-byte KV cache must be one of {', '.join(map(str, _SUFFIX))}, got {cache.dtype}")
    return _SUFFIX[cache.dtype]


def _check_scales(key_cache, key_scales, value_scales) -> None:
    for name, t in (("key_scales", key_scales), ("value_scales", value_scales)):
        _check(name, t, 3, torch.float32)
        if t.shape != key_cache.shape[:3]:
            raise ValueError(f"{name} {tuple(t.shape)} must be [blocks, block_size, kv_heads] of the cache "
                             f"{tuple(key_cache.shape)}")


def _check_int8_cache(q, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens) -> None:
    _check_cache_args(q, key_cache, value_cache, block_tables, seq_lens, key_cache.dtype if key_cache.dtype in
                      _SUFFIX else torch.int8)
    _check_scales(key_cache, key_scales, value_scales)


def _cache_args(values: torch.Tensor, scales: torch.Tensor) -> tuple:
    """A layer's values and scales as the C kernels take them (pointers, strides in elements)."""
    return (values.data_ptr(), values.stride(0), values.stride(1), values.stride(2),
            scales.data_ptr(), scales.stride(0), scales.stride(1))


def _reference(head_dim: int) -> None:
    if head_dim not in _warned:
        _warned.add(head_dim)
        log.warning("int8 KV cache, head_dim %d (not a multiple of 8): attention runs the torch references "
                    "(dequantize, then SDPA)", head_dim)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim] fp32
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] int8 (strided view)
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    *,
    key_scales: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] fp32 (strided view)
    value_scales: torch.Tensor,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    _check_int8_cache(q, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens)
    if block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences, block_tables {block_tables.shape[0]}")
    num_seqs, num_q_heads, head_dim = q.shape
    if head_dim % 8:
        _reference(head_dim)
        return paged_decode_attention_ref(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
                                          key_scales=key_scales, value_scales=value_scales)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    fn = getattr(load(), f"duet_decode_attention_{_suffix(key_cache)}")
    rc = fn(
        q.data_ptr(), q.stride(0), q.stride(1), *_cache_args(key_cache, key_scales),
        *_cache_args(value_cache, value_scales), block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1), num_seqs, num_q_heads, key_cache.shape[2],
        head_dim, key_cache.shape[1], scale, sliding_window or 0, torch.get_num_threads())
    if rc != 0:
        raise NativeKernelError(f"{fn.__name__} failed (code {rc})")
    return out


def prefill_attention(
    q: torch.Tensor,  # [num_q_tokens, num_q_heads, head_dim] fp32
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] int8 (strided view)
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, K/V length incl. the new tokens
    scale: float,
    sliding_window: int | None = None,
    *,
    key_scales: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] fp32 (strided view)
    value_scales: torch.Tensor,
    fresh_key: torch.Tensor | None = None,  # [num_q_tokens, num_kv_heads, head_dim] fp32: the new tokens' K
    fresh_value: torch.Tensor | None = None,
    fresh_seqs: torch.Tensor | None = None,  # [num_seqs] int32: 1 = this sequence reads fresh_key / fresh_value
) -> torch.Tensor:  # [num_q_tokens, num_q_heads, head_dim]
    """Each sequence's new tokens against its whole cached context (prefix included), causal; with fresh K/V
    (``prefill_attention_ref``'s contract) a marked sequence's new tokens' K/V come from ``fresh_key`` /
    ``fresh_value`` as computed (the C rows function points at them instead of dequantizing)."""
    _check_int8_cache(q, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens)
    fresh = check_fresh_kv(q, key_cache, seq_lens.shape[0], fresh_key, fresh_value, fresh_seqs)
    for name, t in (("fresh_key", fresh_key), ("fresh_value", fresh_value), ("fresh_seqs", fresh_seqs)):
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}: the C kernels take CPU tensors")
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    if len(cu) != len(lens) + 1 or cu[0] != 0 or cu[-1] != q.shape[0] or any(
            not 0 <= cu[s + 1] - cu[s] <= n for s, n in enumerate(lens)):
        raise ValueError(f"cu_seqlens_q {cu} does not split {q.shape[0]} query tokens into sequences of at most "
                         f"{lens} tokens")
    num_tokens, num_q_heads, head_dim = q.shape
    if head_dim % 8:
        _reference(head_dim)
        return prefill_attention_ref(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                     sliding_window, key_scales=key_scales, value_scales=value_scales,
                                     fresh_key=fresh_key, fresh_value=fresh_value, fresh_seqs=fresh_seqs)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    cu_t = cu_seqlens_q.to(torch.int32).contiguous()
    if fresh:
        marks = (torch.ones(len(lens), dtype=torch.int32) if fresh_seqs is None else fresh_seqs).contiguous()
        rows = (fresh_key.data_ptr(), fresh_key.stride(0), fresh_key.stride(1), fresh_value.data_ptr(),
                fresh_value.stride(0), fresh_value.stride(1), marks.data_ptr())
    else:
        rows = (None, 0, 0, None, 0, 0, None)
    fn = getattr(load(), f"duet_prefill_attention_{_suffix(key_cache)}")
    rc = fn(
        q.data_ptr(), q.stride(0), q.stride(1), *_cache_args(key_cache, key_scales),
        *_cache_args(value_cache, value_scales), *rows, block_tables.data_ptr(), block_tables.stride(0), cu_t.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1), len(lens), num_q_heads,
        key_cache.shape[2], head_dim, key_cache.shape[1], scale, sliding_window or 0, torch.get_num_threads())
    if rc != 0:
        raise NativeKernelError(f"{fn.__name__} failed (code {rc})")
    return out


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] fp32, each token's heads contiguous
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] int8 (strided view)
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset; -1 = skip
    *,
    key_scales: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] fp32 (strided view)
    value_scales: torch.Tensor,
) -> None:
    """The new tokens' K/V quantized into their cache slots (``store_kv_ref``'s contract with scales)."""
    n = _check_store_args(key, value, key_cache, value_cache, slot_mapping,
                          key_cache.dtype if key_cache.dtype in _SUFFIX else torch.int8)
    _check_scales(key_cache, key_scales, value_scales)
    getattr(load(), f"duet_store_kv_{_suffix(key_cache)}")(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                            *_cache_args(key_cache, key_scales), *_cache_args(value_cache, value_scales),
                            slot_mapping.data_ptr(), n, key_cache.shape[1], key_cache.shape[2], key_cache.shape[3])
