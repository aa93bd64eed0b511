"""prefill_attention (Triton varlen flash-attention over the paged cache) against prefill_attention_ref.

K/V of every case are read from the strided layer views of a real 6-D cache through scattered block
tables. A batch mixes a whole prompt (prefix 0), prefix-cache hits at a block boundary and off it, a
sequence with no new tokens, a single new token, and queries long enough to span several query tiles.
Every tile config the launcher may pick (the autotuned sm_90 sets, fp32's, the interpreter's) runs the same
cases, pinned: the kernel's three loops (window edge, whole tiles, causal diagonal) and both ways of reading
a tile (inside one cache block, or gathered across blocks) change with BLOCK_M, BLOCK_N and the block size.
On CUDA the other tests pin the first config too (``DUET_PREFILL_AUTOTUNE=0``, so the suite does not tune
every case); ``test_autotuned_launch_on_cuda`` tunes once.
"""
from __future__ import annotations

import pytest
import torch

from kernels import prefill_attention as pa
from kernels import prefill_tiles as tiles
from kernels.decode_attention import paged_decode_attention_ref
from kernels.prefill_attention import prefill_attention, prefill_attention_ref
from kernels.prefill_tiles import TileConfig
from kernels.store_kv import store_kv
from tests.kernels.paged import DEVICE, assert_close, block_tables, kv_cache, layer_views, lens_tensor


@pytest.fixture(autouse=True)
def untuned(monkeypatch):
    monkeypatch.setenv("DUET_PREFILL_AUTOTUNE", "0")


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


# long enough for whole tiles at BLOCK_M 128: a prompt, prefix hits on and off a tile edge, a decode-like row
LONG_BATCH = [(300, 0), (129, 200), (1, 77), (0, 5), (64, 64)]
SMALL_CONFIGS = (TileConfig(16, 64, 4, 1),)  # BLOCK_N > BLOCK_M
ALL_CONFIGS = sorted(set(tiles.CONFIGS_16BIT + tiles.CONFIGS_FP32 + tiles.CONFIGS_INTERPRET + SMALL_CONFIGS),
                     key=lambda c: (c.block_m, c.block_n, c.num_warps, c.num_stages))


def _config_id(c: TileConfig) -> str:
    return f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}"


@pytest.mark.parametrize("window", [None, 5, 150], ids=["causal", "window5", "window150"])
@pytest.mark.parametrize("block_size", [8, 64], ids=["gather8", "block64"])
@pytest.mark.parametrize("config", ALL_CONFIGS, ids=_config_id)
def test_every_tile_config(config, block_size, window):
    """A window of 5 is narrower than any tile (no whole tiles: every visited tile masked), 150 spans several;
    block 64 puts tiles of <= 64 tokens inside one block, block 8 makes every tile gather."""
    args = _case(64, 4, 2, block_size, torch.float16, batch=LONG_BATCH, seed=1)
    scale = 64 ** -0.5
    assert_close(prefill_attention(*args, scale, window, config=config), prefill_attention_ref(*args, scale, window))


@pytest.mark.parametrize("config", tiles.CONFIGS_16BIT_WIDE, ids=_config_id)
def test_wide_heads(config):
    """head_dim > 128 (Gemma 2's 256; 160 pads to 256) with a window and a cap, in its own configs."""
    q, kc, vc, tables, cu, lens = _case(160, 4, 2, 32, torch.bfloat16, batch=[(70, 0), (40, 33)])
    args, scale = (q * 4, kc, vc, tables, cu, lens), 160 ** -0.5
    want = prefill_attention_ref(*args, scale, 48, softcap=2.0)
    assert_close(prefill_attention(*args, scale, 48, softcap=2.0, config=config), want)


@pytest.mark.parametrize("block_size", [8, 64])
def test_slots_past_the_sequence_end_are_never_used(block_size):
    """The last block of a sequence is read whole on the fast path: NaN in its unused slots (what an
    uninitialised cache may hold) must not reach the output (0 * NaN is NaN: masked V rows load as 0)."""
    q, kc, vc, tables, cu, lens = _case(64, 4, 2, block_size, torch.float16, batch=[(37, 20), (50, 0)])
    for s, n in enumerate(lens.tolist()):
        for p in range(n, tables.shape[1] * block_size):
            block = int(tables[s, p // block_size])
            kc[block, p % block_size] = float("nan")
            vc[block, p % block_size] = float("nan")
    want = prefill_attention_ref(q, kc, vc, tables, cu, lens, 0.125)
    for config in (TileConfig(32, 64, 4, 1), tiles.configs_for(q.dtype, 64)[0]):
        assert_close(prefill_attention(q, kc, vc, tables, cu, lens, 0.125, config=config), want)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="autotuning needs a CUDA device; elsewhere one config runs")
def test_autotuned_launch_on_cuda(monkeypatch):
    monkeypatch.delenv("DUET_PREFILL_AUTOTUNE")
    args = _case(128, 8, 2, 16, torch.bfloat16, batch=LONG_BATCH)
    assert_close(prefill_attention(*args, 128 ** -0.5), prefill_attention_ref(*args, 128 ** -0.5))
    assert pa.last_autotuned_config(torch.bfloat16, 128) in tiles.CONFIGS_16BIT
