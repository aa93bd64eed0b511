"""prefill_attention: variable-length causal attention over the paged cache.

A batch holds ``num_seqs`` sequences; sequence s contributes ``q_len_s = cu_seqlens_q[s+1] -
cu_seqlens_q[s]`` new query tokens and has ``seq_lens[s]`` tokens of K/V in the cache (its cached prefix
plus these new tokens, which the caller has already stored). Query token i of sequence s sits at absolute
position ``p = seq_lens[s] - q_len_s + i`` and attends to cached positions j with ``j <= p`` and, with a
sliding window W, ``j > p - W``. This covers a whole prompt (prefix 0), a prefix-cache hit, a chunk of a
chunked prefill and a decode step (q_len 1) alike.

Triton path (varlen flash-attention over the paged cache, no N x N matrix):
- rows of a program are (query token, query head) pairs of one sequence and one KV head: ``BLOCK_Q`` query
  tokens times the ``group`` query heads sharing that KV head, ``BLOCK_Q = BLOCK_M // group`` for a power of
  two ``BLOCK_M`` (spare rows masked). So each K/V tile is loaded once for the whole GQA group.
- grid ``(num_q_tokens // BLOCK_Q + num_seqs, num_kv_heads)``: an upper bound on the query tiles of all
  sequences that needs no device sync; sequence s owns tiles from ``cu_seqlens_q[s] // BLOCK_Q + s``, each
  program finds its sequence by binary search over ``cu_seqlens_q`` and spare programs return at once.
- K/V of positions ``[lo, max causal position of the tile]`` are read in TILE_N-token tiles through the block
  table (a tile may span blocks, any block size), with the causal and sliding-window masks per row and an
  fp32 online softmax; rows fully masked in a tile (sliding window) are kept NaN-free.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _triton_utils as tu
from kernels._paged_kv import attend_kv_tile


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` rows of one sequence's K or V: ``[num_tokens, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = (num_tokens + block_size - 1) // block_size
    rows = cache.index_select(0, block_table[:num_blocks].long())
    return rows.reshape(-1, cache.shape[2], cache.shape[3])[:num_tokens]


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
                         softcap: float) -> torch.Tensor:
    """Attention with Gemma 2's logit soft-capping, as transformers computes it: scores = q·k * scale, then
    tanh(scores / cap) * cap, then the mask, softmax, · v. q [..., Hq, Lq, D]; k, v [..., Hkv, Lk, D] with
    Hq a multiple of Hkv; ``allowed`` broadcasts to [..., Lq, Lk]."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def prefill_attention_ref(
    q: torch.Tensor,  # [num_q_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, prefix sums of query lengths
    seq_lens: torch.Tensor,  # [num_seqs] int32, K/V length of each sequence incl. the new tokens
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_q_tokens, num_q_heads, head_dim], dtype of q
    num_q_heads = q.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for s, kv_len in enumerate(lens):
        q_start, q_end = cu[s], cu[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = gather_kv(key_cache, block_tables[s], kv_len).float()
        v = gather_kv(value_cache, block_tables[s], kv_len).float()
        pos_q = torch.arange(kv_len - q_len, kv_len, device=q.device).unsqueeze(1)
        pos_k = torch.arange(kv_len, device=q.device).unsqueeze(0)
        allowed = pos_k <= pos_q
        if sliding_window is not None:
            allowed &= pos_k > pos_q - sliding_window
        qs = q[q_start:q_end].float().transpose(0, 1)
        if softcap is not None:
            o = softcapped_attention(qs, k.transpose(0, 1), v.transpose(0, 1), allowed, scale, softcap)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(qs, k.transpose(0, 1), v.transpose(0, 1),
                                                                 attn_mask=allowed, scale=scale, enable_gqa=group > 1)
        out[q_start:q_end] = o.transpose(0, 1).to(q.dtype)
    return out


_LOG2E = 1.4426950408889634


@triton.jit
def _find_sequence(
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    num_seqs,
    tile,
    BLOCK_Q: tl.constexpr,
):
    """Sequence s owns query tiles [cu[s] // BLOCK_Q + s, cu[s + 1] // BLOCK_Q + s + 1): binary search for
    the last s whose first tile is <= ``tile``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_attention_kernel(
    q_ptr,  # [num_q_tokens, num_q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_q_tokens, num_q_heads, head_dim]
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bts,
    stride_ot, stride_oh,
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    head_dim,
    block_size,
    window,  # sliding window in tokens (read only when USE_WINDOW)
    softcap,  # Gemma 2's attention cap * log2(e) (read only when SOFTCAP)
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE_N)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP  # query token within the sequence
    heads = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_mask = offs_d < head_dim
    tokens = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len + q_idx  # absolute position of each row

    first_pos = context_len + q_tile * BLOCK_Q
    kv_end = tl.minimum(first_pos + BLOCK_Q, seq_len)  # one past the last position any row may see
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = (tl.maximum(first_pos - window + 1, 0) // TILE_N) * TILE_N
    k_base = key_cache_ptr + kv_head * stride_kh
    v_base = value_cache_ptr + kv_head * stride_vh
    table = block_tables_ptr + seq.to(tl.int64) * stride_bts

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(kv_lo, kv_end, TILE_N):
        pos = start + offs_n
        in_seq = pos < kv_end
        allowed = in_seq[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = attend_kv_tile(q, acc, m_i, l_i, k_base, v_base, table, pos, in_seq, allowed,
                                       offs_d, d_mask, block_size, stride_kb, stride_kt, stride_vb, stride_vt,
                                       qk_scale, softcap, UPCAST, DOT_PRECISION, SOFTCAP)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def prefill_attention(
    q: torch.Tensor,  # [num_q_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, prefix sums of query lengths
    seq_lens: torch.Tensor,  # [num_seqs] int32, K/V length of each sequence incl. the new tokens
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_q_tokens, num_q_heads, head_dim], dtype of q
    """Triton varlen flash-attention over the paged cache; same semantics as ``prefill_attention_ref``."""
    device = tu.check_paged_attention_args(q, key_cache, value_cache, block_tables, seq_lens, scale,
                                           sliding_window, softcap)
    tu.check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,))
    tu.check_device(q=q, cu_seqlens_q=cu_seqlens_q)
    num_q_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    tu.check_shape("cu_seqlens_q", cu_seqlens_q, (num_seqs + 1,))
    if cu_seqlens_q.stride(0) != 1 and num_seqs > 0:
        raise ValueError(f"cu_seqlens_q must be contiguous, got stride {cu_seqlens_q.stride()}")
    if tu.value_checks_enabled(device):
        _check_lengths(cu_seqlens_q, seq_lens, num_q_tokens)
        tu.check_block_tables(block_tables, seq_lens, num_blocks, block_size)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_q_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    fp32 = q.dtype == torch.float32
    # GPU: 128 x 64 tiles on the tensor cores (fp32 halves both: its tiles take twice the registers)
    block_m = max(64 if tu.INTERPRET or fp32 else 128, tu.next_pow2(group))
    block_q = block_m // group
    tile_n = 32 if tu.INTERPRET or fp32 else 64
    upcast = tu.INTERPRET  # the interpreter gets bf16 arithmetic wrong: compute in fp32 after loading
    grid = (num_q_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_attention_kernel[grid](
        q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, out,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        float(scale) * _LOG2E, num_seqs, head_dim, block_size, sliding_window or 0, float(softcap or 1.0) * _LOG2E,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_D=max(16, tu.next_pow2(head_dim)),
        TILE_N=tile_n,
        USE_WINDOW=sliding_window is not None,
        UPCAST=upcast,
        DOT_PRECISION=tu.dot_precision(q.dtype),
        SOFTCAP=softcap is not None,
        num_warps=8 if block_m >= 128 else 4,
        num_stages=2 if fp32 or head_dim > 128 else 3,
    )
    return out


def _check_lengths(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_q_tokens: int) -> None:
    cu = cu_seqlens_q.to("cpu", torch.int64)
    q_lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != num_q_tokens or bool((q_lens < 0).any()):
        raise ValueError(f"cu_seqlens_q must rise from 0 to num_q_tokens={num_q_tokens}, got {cu.tolist()}")
    if bool((seq_lens.to("cpu", torch.int64) < q_lens).any()):
        raise ValueError(f"seq_lens {seq_lens.tolist()} must be >= the query lengths {q_lens.tolist()}")
