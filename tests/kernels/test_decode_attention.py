"""paged_decode_attention (Triton flash-decoding) against paged_decode_attention_ref.

Every case reads K/V through the strided layer views of a real 6-D cache and scattered block tables, with
ragged lengths (1 = only the decoded token, non-multiples of the block size, several partitions), and runs
both the single-partition path (what the public launcher picks at these sizes on CPU) and the split-KV path
(partitions of 32 tokens, forced through the private launcher) with its reduce kernel.
"""
from __future__ import annotations

import pytest
import torch

from kernels import _triton_utils as tu
from kernels.decode_attention import (
    _paged_decode_attention,
    _partition_size,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from tests.kernels.paged import DEVICE, assert_close, block_tables, kv_cache, layer_views, lens_tensor

SEQ_LENS = [1, 7, 33, 100]  # 100 tokens = 4 partitions of 32 on the split path
HEADS = [  # (head_dim, q_heads, kv_heads): every head dim, GQA ratios 1, 2, 4, MQA
    (64, 4, 4),
    (80, 4, 2),
    (96, 4, 1),
    (128, 8, 2),
]


def _case(head_dim, q_heads, kv_heads, block_size, dtype, seq_lens=SEQ_LENS, seed=0, spare_columns=1):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = len(seq_lens) * (max(seq_lens) // block_size + 1 + spare_columns)
    cache = kv_cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen)
    key_cache, value_cache = layer_views(cache)
    tables = block_tables(seq_lens, block_size, num_blocks, gen, spare_columns)
    q = torch.randn(len(seq_lens), q_heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    return q, key_cache, value_cache, tables, lens_tensor(seq_lens)


@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", HEADS)
def test_matches_reference(head_dim, q_heads, kv_heads, dtype, window, split):
    block_size = 8 if head_dim in (64, 96) else 16
    q, kc, vc, tables, lens = _case(head_dim, q_heads, kv_heads, block_size, dtype)
    scale = head_dim ** -0.5
    if split:
        out = _paged_decode_attention(q, kc, vc, tables, lens, scale, window, partition_size=32, tile_n=32)
    else:
        out = paged_decode_attention(q, kc, vc, tables, lens, scale, window)
    assert_close(out, paged_decode_attention_ref(q, kc, vc, tables, lens, scale, window))


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("window", [None, 5, 64])
def test_bf16_and_odd_group(block_size, window):
    """bf16 (loaded, then computed in fp32), and a group of 7 query heads per KV head (Qwen2-7B's 28/4)."""
    q, kc, vc, tables, lens = _case(64, 14, 2, block_size, torch.bfloat16, seq_lens=[3, 70, 41])
    out = _paged_decode_attention(q, kc, vc, tables, lens, 0.125, window, partition_size=32, tile_n=32)
    assert_close(out, paged_decode_attention_ref(q, kc, vc, tables, lens, 0.125, window))


def test_strided_query_and_wide_block_table():
    """q sliced out of a fused qkv buffer; a block table with many unused columns (more partitions than
    any sequence needs: their programs must exit without touching the reduce)."""
    q, kc, vc, tables, lens = _case(64, 4, 2, 16, torch.float32, seq_lens=[5, 50], spare_columns=4)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.cat([q, torch.randn(2, 4, 64, generator=gen).to(DEVICE)], dim=1)  # [seqs, q + kv heads, d]
    q_view = qkv[:, :4]
    assert not q_view.is_contiguous()
    out = _paged_decode_attention(q_view, kc, vc, tables, lens, 0.125, None, partition_size=32, tile_n=32)
    assert_close(out, paged_decode_attention_ref(q, kc, vc, tables, lens, 0.125, None))


def test_ignores_cache_rows_past_the_sequence():
    """Poisoning every slot outside the sequences (NaN) must not change the output."""
    q, kc, vc, tables, lens = _case(64, 4, 2, 8, torch.float32, seq_lens=[3, 12])
    expected = paged_decode_attention_ref(q, kc, vc, tables, lens, 0.125, None)
    used = torch.zeros(kc.shape[0], kc.shape[1], dtype=torch.bool, device=DEVICE)
    for s, n in enumerate(lens.tolist()):
        for pos in range(n):
            used[tables[s, pos // 8], pos % 8] = True
    kc[~used] = float("nan")
    vc[~used] = float("nan")
    for split in (None, 16):
        out = _paged_decode_attention(q, kc, vc, tables, lens, 0.125, None, partition_size=split, tile_n=16)
        assert_close(out, expected)


def test_partition_size_heuristic_splits_only_when_the_gpu_would_idle(monkeypatch):
    monkeypatch.setattr(tu, "INTERPRET", False)
    # batch 64 x 8 KV heads already fills 132 SMs four times over: long partitions
    assert _partition_size(4096, 64 * 8, 132, 64) == 2048
    # one sequence, 8 KV heads, 4k context: split down to fill the SMs
    assert _partition_size(4096, 16 * 8, 132, 64) == 512
    assert _partition_size(4096, 8, 132, 64) == 128
    assert _partition_size(32768, 1, 132, 64) == 128


@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_soft_capped_scores_match_the_reference(dtype, window, split):
    """Gemma 2's cap * tanh(s / cap): large scores (q x 4) under a cap of 2, on the single and split paths."""
    q, kc, vc, tables, lens = _case(64, 4, 2, 8, dtype)
    q, scale = q * 4, 64 ** -0.5
    want = paged_decode_attention_ref(q, kc, vc, tables, lens, scale, window, softcap=2.0)
    out = (_paged_decode_attention(q, kc, vc, tables, lens, scale, window, partition_size=32, tile_n=32,
                                   softcap=2.0) if split
           else paged_decode_attention(q, kc, vc, tables, lens, scale, window, softcap=2.0))
    assert_close(out, want)
    assert (paged_decode_attention_ref(q, kc, vc, tables, lens, scale, window).float() - want.float()).abs().max() > 0.1


def _valid_args():
    q, kc, vc, tables, lens = _case(64, 4, 2, 8, torch.float16, seq_lens=[3, 12])
    return dict(q=q, key_cache=kc, value_cache=vc, block_tables=tables, seq_lens=lens, scale=0.125)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.update(q=a["q"][:, :3]), ValueError, "not a multiple of key_cache's 2 kv heads"),
    (lambda a: a.update(q=a["q"].float()), TypeError, "key_cache has dtype torch.float16 but q has"),
    (lambda a: a.update(q=a["q"][..., :32]), ValueError, "q has head_dim 32 but key_cache has 64"),
    (lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "q must be contiguous in its last dim"),
    (lambda a: a.update(value_cache=a["value_cache"][:4]), ValueError, "value_cache has shape"),
    (lambda a: a.update(block_tables=a["block_tables"].long()), TypeError, "block_tables has dtype"),
    (lambda a: a.update(block_tables=a["block_tables"][:1]), ValueError, "block_tables has 1 rows"),
    (lambda a: a.update(block_tables=a["block_tables"] + 100), ValueError, "block ids outside"),
    (lambda a: a.update(seq_lens=lens_tensor([3, 200])), ValueError, "need more than the"),
    (lambda a: a.update(seq_lens=lens_tensor([0, 12])), ValueError, "seq_lens must all be >= 1"),
    (lambda a: a.update(seq_lens=a["seq_lens"].long()), TypeError, "seq_lens has dtype"),
    (lambda a: a.update(q=a["q"][0]), ValueError, "q must have 3 dims"),
    (lambda a: a.update(scale=float("nan")), ValueError, "scale must be a positive finite float"),
    (lambda a: a.update(sliding_window=0), ValueError, "sliding_window must be None or a positive int"),
    (lambda a: a.update(softcap=0.0), ValueError, "softcap must be a positive finite float or None"),
    (lambda a: a.update(block_tables=torch.empty(2, 3, dtype=torch.int32, device="meta")), ValueError,
     "block_tables is on meta"),
])
def test_rejects_bad_arguments_by_name(change, error, match):
    args = _valid_args()
    change(args)
    with pytest.raises(error, match=match):
        paged_decode_attention(**args)


def test_rejects_head_dims_outside_16_to_256():
    gen = torch.Generator().manual_seed(0)
    for head_dim in (8, 512):
        cache = kv_cache(2, 8, 1, head_dim, torch.float32, gen)
        q = torch.zeros(1, 1, head_dim, device=DEVICE)
        with pytest.raises(ValueError, match=f"head_dim {head_dim} is not supported"):
            paged_decode_attention(q, *layer_views(cache), block_tables([1], 8, 2, gen), lens_tensor([1]), 1.0)
