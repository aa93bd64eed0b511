"""prefill_attention (Triton varlen flash-attention over the paged cache) against prefill_attention_ref.

K/V of every case are read from the strided layer views of a real 6-D cache through scattered block
tables. A batch mixes a whole prompt (prefix 0), prefix-cache hits at a block boundary and off it, a
sequence with no new tokens, a single new token, and queries long enough to span several query tiles.
"""
from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import paged_decode_attention_ref
from kernels.prefill_attention import prefill_attention, prefill_attention_ref
from kernels.store_kv import store_kv
from tests.kernels.paged import DEVICE, assert_close, block_tables, kv_cache, layer_views, lens_tensor

# (new query tokens, cached prefix tokens) per sequence
BATCH = [(17, 0), (9, 13), (40, 16), (0, 5), (1, 30)]
HEADS = [  # (head_dim, q_heads, kv_heads): every head dim, GQA ratios 1, 2, 4, MQA
    (64, 2, 2),
    (80, 4, 2),
    (96, 4, 1),
    (128, 8, 2),
]


def _case(head_dim, q_heads, kv_heads, block_size, dtype, batch=BATCH, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q_len + prefix for q_len, prefix in batch]
    num_blocks = len(batch) * (max(seq_lens) // block_size + 2)
    cache = kv_cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen)
    key_cache, value_cache = layer_views(cache)
    tables = block_tables(seq_lens, block_size, num_blocks, gen)
    q_lens = torch.tensor([0] + [q_len for q_len, _ in batch])
    cu_seqlens_q = q_lens.cumsum(0).to(torch.int32).to(DEVICE)
    q = torch.randn(int(q_lens.sum()), q_heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    return q, key_cache, value_cache, tables, cu_seqlens_q, lens_tensor(seq_lens)


@pytest.mark.parametrize("window", [None, 12], ids=["causal", "window12"])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", HEADS)
def test_matches_reference(head_dim, q_heads, kv_heads, dtype, block_size, window):
    args = _case(head_dim, q_heads, kv_heads, block_size, dtype)
    scale = head_dim ** -0.5
    assert_close(prefill_attention(*args, scale, window), prefill_attention_ref(*args, scale, window))


@pytest.mark.parametrize("window", [None, 3])
def test_bf16_and_odd_group(window):
    """bf16, and 7 query heads per KV head (Qwen2-7B's 28/4): query tiles of 9 tokens x 7 heads."""
    args = _case(64, 14, 2, 16, torch.bfloat16, batch=[(30, 0), (20, 21)])
    assert_close(prefill_attention(*args, 0.125, window), prefill_attention_ref(*args, 0.125, window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 12], ids=["causal", "window12"])
def test_soft_capped_scores_match_the_reference(window, dtype):
    """Gemma 2's cap * tanh(s / cap) before the mask: a cap of 2 on scores of magnitude ~10 changes every row
    (the uncapped kernel is far from the capped reference, so the test can see the cap missing)."""
    q, kc, vc, tables, cu, lens = _case(64, 4, 2, 8, dtype, batch=[(17, 0), (9, 13), (1, 30)])
    args, scale = (q * 4, kc, vc, tables, cu, lens), 64 ** -0.5
    want = prefill_attention_ref(*args, scale, window, softcap=2.0)
    assert_close(prefill_attention(*args, scale, window, softcap=2.0), want)
    assert (prefill_attention_ref(*args, scale, window).float() - want.float()).abs().max() > 0.1


def test_strided_query():
    q, kc, vc, tables, cu, lens = _case(64, 4, 2, 8, torch.float32, batch=[(12, 3), (20, 0)])
    gen = torch.Generator().manual_seed(5)
    qkv = torch.cat([q, torch.randn(q.shape[0], 4, 64, generator=gen).to(DEVICE)], dim=1)
    q_view = qkv[:, :4]
    assert not q_view.is_contiguous()
    expected = prefill_attention_ref(q, kc, vc, tables, cu, lens, 0.125)
    assert_close(prefill_attention(q_view, kc, vc, tables, cu, lens, 0.125), expected)


def test_single_token_queries_agree_with_decode():
    """q_len 1 per sequence is a decode step: both references and the kernel must agree."""
    q, kc, vc, tables, cu, lens = _case(64, 4, 2, 8, torch.float32, batch=[(1, 0), (1, 9), (1, 40)])
    out = prefill_attention(q, kc, vc, tables, cu, lens, 0.125, 16)
    assert_close(out, paged_decode_attention_ref(q, kc, vc, tables, lens, 0.125, 16))


def test_store_then_attend_like_the_engine():
    """The engine's order: store the new tokens' K/V with store_kv, then attend over prefix + new tokens."""
    batch = [(10, 6), (25, 0)]
    q, kc, vc, tables, cu, lens = _case(80, 4, 2, 8, torch.float16, batch=batch)
    gen = torch.Generator().manual_seed(7)
    new_k = torch.randn(q.shape[0], 2, 80, generator=gen).to(dtype=torch.float16, device=DEVICE)
    new_v = torch.randn(q.shape[0], 2, 80, generator=gen).to(dtype=torch.float16, device=DEVICE)
    slots = []
    for s, (q_len, prefix) in enumerate(batch):
        slots += [int(tables[s, p // 8]) * 8 + p % 8 for p in range(prefix, prefix + q_len)]
    store_kv(new_k, new_v, kc, vc, torch.tensor(slots, device=DEVICE))
    out = prefill_attention(q, kc, vc, tables, cu, lens, 80 ** -0.5)
    assert_close(out, prefill_attention_ref(q, kc, vc, tables, cu, lens, 80 ** -0.5))
    # the stored rows are the ones read: a sequence's last new token sees its own key
    row = tables[1, 24 // 8] * 8 + 24 % 8
    assert torch.equal(kc.reshape(-1, 2, 80)[row], new_k[-1])


def _valid_args():
    q, kc, vc, tables, cu, lens = _case(64, 4, 2, 8, torch.float16, batch=[(3, 2), (5, 0)])
    return dict(q=q, key_cache=kc, value_cache=vc, block_tables=tables, cu_seqlens_q=cu, seq_lens=lens, scale=0.1)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), TypeError, "cu_seqlens_q has dtype"),
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:2]), ValueError, "cu_seqlens_q has shape"),
    (lambda a: a.update(cu_seqlens_q=lens_tensor([0, 3, 7])), ValueError, "must rise from 0 to num_q_tokens=8"),
    (lambda a: a.update(cu_seqlens_q=lens_tensor([0, 6, 8])), ValueError, "must be >= the query lengths"),
    (lambda a: a.update(seq_lens=lens_tensor([5, 5, 5])), ValueError, "block_tables has 2 rows but seq_lens"),
    (lambda a: a.update(seq_lens=lens_tensor([5, 99])), ValueError, "need more than the"),
    (lambda a: a.update(key_cache=a["key_cache"].float()), TypeError, "key_cache has dtype torch.float32"),
    (lambda a: a.update(q=a["q"][:, :, :48]), ValueError, "q has head_dim 48"),
    (lambda a: a.update(block_tables=a["block_tables"] - 100), ValueError, "block ids outside"),
    (lambda a: a.update(cu_seqlens_q=torch.zeros(3, dtype=torch.int32, device="meta")), ValueError,
     "cu_seqlens_q is on meta"),
])
def test_rejects_bad_arguments_by_name(change, error, match):
    args = _valid_args()
    change(args)
    with pytest.raises(error, match=match):
        prefill_attention(**args)
