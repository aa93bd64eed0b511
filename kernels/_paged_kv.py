"""The two attention kernels' steps over one tile of paged K/V (online softmax), and what they share.

``attend_kv_tile`` is decode's step (inlined into ``_decode_partition_kernel``), ``attend_prefill_tile`` prefill's
(``_prefill_attention_kernel``, FlashAttention-2's forward). A tile may span several cache blocks: each position's
block id is gathered from the block table row ``table`` (prefill reads one block id per tile when the tile lies in
one block). Scores are in the log2 domain (``qk_scale`` includes log2(e)); a row with nothing visible so far keeps
m = -inf and the update subtracts 0 instead, so exp2 yields 0 rather than NaN (the sliding window needs this).

Soft-capping (Gemma 2: cap * tanh(score / cap), before the mask) commutes with the log2 scaling when the cap
is scaled too: the launchers pass ``softcap`` already multiplied by log2(e). tanh is built from exp2 of a
non-positive argument (no overflow; the interpreter has no tanh).

A quantized cache (``KV_QUANT``; kernels/kv_quant.py): K and V hold int8 / fp8 values and ``ks_base`` / ``vs_base``
point at one fp32 scale per (token, KV head), at ``block * stride_sb + offset * stride_st`` (K's and V's scales share
their strides: they are views of one cache tensor). A tile's values are converted to q's dtype, exactly (int8 and
both fp8s are representable in fp16, bf16 and fp32), and go through the same dots as a dense cache's; a key's scale
multiplies its column of fp32 scores, a value's scale its column of fp32 probabilities before the P·V dot. Scores,
softmax and the accumulator stay fp32; nothing is dequantized into memory.

Fresh K/V (prefill's ``FRESH``, kernels/prefill_attention.py): a tile's positions from the sequence's first new one
on are loaded from the new tokens' K/V rows instead of the cache, in q's dtype, with scale 1 where a quantized cache
has its scales: the same dots, and the products by 1 are exact.
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
    ks_base,  # key_scales_ptr + kv_head * stride_sh: [num_blocks, block_size] fp32 (read only when KV_QUANT)
    vs_base,  # value_scales_ptr + kv_head * stride_sh
    table,  # block_tables_ptr + seq * stride_bts: [max_blocks_per_seq] int32
    pos,  # [TILE_N] absolute token positions of this tile
    load_mask,  # [TILE_N] positions to read (inside the sequence)
    allowed,  # [ROWS, TILE_N] or [1, TILE_N]: positions each row may attend to
    offs_d,
    d_mask,
    block_size,
    stride_kb, stride_kt,
    stride_vb, stride_vt,
    stride_sb, stride_st,
    qk_scale,
    softcap,  # cap * log2(e), read only when SOFTCAP
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    blocks = tl.load(table + pos // block_size, mask=load_mask, other=0).to(tl.int64)
    offsets = pos % block_size
    k = tl.load(k_base + (blocks * stride_kb + offsets * stride_kt)[None, :] + offs_d[:, None],
                mask=d_mask[:, None] & load_mask[None, :], other=0.0)  # [BLOCK_D, TILE_N]
    if UPCAST or KV_QUANT:
        k = k.to(q.dtype)
    s = tl.dot(q, k, input_precision=DOT_PRECISION)  # [ROWS, TILE_N]
    if KV_QUANT:
        scale_rows = blocks * stride_sb + offsets * stride_st
        s = s * (tl.load(ks_base + scale_rows, mask=load_mask, other=0.0) * qk_scale)[None, :]
    else:
        s = s * qk_scale
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
    if UPCAST or KV_QUANT:
        v = v.to(q.dtype)
    if KV_QUANT:
        p = p * tl.load(vs_base + scale_rows, mask=load_mask, other=0.0)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _load_rows(ptrs, new_ptrs, d_mask, is_new, in_cache, dtype, ROWS_AXIS: tl.constexpr):
    """A tile of K (positions on axis 1) or V (positions on axis 0) in ``dtype``: from the cache (``ptrs``) where
    ``in_cache``, from the new rows (``new_ptrs``) where ``is_new``, zeros elsewhere (past the sequence end the cache
    may hold NaN, and 0 * NaN is NaN) and in the head_dim padding (``d_mask`` false)."""
    if ROWS_AXIS == 1:
        cache_mask = in_cache[None, :] & d_mask
        new_mask = is_new[None, :] & d_mask
    else:
        cache_mask = in_cache[:, None] & d_mask
        new_mask = is_new[:, None] & d_mask
    x = tl.load(ptrs, mask=cache_mask, other=0.0).to(dtype)
    return tl.where(new_mask, tl.load(new_ptrs, mask=new_mask, other=0.0).to(dtype), x)


@triton.jit
def attend_prefill_tile(
    acc, m_i, l_i,  # [BLOCK_M, BLOCK_D] fp32 unnormalized output, [BLOCK_M] running max (log2), denominator
    q,  # [BLOCK_M, BLOCK_D]
    k_base,  # key_cache_ptr + kv_head * stride_kh
    v_base,  # value_cache_ptr + kv_head * stride_vh
    ks_base,  # key_scales_ptr + kv_head * stride_sh (read only when KV_QUANT)
    vs_base,  # value_scales_ptr + kv_head * stride_sh
    nk_base,  # fresh_key_ptr + kv_head * stride_nkh: the new rows, position p at row p + new_shift (FRESH only)
    nv_base,  # fresh_value_ptr + kv_head * stride_nvh
    table,  # block_tables_ptr + seq * stride_bts: [max_blocks_per_seq] int32
    start,  # first position of the tile, a multiple of BLOCK_N
    q_pos,  # [BLOCK_M] absolute position of each row (read only when MASKED)
    seq_len, window,
    new_start,  # the first position read from the new rows (seq_len: none; read only when FRESH)
    new_shift,  # row of position p in the new rows: p + new_shift
    stride_kb, stride_kt, stride_vb, stride_vt, stride_sb, stride_st, stride_nkt, stride_nvt,
    qk_scale, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr, FRESH: tl.constexpr,
):
    """One K/V tile of the online softmax. Unmasked (MASKED false) only for tiles inside the sequence that every
    row sees whole: then there are no bounds, no mask and the scale rides in the max-subtracting FMA. FRESH: the
    positions from ``new_start`` on come from the new rows, unquantized, with scale 1 (kernels/prefill_attention.py,
    fresh K/V); the cache is not read there."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    pos = start + offs_n
    if BLOCK_SIZE % BLOCK_N == 0:  # the tile lies in one block: one table read, a contiguous slice
        block = tl.load(table + start // BLOCK_SIZE).to(tl.int64)
        k_tile = k_base + block * stride_kb + (start % BLOCK_SIZE) * stride_kt
        v_tile = v_base + block * stride_vb + (start % BLOCK_SIZE) * stride_vt
        k_ptrs = k_tile + offs_n[None, :] * stride_kt + offs_d[:, None]
        v_ptrs = v_tile + offs_n[:, None] * stride_vt + offs_d[None, :]
        scale_rows = block * stride_sb + (start % BLOCK_SIZE + offs_n) * stride_st
    else:  # the tile spans blocks: each token's block id
        if MASKED:
            blocks = tl.load(table + pos // BLOCK_SIZE, mask=pos < seq_len, other=0).to(tl.int64)
        else:
            blocks = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
        k_ptrs = k_base + (blocks * stride_kb + (pos % BLOCK_SIZE) * stride_kt)[None, :] + offs_d[:, None]
        v_ptrs = v_base + (blocks * stride_vb + (pos % BLOCK_SIZE) * stride_vt)[:, None] + offs_d[None, :]
        scale_rows = blocks * stride_sb + (pos % BLOCK_SIZE) * stride_st
    if MASKED:
        in_seq = pos < seq_len
    if FRESH:  # [BLOCK_N] positions from the new rows / from the cache
        is_new = pos >= new_start
        in_cache = pos < new_start
        if MASKED:
            is_new = is_new & in_seq
            in_cache = in_cache & in_seq
        new_rows = (pos + new_shift).to(tl.int64)
        k = _load_rows(k_ptrs, nk_base + new_rows[None, :] * stride_nkt + offs_d[:, None], offs_d[:, None] < HEAD_DIM,
                       is_new, in_cache, q.dtype, 1)
    else:
        if MASKED:  # zero rows past the sequence end: the cache there may hold NaN, and 0 * NaN is NaN
            k = tl.load(k_ptrs, mask=(offs_d[:, None] < HEAD_DIM) & in_seq[None, :], other=0.0)
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
        else:
            k = tl.load(k_ptrs)
        if UPCAST or KV_QUANT:
            k = k.to(q.dtype)
    qk = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    if KV_QUANT:
        if FRESH:
            qk = qk * tl.where(is_new, 1.0, tl.load(ks_base + scale_rows, mask=in_cache, other=0.0))[None, :]
        elif MASKED:
            qk = qk * tl.load(ks_base + scale_rows, mask=in_seq, other=0.0)[None, :]
        else:
            qk = qk * tl.load(ks_base + scale_rows)[None, :]
    if SOFTCAP:  # Gemma 2: cap * tanh(s / cap) in log2 units (softcap is cap * log2(e))
        qk = softcap * _tanh(qk * (qk_scale / softcap))
        score_scale = 1.0
    else:
        score_scale = qk_scale
    if MASKED:
        allowed = (pos[None, :] <= q_pos[:, None]) & in_seq[None, :]
        if USE_WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, qk * score_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * score_scale)
        p = tl.math.exp2(qk * score_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if FRESH:
        v = _load_rows(v_ptrs, nv_base + new_rows[:, None] * stride_nvt + offs_d[None, :], offs_d[None, :] < HEAD_DIM,
                       is_new, in_cache, q.dtype, 0)
    else:
        if MASKED:
            v = tl.load(v_ptrs, mask=in_seq[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        elif BLOCK_D != HEAD_DIM:
            v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            v = tl.load(v_ptrs)
        if UPCAST or KV_QUANT:
            v = v.to(q.dtype)
    if KV_QUANT:
        if FRESH:
            p = p * tl.where(is_new, 1.0, tl.load(vs_base + scale_rows, mask=in_cache, other=0.0))[None, :]
        elif MASKED:
            p = p * tl.load(vs_base + scale_rows, mask=in_seq, other=0.0)[None, :]
        else:
            p = p * tl.load(vs_base + scale_rows)[None, :]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
