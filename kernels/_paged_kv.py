"""The inner step both attention kernels share: one TILE_N-token tile of paged K/V, online softmax.

Inlined by Triton into ``_decode_partition_kernel`` and ``_prefill_attention_kernel``. A tile may span
several cache blocks: each position's block id is gathered from the block table row ``table``. Scores are
in the log2 domain (``qk_scale`` includes log2(e)); a row with nothing visible so far keeps m = -inf and
the update subtracts 0 instead, so exp2 yields 0 rather than NaN (prefill's sliding window needs this).

Soft-capping (Gemma 2: cap * tanh(score / cap), before the mask) commutes with the log2 scaling when the cap
is scaled too: the launchers pass ``softcap`` already multiplied by log2(e). tanh is built from exp2 of a
non-positive argument (no overflow; the interpreter has no tanh).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    """tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1], the sign put back."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def attend_kv_tile(
    q,  # [ROWS, BLOCK_D] query rows (padding rows are zeros)
    acc,  # [ROWS, BLOCK_D] fp32 unnormalized output
    m_i,  # [ROWS] fp32 running max (log2 domain)
    l_i,  # [ROWS] fp32 running softmax denominator
    k_base,  # key_cache_ptr + kv_head * stride_kh: [num_blocks, block_size, head_dim] via strides
    v_base,  # value_cache_ptr + kv_head * stride_vh
    table,  # block_tables_ptr + seq * stride_bts: [max_blocks_per_seq] int32
    pos,  # [TILE_N] absolute token positions of this tile
    load_mask,  # [TILE_N] positions to read (inside the sequence)
    allowed,  # [ROWS, TILE_N] or [1, TILE_N]: positions each row may attend to
    offs_d,
    d_mask,
    block_size,
    stride_kb, stride_kt,
    stride_vb, stride_vt,
    qk_scale,
    softcap,  # cap * log2(e), read only when SOFTCAP
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    blocks = tl.load(table + pos // block_size, mask=load_mask, other=0).to(tl.int64)
    offsets = pos % block_size
    k = tl.load(k_base + (blocks * stride_kb + offsets * stride_kt)[None, :] + offs_d[:, None],
                mask=d_mask[:, None] & load_mask[None, :], other=0.0)  # [BLOCK_D, TILE_N]
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [ROWS, TILE_N]
    if SOFTCAP:
        s = softcap * _tanh(s / softcap)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + (blocks * stride_vb + offsets * stride_vt)[:, None] + offs_d[None, :],
                mask=load_mask[:, None] & d_mask[None, :], other=0.0)  # [TILE_N, BLOCK_D]
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
