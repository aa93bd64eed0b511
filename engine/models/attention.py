"""Attention over the paged KV cache for one mixed batch (chunked prefills first, then decodes).

The runner builds one ``AttentionMetadata`` per step; every layer uses it with its own cache views.
Tokens are laid out ``[prefill tokens of seq 0, seq 1, …][one token per decode seq]``: sequences with more
than one new token go through ``prefill_attention`` (which also attends to any cached prefix), the
single-token ones through ``decode_attention``.
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

    @property
    def num_prefills(self) -> int:
        return self.prefill_seq_lens.shape[0]

    @property
    def num_decodes(self) -> int:
        return self.decode_seq_lens.shape[0]


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
    if softcap is not None:
        if not ops.attention_softcap:
            return _softcapped(q, kv, meta, scale, sliding_window, softcap)
        extra = {**extra, "softcap": softcap}
    n_p = meta.num_prefill_tokens
    if meta.num_decodes == 0:
        return ops.prefill_attention(q, key_cache, value_cache, meta.prefill_block_tables,
                                     meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, scale, sliding_window, **extra)
    if meta.num_prefills == 0:
        return ops.decode_attention(q, key_cache, value_cache, meta.decode_block_tables,
                                    meta.decode_seq_lens, scale, sliding_window, **extra)
    out = torch.empty_like(q)
    out[:n_p] = ops.prefill_attention(q[:n_p], key_cache, value_cache, meta.prefill_block_tables,
                                      meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, scale, sliding_window, **extra)
    out[n_p:] = ops.decode_attention(q[n_p:], key_cache, value_cache, meta.decode_block_tables,
                                     meta.decode_seq_lens, scale, sliding_window, **extra)
    return out


def _softcapped(q, kv: LayerKV, meta: AttentionMetadata, scale, sliding_window, softcap) -> torch.Tensor:
    """Gemma 2's soft-capped attention on a backend whose kernels take no cap (the C kernels): the torch
    references (the runner counts this as a kernel fallback)."""
    from kernels.decode_attention import paged_decode_attention_ref
    from kernels.prefill_attention import prefill_attention_ref

    n_p = meta.num_prefill_tokens
    out = torch.empty_like(q)
    if meta.num_prefills:
        out[:n_p] = prefill_attention_ref(q[:n_p], kv.key, kv.value, meta.prefill_block_tables,
                                          meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, scale, sliding_window,
                                          softcap, **kv.scales)
    if meta.num_decodes:
        out[n_p:] = paged_decode_attention_ref(q[n_p:], kv.key, kv.value, meta.decode_block_tables,
                                               meta.decode_seq_lens, scale, sliding_window, softcap, **kv.scales)
    return out
