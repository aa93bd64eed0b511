"""Attention over the paged KV cache for one mixed batch (chunked prefills first, then decodes).

The runner builds one ``AttentionMetadata`` per step; every layer uses it with its own cache views.
Tokens are laid out ``[prefill tokens of seq 0, seq 1, …][one token per decode seq]``: sequences with more
than one new token go through ``prefill_attention`` (which also attends to any cached prefix), the
single-token ones through ``decode_attention``.

Fresh K/V (a quantized cache): the store quantizes the new tokens' K/V, but a prompt chunk's attention reads its own
tokens' K/V as computed (``prefill_fresh_seqs``; kernels/prefill_attention.py), its cached prefix as stored, as
vLLM's prefix prefill does. So a prompt prefilled in one chunk without a prefix hit computes the floats an engine
with a model-dtype cache computes (same backend), and the blocks it stores are byte for byte the blocks a decode
worker's own store makes of such an engine's (mixed precision across pools: kvtransfer/convert_reader.py). Tokens
after the original prompt (drafts being verified, generated tokens prefilled again after a preemption or a
migration) read every K/V from the cache, as decode computed them: the runner (engine/model_runner.py
``attention_sequences``) marks which sequences read fresh. A dense cache holds the rows as computed, so it passes
nothing (its kernels, and their bits, unchanged).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.kernel_backend import KernelOps
from kernels.kv_quant import LayerKV


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32
    # [num_prefills] int32, 1: the sequence's new tokens attend to their K/V as computed (a quantized cache's prompt
    # chunks); None: every prefill reads the cache alone (a dense cache)
    prefill_fresh_seqs: torch.Tensor | None = None

    @property
    def num_prefills(self) -> int:
        return self.prefill_seq_lens.shape[0]

    @property
    def num_decodes(self) -> int:
        return self.decode_seq_lens.shape[0]


def fresh_sequences(cu_q: list[int], tables: list[list[int]], seq_lens: list[int], prompt_ends: list[int]
                    ) -> tuple[list[int], list[list[int]], list[int], list[int]]:
    """A quantized cache's prefill chunks as attention sequences: a chunk's tokens before its request's original prompt
    end (``prompt_ends[s]``) as one sequence that reads its new K/V fresh (mark 1), its tokens from there on as
    another that reads the cache (0); a chunk on one side of its prompt end stays one sequence. Returns
    (cu_seqlens_q, block tables, seq_lens, marks)."""
    cu, tabs, lens, marks = [0], [], [], []
    for s, end in enumerate(seq_lens):
        start = end - (cu_q[s + 1] - cu_q[s])
        cut = min(max(prompt_ends[s], start), end)
        for lo, hi, mark in ((start, cut, 1), (cut, end, 0)):
            if hi > lo:
                cu.append(cu[-1] + hi - lo)
                tabs.append(tables[s])
                lens.append(hi)
                marks.append(mark)
    return cu, tabs, lens, marks


def paged_attention(
    ops: KernelOps,
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv: LayerKV,  # this layer's cache views: K, V [num_blocks, block_size, num_kv_heads, head_dim] (+ scales)
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """A quantized cache's scales go to every kernel as ``key_scales`` / ``value_scales`` (kernels/kv_quant.py);
    a dense cache passes none, so the kernels' dense signatures are unchanged."""
    key_cache, value_cache, extra = kv.key, kv.value, kv.scales
    ops.store_kv(k, v, key_cache, value_cache, meta.slot_mapping, **extra)
    n_p = meta.num_prefill_tokens
    fresh = _fresh_kv(k, v, meta, n_p)
    if softcap is not None:
        if not ops.attention_softcap:
            return _softcapped(q, kv, meta, scale, sliding_window, softcap, fresh)
        extra = {**extra, "softcap": softcap}
    if meta.num_decodes == 0:
        return ops.prefill_attention(q, key_cache, value_cache, meta.prefill_block_tables,
                                     meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, scale, sliding_window, **extra,
                                     **fresh)
    if meta.num_prefills == 0:
        return ops.decode_attention(q, key_cache, value_cache, meta.decode_block_tables,
                                    meta.decode_seq_lens, scale, sliding_window, **extra)
    out = torch.empty_like(q)
    out[:n_p] = ops.prefill_attention(q[:n_p], key_cache, value_cache, meta.prefill_block_tables,
                                      meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, scale, sliding_window, **extra,
                                      **fresh)
    out[n_p:] = ops.decode_attention(q[n_p:], key_cache, value_cache, meta.decode_block_tables,
                                     meta.decode_seq_lens, scale, sliding_window, **extra)
    return out


def _fresh_kv(k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, n_p: int) -> dict[str, torch.Tensor]:
    """The prefill kernels' fresh K/V keyword arguments (none without ``prefill_fresh_seqs``)."""
    if meta.prefill_fresh_seqs is None or meta.num_prefills == 0:
        return {}
    return {"fresh_key": k[:n_p], "fresh_value": v[:n_p], "fresh_seqs": meta.prefill_fresh_seqs}


def _softcapped(q, kv: LayerKV, meta: AttentionMetadata, scale, sliding_window, softcap, fresh) -> torch.Tensor:
    """Gemma 2's soft-capped attention on a backend whose kernels take no cap (the C kernels): the torch
    references (the runner counts this as a kernel fallback)."""
    from kernels.decode_attention import paged_decode_attention_ref
    from kernels.prefill_attention import prefill_attention_ref

    n_p = meta.num_prefill_tokens
    out = torch.empty_like(q)
    if meta.num_prefills:
        out[:n_p] = prefill_attention_ref(q[:n_p], kv.key, kv.value, meta.prefill_block_tables,
                                          meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, scale, sliding_window,
                                          softcap, **kv.scales, **fresh)
    if meta.num_decodes:
        out[n_p:] = paged_decode_attention_ref(q[n_p:], kv.key, kv.value, meta.decode_block_tables,
                                               meta.decode_seq_lens, scale, sliding_window, softcap, **kv.scales)
    return out
