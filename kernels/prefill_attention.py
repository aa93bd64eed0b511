"""prefill_attention: variable-length causal attention over the paged cache.

A batch holds ``num_seqs`` sequences; sequence s contributes ``q_len_s = cu_seqlens_q[s+1] -
cu_seqlens_q[s]`` new query tokens and has ``seq_lens[s]`` tokens of K/V in the cache (its cached prefix
plus these new tokens, which the caller has already stored). Query token i of sequence s sits at absolute
position ``p = seq_lens[s] - q_len_s + i`` and attends to cached positions j with ``j <= p`` and, with a
sliding window W, ``j > p - W``. This covers a whole prompt (prefix 0), a prefix-cache hit, a chunk of a
chunked prefill and a decode step (q_len 1) alike.

Triton path: FlashAttention-2's forward over the paged cache (issue 51; the kernel before it mixed the query
heads of a GQA group in its rows, gathered and masked every tile, and ran at 0.39 of SDPA flash on an H200):
- a program owns ``BLOCK_M`` query tokens of one sequence and one query head, grid ``(num_q_heads,
  num_q_tokens // BLOCK_M + num_seqs)``: an upper bound on the query tiles of all sequences that needs no
  device sync; sequence s owns tiles from ``cu_seqlens_q[s] // BLOCK_M + s``, a program finds its sequence by
  binary search over ``cu_seqlens_q``, spare programs return at once. The heads of a GQA group are adjacent in
  launch order, so they read the same K/V tiles while they are in L2; the last query tiles (the longest
  causal rows) start first.
- K/V are read once per query tile in ``BLOCK_N``-token tiles aligned to ``BLOCK_N``, in up to three loops:
  the window's lower edge (masked), the tiles every row sees whole (no mask, no bounds: the plain
  FlashAttention step), and the causal diagonal (masked; bounded by the sequence end). Tiles past the
  diagonal or below the window are never visited.
- online softmax in the log2 domain: ``qk_scale = scale * log2(e)`` is applied in the same FMA that subtracts
  the running max, then exp2. Masked tiles keep rows with nothing visible yet NaN-free (m stays -inf, the
  update subtracts 0).
- paged K/V: when the cache's block size is a multiple of ``BLOCK_N``, a tile lies inside one block: one
  block-table read per tile and a contiguous slice; otherwise each token's block id is gathered (any block
  size). ``BLOCK_SIZE`` is a compile-time constant, so both are shifts and masks.
- a quantized cache (int8 / fp8 values, ``key_scales`` / ``value_scales`` fp32 per token and KV head,
  kernels/kv_quant.py): the same loops; the tile step converts the values and applies the scales to the fp32
  scores and probabilities (kernels/_paged_kv.py).
- fresh K/V (``fresh_key`` / ``fresh_value``; what the engine passes for a quantized cache's prompt chunks,
  engine/models/attention.py): a sequence marked in ``fresh_seqs`` reads its cached prefix (positions below
  ``seq_len - q_len``) from the cache as stored and its new tokens' K/V from the rows as computed, unquantized, as
  vLLM's prefix-prefill kernel takes the new tokens' k / v beside the cache (vllm/v1/attention/ops/prefix_prefill.py).
  The tile step loads a position at or past the sequence's first new one from those rows, with scale 1 (an exact
  product), the others from the cache; so a chunk without a cached prefix runs the arithmetic of a dense cache
  holding the same rows, on the same floats.
- tile configs: on CUDA the launcher autotunes a few ``TileConfig`` (kernels/prefill_tiles.py) once per head size, dtype, GQA
  group, block size and feature set (``DUET_PREFILL_AUTOTUNE=0``: the first one, no tuning); elsewhere (the
  interpreter, the sm_90 compile check) it runs the first config of its list.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import _triton_utils as tu
from kernels._paged_kv import attend_prefill_tile
from kernels.kv_quant import dequantize_ref
from kernels.prefill_tiles import TileConfig, configs_for


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int,
              scales: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``num_tokens`` rows of one sequence's K or V: ``[num_tokens, num_kv_heads, head_dim]``; with
    ``scales`` (a quantized cache, kernels/kv_quant.py) dequantized to fp32."""
    block_size = cache.shape[1]
    num_blocks = (num_tokens + block_size - 1) // block_size
    ids = block_table[:num_blocks].long()
    rows = cache.index_select(0, ids).reshape(-1, cache.shape[2], cache.shape[3])[:num_tokens]
    if scales is None:
        return rows
    return dequantize_ref(rows, scales.index_select(0, ids).reshape(-1, cache.shape[2])[:num_tokens])


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
    *,
    key_scales: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32: a quantized cache
    value_scales: torch.Tensor | None = None,
    fresh_key: torch.Tensor | None = None,  # [num_q_tokens, num_kv_heads, head_dim]: the new tokens' K as computed
    fresh_value: torch.Tensor | None = None,
    fresh_seqs: torch.Tensor | None = None,  # [num_seqs] int32: 1 = this sequence reads fresh_key / fresh_value
) -> torch.Tensor:  # [num_q_tokens, num_q_heads, head_dim], dtype of q
    """With ``fresh_key`` / ``fresh_value`` (``tu.check_fresh_kv``; ``fresh_seqs`` None: every sequence), a sequence
    marked in ``fresh_seqs`` attends to its new tokens' K/V as computed, its cached prefix from the cache as stored
    (kernels/prefill_attention.py's module docstring, "Fresh K/V")."""
    num_q_heads = q.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    fresh = [False] * len(lens)
    if tu.check_fresh_kv(q, key_cache, len(lens), fresh_key, fresh_value, fresh_seqs):
        fresh = [True] * len(lens) if fresh_seqs is None else [bool(f) for f in fresh_seqs.tolist()]
    for s, kv_len in enumerate(lens):
        q_start, q_end = cu[s], cu[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        cached = kv_len - q_len if fresh[s] else kv_len  # rows read from the cache; the rest are fresh
        k = gather_kv(key_cache, block_tables[s], cached, key_scales).float()
        v = gather_kv(value_cache, block_tables[s], cached, value_scales).float()
        if fresh[s]:
            k = torch.cat([k, fresh_key[q_start:q_end].float()])
            v = torch.cat([v, fresh_value[q_start:q_end].float()])
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
    key_scales_ptr,  # [num_blocks, block_size, num_kv_heads] fp32 (read only when KV_QUANT)
    value_scales_ptr,  # [num_blocks, block_size, num_kv_heads] fp32, key_scales' strides
    fresh_key_ptr,  # [num_q_tokens, num_kv_heads, head_dim] the new tokens' K as computed (read only when FRESH)
    fresh_value_ptr,  # [num_q_tokens, num_kv_heads, head_dim]
    fresh_seqs_ptr,  # [num_seqs] int32: 1 = the sequence's new tokens come from fresh_key / fresh_value
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_q_tokens, num_q_heads, head_dim]
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st,  # key_scales / value_scales (the head stride is 1)
    stride_nkt, stride_nkh, stride_nvt, stride_nvh,  # fresh_key / fresh_value
    stride_bts,
    stride_ot, stride_oh,
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    num_q_tokens,
    window,  # sliding window in tokens (read only when USE_WINDOW)
    softcap,  # Gemma 2's attention cap * log2(e) (read only when SOFTCAP)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    FRESH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    head = tl.program_id(0)
    tile = num_q_tokens // BLOCK_M + num_seqs - 1 - tl.program_id(1)  # the longest rows first
    seq = _find_sequence(cu_seqlens_q_ptr, num_seqs, tile, BLOCK_M)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_first = (tile - (q_start // BLOCK_M + seq)) * BLOCK_M  # first query token of the tile in its sequence
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = q_first + offs_m
    row_mask = q_idx < q_len
    tokens = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len + q_idx

    first_pos = context_len + q_first  # of the tile's first row; its last valid row is at kv_end - 1
    kv_end = tl.minimum(first_pos + BLOCK_M, seq_len)
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # tiles below it lie at or before every row's position
    kv_head = head // GROUP
    k_base = key_cache_ptr + kv_head * stride_kh
    v_base = value_cache_ptr + kv_head * stride_vh
    ks_base = key_scales_ptr + kv_head
    vs_base = value_scales_ptr + kv_head
    table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    nk_base = fresh_key_ptr + kv_head * stride_nkh
    nv_base = fresh_value_ptr + kv_head * stride_nvh
    new_start = seq_len  # the first position read from the new rows (none without FRESH)
    if FRESH:
        new_start = tl.where(tl.load(fresh_seqs_ptr + seq) != 0, context_len, seq_len)
    new_shift = q_start - context_len  # position p's row in the new rows

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_start = 0
    if USE_WINDOW:  # the window's lower edge: tiles some rows see in part
        kv_start = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_start = tl.minimum(tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N) * BLOCK_N, full_end)
        for start in range(kv_start, full_start, BLOCK_N):
            acc, m_i, l_i = attend_prefill_tile(
                acc, m_i, l_i, q, k_base, v_base, ks_base, vs_base, nk_base, nv_base, table, tl.multiple_of(start, BLOCK_N),
                q_pos, seq_len, window, new_start, new_shift, stride_kb, stride_kt, stride_vb, stride_vt, stride_sb,
                stride_st, stride_nkt, stride_nvt, qk_scale, softcap, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, True,
                USE_WINDOW, SOFTCAP, UPCAST, DOT_PRECISION, KV_QUANT, FRESH)
    for start in range(full_start, full_end, BLOCK_N):  # every row sees these tiles whole
        acc, m_i, l_i = attend_prefill_tile(
            acc, m_i, l_i, q, k_base, v_base, ks_base, vs_base, nk_base, nv_base, table, tl.multiple_of(start, BLOCK_N),
            q_pos, seq_len, window, new_start, new_shift, stride_kb, stride_kt, stride_vb, stride_vt, stride_sb,
            stride_st, stride_nkt, stride_nvt, qk_scale, softcap, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, False,
            USE_WINDOW, SOFTCAP, UPCAST, DOT_PRECISION, KV_QUANT, FRESH)
    for start in range(full_end, kv_end, BLOCK_N):  # the causal diagonal
        acc, m_i, l_i = attend_prefill_tile(
            acc, m_i, l_i, q, k_base, v_base, ks_base, vs_base, nk_base, nv_base, table, tl.multiple_of(start, BLOCK_N),
            q_pos, seq_len, window, new_start, new_shift, stride_kb, stride_kt, stride_vb, stride_vt, stride_sb,
            stride_st, stride_nkt, stride_nvt, qk_scale, softcap, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, True,
            USE_WINDOW, SOFTCAP, UPCAST, DOT_PRECISION, KV_QUANT, FRESH)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_d[None, :] < HEAD_DIM))


def _autotuned(configs: tuple[TileConfig, ...]) -> triton.runtime.Autotuner:
    # the dtypes of the tensor arguments are part of Triton's tuning key already
    return triton.autotune([c.triton() for c in configs],
                           key=["HEAD_DIM", "GROUP", "BLOCK_SIZE", "USE_WINDOW", "SOFTCAP", "FRESH"])(_prefill_attention_kernel)


_TUNERS: dict[tuple[TileConfig, ...], triton.runtime.Autotuner] = {}


def last_autotuned_config(dtype: torch.dtype, head_dim: int) -> TileConfig | None:
    """The config the autotuner ran for the latest autotuned launch of this dtype and head size (benchmarks)."""
    tuner = _TUNERS.get(configs_for(dtype, head_dim))
    best = getattr(tuner, "best_config", None)
    if best is None:
        return None
    return TileConfig(best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages)


def _autotune_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and not tu.INTERPRET and os.environ.get("DUET_PREFILL_AUTOTUNE", "1") != "0"


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
    *,
    key_scales: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32: a quantized cache
    value_scales: torch.Tensor | None = None,
    fresh_key: torch.Tensor | None = None,  # [num_q_tokens, num_kv_heads, head_dim]: the new tokens' K as computed
    fresh_value: torch.Tensor | None = None,
    fresh_seqs: torch.Tensor | None = None,  # [num_seqs] int32: 1 = this sequence reads fresh_key / fresh_value
    config: TileConfig | None = None,
) -> torch.Tensor:  # [num_q_tokens, num_q_heads, head_dim], dtype of q
    """Triton varlen flash-attention over the paged cache; same semantics as ``prefill_attention_ref``, a quantized
    cache's and fresh K/V's too (kernels/_paged_kv.py). ``config``: pin one tile config (tests, benchmarks); None
    autotunes on CUDA (see the module docstring)."""
    device = tu.check_paged_attention_args(q, key_cache, value_cache, block_tables, seq_lens, scale,
                                           sliding_window, softcap, key_scales, value_scales)
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
    fresh = tu.check_fresh_kv(q, key_cache, num_seqs, fresh_key, fresh_value, fresh_seqs)
    tu.check_device(q=q, fresh_key=fresh_key, fresh_value=fresh_value, fresh_seqs=fresh_seqs)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_q_tokens == 0 or num_seqs == 0:
        return out
    ks, vs, stride_sb, stride_st = tu.kv_scale_args(key_cache, key_scales, value_scales)
    if fresh and fresh_seqs is None:
        fresh_seqs = torch.ones(num_seqs, dtype=torch.int32, device=q.device)
    nk, nv = (fresh_key, fresh_value) if fresh else (q, q)  # unread placeholders without FRESH
    args = (q, key_cache, value_cache, ks, vs, nk, nv, fresh_seqs if fresh else seq_lens, block_tables, cu_seqlens_q,
            seq_lens, out,
            q.stride(0), q.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            stride_sb, stride_st,
            nk.stride(0), nk.stride(1), nv.stride(0), nv.stride(1),
            block_tables.stride(0),
            out.stride(0), out.stride(1),
            float(scale) * _LOG2E, num_seqs, num_q_tokens, sliding_window or 0, float(softcap or 1.0) * _LOG2E)
    constants = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, tu.next_pow2(head_dim)),
        GROUP=num_q_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None,
        SOFTCAP=softcap is not None,
        UPCAST=tu.INTERPRET,  # the interpreter gets bf16 arithmetic wrong: compute in fp32 after loading
        DOT_PRECISION=tu.dot_precision(q.dtype),
        KV_QUANT=key_scales is not None,
        FRESH=fresh,
    )

    def grid(meta):
        return (num_q_heads, num_q_tokens // meta["BLOCK_M"] + num_seqs)

    configs = configs_for(q.dtype, head_dim)
    if config is None and len(configs) > 1 and _autotune_enabled(device):
        tuner = _TUNERS.get(configs)
        if tuner is None:
            tuner = _TUNERS[configs] = _autotuned(configs)
        tuner[grid](*args, **constants)
        return out
    config = config or configs[0]
    _prefill_attention_kernel[grid](*args, **constants, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                                    num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def _check_lengths(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_q_tokens: int) -> None:
    cu = cu_seqlens_q.to("cpu", torch.int64)
    q_lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != num_q_tokens or bool((q_lens < 0).any()):
        raise ValueError(f"cu_seqlens_q must rise from 0 to num_q_tokens={num_q_tokens}, got {cu.tolist()}")
    if bool((seq_lens.to("cpu", torch.int64) < q_lens).any()):
        raise ValueError(f"seq_lens {seq_lens.tolist()} must be >= the query lengths {q_lens.tolist()}")
