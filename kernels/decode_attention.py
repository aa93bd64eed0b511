"""paged_decode_attention: one query token per sequence against its paged K/V (flash-decoding on GPU).

Sequence s has ``seq_lens[s]`` tokens in the cache (including the token being decoded, already stored);
its query sits at position ``seq_lens[s] - 1`` and attends to every cached position, or with a sliding
window W to the last W positions.

Triton path (split-KV flash-decoding). Decode is bound by reading K/V, so the design goal is to read every
K/V byte once with enough programs in flight to saturate HBM:
- grid ``(num_seqs, num_kv_heads, num_partitions)``: each program owns one KV head of one sequence and one
  partition (``partition_size`` consecutive positions) of its context, and computes all ``group`` query heads
  that share that KV head at once (GQA/MQA): a [group→16, head_dim] x [head_dim, TILE_N] ``tl.dot`` per tile,
  so each K/V tile is loaded once per group, not once per query head. Rows past ``group`` are padding.
- within a partition it walks TILE_N-token tiles; a tile may span several cache blocks (any block size), each
  token's block id is gathered from the block table. Online softmax in fp32 (exp2 with log2(e) folded into
  the scale); head_dim is padded to a power of two and masked.
- each partition writes its unnormalized output, running max and sum; ``_decode_reduce_kernel`` rescales
  and combines the partitions of a (sequence, query head). With one partition the first kernel normalizes
  and writes the output itself (no reduce launch).
- the number of partitions is sized from the block table's width (no device sync for ``max(seq_lens)``);
  programs whose partition lies past ``seq_lens[s]`` or before the sliding window return at once.
- a quantized cache (int8 / fp8 values, ``key_scales`` / ``value_scales`` fp32 per token and KV head,
  kernels/kv_quant.py): the same grid reads 1-byte values and a scale per token; the tile step converts the values
  and applies the scales to the fp32 scores and probabilities (kernels/_paged_kv.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _triton_utils as tu
from kernels._paged_kv import attend_kv_tile
from kernels.kv_quant import dequantize_ref
from kernels.prefill_attention import softcapped_attention

_REF_BUCKET = 8  # sequences per padded gather in the reference (sorted by length: little padding)


def paged_decode_attention_ref(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    key_scales: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32: a quantized cache
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim], dtype of q
    """The engine's CPU path too, so it is built for speed with plain torch ops.

    Sequences are sorted by length and gathered in small buckets (padding only to the bucket's longest);
    each bucket is one SDPA call in which a KV head's query heads form the query-length dimension
    (exact for decode: they all sit at the same position), so GQA needs no K/V repeat. A quantized cache's rows
    are dequantized to fp32 as they are gathered (kernels/kv_quant.py).
    """
    num_seqs, num_q_heads, head_dim = q.shape
    scales = (key_scales, value_scales)
    if num_seqs <= _REF_BUCKET:
        return _decode_bucket(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap,
                              scales)
    out = torch.empty_like(q)
    order = torch.argsort(seq_lens)
    for i in range(0, num_seqs, _REF_BUCKET):
        idx = order[i: i + _REF_BUCKET]
        out[idx] = _decode_bucket(q[idx], key_cache, value_cache, block_tables[idx], seq_lens[idx], scale,
                                  sliding_window, softcap, scales)
    return out


def _gather_blocks(cache: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """Whole blocks ``ids`` of one layer's K or V (index_select copies whole blocks and is several times faster
    than advanced indexing on CPU), dequantized to fp32 when ``scales`` are given."""
    rows = cache.index_select(0, ids)
    return rows if scales is None else dequantize_ref(rows, scales.index_select(0, ids))


def _decode_bucket(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap=None,
                   scales=(None, None)):
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    num_blocks = (int(seq_lens.max()) + block_size - 1) // block_size
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    # [num_seqs, num_kv_heads, num_blocks * block_size, head_dim] (strided views of the gathered rows)
    k = _gather_blocks(key_cache, scales[0], ids).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2).float()
    v = _gather_blocks(value_cache, scales[1], ids).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2).float()
    pos = torch.arange(k.shape[2], device=q.device).unsqueeze(0)
    lens = seq_lens.long().unsqueeze(1)
    allowed = pos < lens
    if sliding_window is not None:
        allowed &= pos > lens - 1 - sliding_window
    qf = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    if softcap is not None:
        out = softcapped_attention(qf, k, v, allowed[:, None, None, :], scale, softcap)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(qf, k, v, attn_mask=allowed[:, None, None, :],
                                                               scale=scale)
    return out.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)


_LOG2E = 1.4426950408889634


@triton.jit
def _decode_partition_kernel(
    q_ptr,  # [num_seqs, num_q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    key_scales_ptr,  # [num_blocks, block_size, num_kv_heads] fp32 (read only when KV_QUANT)
    value_scales_ptr,  # [num_blocks, block_size, num_kv_heads] fp32, key_scales' strides
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_q_heads, head_dim], written only when SINGLE_PARTITION
    part_out_ptr,  # [num_seqs, num_q_heads, num_partitions, BLOCK_D] fp32, unnormalized partial outputs
    part_max_ptr,  # [num_seqs, num_q_heads, num_partitions] fp32, running max (log2 domain)
    part_sum_ptr,  # [num_seqs, num_q_heads, num_partitions] fp32, softmax denominators
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st,  # key_scales / value_scales (the head stride is 1)
    stride_bts,
    stride_os, stride_oh,
    qk_scale,  # softmax scale * log2(e)
    head_dim,
    block_size,
    window,  # sliding window in tokens (read only when USE_WINDOW)
    softcap,  # Gemma 2's attention cap * log2(e) (read only when SOFTCAP)
    num_partitions,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SINGLE_PARTITION: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    win_start = 0
    if USE_WINDOW:
        win_start = tl.maximum(seq_len - window, 0)
    part_start = part * PARTITION_SIZE
    part_end = tl.minimum(part_start + PARTITION_SIZE, seq_len)
    if part_start >= seq_len or part_end <= win_start:
        return
    lo = tl.maximum(part_start, (win_start // TILE_N) * TILE_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < head_dim
    seq64 = seq.to(tl.int64)
    q = tl.load(q_ptr + seq64 * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = key_cache_ptr + kv_head * stride_kh
    v_base = value_cache_ptr + kv_head * stride_vh
    table = block_tables_ptr + seq64 * stride_bts

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, part_end, TILE_N):
        pos = start + offs_n
        valid = (pos < part_end) & (pos >= win_start)  # the same for every query head of the group
        acc, m_i, l_i = attend_kv_tile(q, acc, m_i, l_i, k_base, v_base, key_scales_ptr + kv_head,
                                       value_scales_ptr + kv_head, table, pos, valid, valid[None, :], offs_d, d_mask,
                                       block_size, stride_kb, stride_kt, stride_vb, stride_vt, stride_sb, stride_st,
                                       qk_scale, softcap, UPCAST, DOT_PRECISION, SOFTCAP, KV_QUANT)

    if SINGLE_PARTITION:
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq64 * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        row = (seq64 * (GROUP * tl.num_programs(1)) + heads) * num_partitions + part  # [BLOCK_G]
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_max_ptr + row, m_i, mask=g_mask)
        tl.store(part_sum_ptr + row, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [num_seqs, num_q_heads, head_dim]
    part_out_ptr,  # [num_seqs, num_q_heads, num_partitions, BLOCK_D] fp32
    part_max_ptr,  # [num_seqs, num_q_heads, num_partitions] fp32
    part_sum_ptr,  # [num_seqs, num_q_heads, num_partitions] fp32
    seq_lens_ptr,  # [num_seqs] int32
    stride_os, stride_oh,
    head_dim,
    window,
    num_partitions,
    BLOCK_D: tl.constexpr,
    MAX_PARTITIONS: tl.constexpr,  # next power of two >= num_partitions
    PARTITION_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    win_start = 0
    if USE_WINDOW:
        win_start = tl.maximum(seq_len - window, 0)
    # exactly the partitions the first kernel wrote (the others hold garbage)
    first = win_start // PARTITION_SIZE
    last = (seq_len - 1) // PARTITION_SIZE
    row0 = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_partitions
    offs_p = tl.arange(0, MAX_PARTITIONS)
    p_mask = (offs_p >= first) & (offs_p <= last)
    m_p = tl.load(part_max_ptr + row0 + offs_p, mask=p_mask, other=float("-inf"))
    l_p = tl.load(part_sum_ptr + row0 + offs_p, mask=p_mask, other=0.0)
    m_all = tl.max(m_p, 0)
    denom = tl.sum(l_p * tl.exp2(m_p - m_all), 0)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for p in range(first, last + 1):
        weight = tl.exp2(tl.load(part_max_ptr + row0 + p) - m_all)
        acc += weight * tl.load(part_out_ptr + (row0 + p) * BLOCK_D + offs_d)
    out = acc / denom
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    key_scales: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32: a quantized cache
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim], dtype of q
    """Triton flash-decoding; same semantics as ``paged_decode_attention_ref``, a quantized cache's too."""
    return _paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
                                   softcap=softcap, key_scales=key_scales, value_scales=value_scales)


def _partition_size(capacity_tokens: int, num_programs: int, num_sms: int, tile_n: int) -> int:
    """Tokens per partition: split only as much as needed to give the GPU ~4 programs per SM."""
    if tu.INTERPRET:
        return max(tile_n, tu.next_pow2(capacity_tokens))  # interpreter: fewest programs is fastest
    for size in (2048, 1024, 512, 256):
        if num_programs * triton.cdiv(capacity_tokens, size) >= 4 * num_sms:
            return size
    return 128


def _paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
                            partition_size: int | None = None, tile_n: int | None = None,
                            softcap: float | None = None, key_scales: torch.Tensor | None = None,
                            value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The launcher; tests pass ``partition_size`` / ``tile_n`` to force the split path at tiny sizes."""
    device = tu.check_paged_attention_args(q, key_cache, value_cache, block_tables, seq_lens, scale,
                                           sliding_window, softcap, key_scales, value_scales)
    num_seqs, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    tu.check_shape("seq_lens", seq_lens, (num_seqs,))
    if num_seqs and block_tables.shape[1] == 0:
        raise ValueError("block_tables has no columns: every sequence holds at least its decoded token")
    if tu.value_checks_enabled(device) and num_seqs:
        if int(seq_lens.min()) < 1:
            raise ValueError(f"seq_lens must all be >= 1 (the decoded token is cached), got {seq_lens.tolist()}")
        tu.check_block_tables(block_tables, seq_lens, num_blocks, block_size)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    tile_n = tile_n or (32 if tu.INTERPRET or q.dtype == torch.float32 else 64)
    capacity = block_tables.shape[1] * block_size
    if partition_size is None:
        partition_size = _partition_size(capacity, num_seqs * num_kv_heads, tu.num_sms(device), tile_n)
    if partition_size % tile_n:
        raise ValueError(f"partition_size {partition_size} is not a multiple of tile_n {tile_n}")
    num_partitions = triton.cdiv(capacity, partition_size)
    single = num_partitions == 1
    block_d = max(16, tu.next_pow2(head_dim))
    if single:
        part_out = part_max = part_sum = out  # unused placeholders
    else:
        part_out = torch.empty(num_seqs, num_q_heads, num_partitions, block_d, dtype=torch.float32, device=device)
        part_max = torch.empty(num_seqs, num_q_heads, num_partitions, dtype=torch.float32, device=device)
        part_sum = torch.empty_like(part_max)
    window = sliding_window or 0
    upcast = tu.INTERPRET  # the interpreter gets bf16 arithmetic wrong: compute in fp32 after loading
    ks, vs, stride_sb, stride_st = tu.kv_scale_args(key_cache, key_scales, value_scales)
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        q, key_cache, value_cache, ks, vs, block_tables, seq_lens, out, part_out, part_max, part_sum,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        stride_sb, stride_st,
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        float(scale) * _LOG2E, head_dim, block_size, window, float(softcap or 1.0) * _LOG2E, num_partitions,
        GROUP=group,
        BLOCK_G=max(16, tu.next_pow2(group)),
        BLOCK_D=block_d,
        TILE_N=tile_n,
        PARTITION_SIZE=partition_size,
        USE_WINDOW=sliding_window is not None,
        SINGLE_PARTITION=single,
        UPCAST=upcast,
        DOT_PRECISION=tu.dot_precision(q.dtype),
        SOFTCAP=softcap is not None,
        KV_QUANT=key_scales is not None,
        num_warps=4,
        num_stages=2,
    )
    if not single:
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            out, part_out, part_max, part_sum, seq_lens,
            out.stride(0), out.stride(1),
            head_dim, window, num_partitions,
            BLOCK_D=block_d,
            MAX_PARTITIONS=tu.next_pow2(num_partitions),
            PARTITION_SIZE=partition_size,
            USE_WINDOW=sliding_window is not None,
            num_warps=4,
        )
    return out
