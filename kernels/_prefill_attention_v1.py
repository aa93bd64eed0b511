"""The prefill attention kernel before issue 51, kept only so that the GPU benchmark can time old and new on the
same GPU in one call (``python -m bench.bench_kernels --prefill --with-v1``); delete it once the comparison is
recorded in docs/benchmarks.md. Not used by the engine.

Rows of a program mix the query heads of a GQA group (``BLOCK_Q = BLOCK_M // group`` tokens x ``group`` heads),
every K/V tile is gathered through the block table token by token and masked, and the loop runs in 64-token
tiles (see kernels/prefill_attention.py's docstring for what replaced it and why).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _triton_utils as tu
from kernels._paged_kv import attend_kv_tile
from kernels.prefill_attention import _find_sequence

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_attention_v1_kernel(
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


def prefill_attention_v1(
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
    """The old launcher, arguments unchecked (they are the new launcher's, checked there)."""
    num_q_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
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
    _prefill_attention_v1_kernel[grid](
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
