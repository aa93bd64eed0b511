"""The CPU path's 1-byte KV kernels — int8, fp8 e4m3, fp8 e5m2 — (kernels/cpu_kv_int8.py, kernels/cpu/attention_kv8.c)
against the torch references on the same cache, and against attention over the fp32 cache within the bound derived
in tests/kernels/kv_quant_cases.py.

The store writes the bytes the reference writes (the same fp32 quotient, rounded half to even; for fp8 every
representable value and every midpoint between neighbours, subnormals included, in both signs). Attention reads the
same dequantized values as the reference (value × scale, one fp32 product; an fp8 byte converted exactly), so the
two differ only by fp32 sums in
another order: the fp32 tolerance of the other kernel tests (tests/kernels/paged.py, 2e-5), taken relative to the
largest value here (the rows are scaled by up to 10x so that their scales differ), while a wrong scale, row, block or
head gives errors of order 1e-1. Cases as tests/kernels/test_cpu_native.py's: scattered tables, ragged
lengths, GQA groups 1 to 8, head dims 64, 128 and with an 8-column tail (80), windows, a task per sequence and per
KV head, keys split into chunks, prefills that continue a prefix and run past the 64-token chunks and 256-key tiles.
"""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_kv_int8, cpu_native, kv_quant
from kernels.decode_attention import paged_decode_attention_ref
from kernels.prefill_attention import prefill_attention_ref
from kernels.store_kv import store_kv_ref
from tests.kernels.kv_quant_cases import check_within_bound, fresh_case, paged_case, random_kv

HEADS = [(64, 9, 3), (64, 4, 4), (80, 8, 2), (128, 8, 2), (32, 4, 2), (64, 12, 2), (16, 8, 1)]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# every head shape on int8; the fp8 instantiations (the same template, another conversion) on three
DECODE_CASES = [(torch.int8, *h) for h in HEADS] + [(dt, *h) for dt in FP8 for h in HEADS[:3]]


def assert_close(out: torch.Tensor, ref: torch.Tensor, values: torch.Tensor) -> None:
    """fp32 sums in another order: 2e-5 of the largest value the attention averages."""
    tol = 2e-5 * max(1.0, float(values.float().abs().max()))
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=tol)


def _setup(head_dim, kv_heads, block_size, seq_lens, seed, dtype=torch.int8):
    return paged_case(dtype, head_dim, kv_heads, block_size, seq_lens, seed)


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_store_rounds_every_value_and_tie_as_torch_casts(dtype):
    """Rows whose largest |x| is the format's max (scale exactly 1, so x / scale is x): every positive finite value
    of the format, every midpoint between neighbours (ties: half to even) and their negatives, then random values."""
    qmax = kv_quant.QMAX[dtype]
    grid = torch.arange(0, 128, dtype=torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid) & (grid <= qmax)].sort().values
    vals = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    vals = torch.cat([vals, -vals, (torch.randn(1000, generator=torch.Generator().manual_seed(1)) * qmax / 3)
                      .clamp(-qmax, qmax)])
    n = -(-len(vals) // 63)
    body = torch.zeros(n * 63)
    body[:len(vals)] = vals
    rows = torch.cat([torch.full((n, 1), qmax), body.reshape(n, 63)], dim=1).reshape(n, 1, 64)
    mine, ref = (kv_quant.allocate(-(-n // 16), 1, 16, 1, 64, dtype, "cpu") for _ in range(2))
    a, b = (kv_quant.layer_views(c, 16, 1, 64)[0] for c in (mine, ref))
    cpu_kv_int8.store_kv(rows, rows, a.key, a.value, torch.arange(n), **a.scales)
    store_kv_ref(rows, rows, b.key, b.value, torch.arange(n), **b.scales)
    assert torch.equal(mine.view(torch.uint8), ref.view(torch.uint8))
    assert torch.all(a.key_scales.reshape(-1)[:n] == 1)
    assert torch.equal(a.key.float().reshape(-1, 64)[:n, 1:].reshape(-1)[:len(grid)], grid)  # exact on the grid


@pytest.mark.parametrize("dtype", [torch.int8, *FP8])
@pytest.mark.parametrize("head_dim,kv_heads", [(64, 3), (128, 2), (80, 1)])
def test_store_writes_the_reference_bytes(head_dim, kv_heads, dtype):
    gen = torch.Generator().manual_seed(head_dim)
    k, v = random_kv(40, kv_heads, head_dim, gen), random_kv(40, kv_heads, head_dim, gen)
    k[3, 0] = 0.0  # a zero row: scale 0, zeros
    slots = torch.randperm(8 * 16, generator=gen)[:40]
    slots[7] = -1  # a padding token writes nothing
    mine = kv_quant.allocate(8, 2, 16, kv_heads, head_dim, dtype, "cpu")
    ref = kv_quant.allocate(8, 2, 16, kv_heads, head_dim, dtype, "cpu")
    a, b = (kv_quant.layer_views(c, 16, kv_heads, head_dim)[1] for c in (mine, ref))
    cpu_kv_int8.store_kv(k, v, a.key, a.value, slots, **a.scales)
    store_kv_ref(k, v, b.key, b.value, slots, **b.scales)
    assert torch.equal(mine.view(torch.uint8), ref.view(torch.uint8))
    assert int(mine[:, 0].view(torch.uint8).count_nonzero()) == 0  # layer 0 untouched
    block, offset = divmod(int(slots[3]), 16)
    assert a.key_scales[block, offset, 0] == 0 and not a.key[block, offset, 0].view(torch.uint8).any()
    assert int(sum(int(s >= 0) for s in slots)) * kv_heads == int((a.key_scales > 0).sum()) + 1  # the rest stored


@pytest.mark.parametrize("dtype,head_dim,q_heads,kv_heads", DECODE_CASES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("num_seqs", [1, 6])  # 2 threads: 6 sequences -> a task per sequence; 1 -> per KV head
def test_decode_matches_the_reference(dtype, head_dim, q_heads, kv_heads, block_size, window, num_seqs,
                                      two_threads):
    seq_lens = [1, 7, 33, 100, 16, 257] if num_seqs == 6 else [295]  # 295 keys on 2 threads: split in chunks
    gen, tables, dense, quant = _setup(head_dim, kv_heads, block_size, seq_lens, seed=head_dim + block_size,
                                       dtype=dtype)
    qkv = torch.randn(len(seq_lens), (q_heads + 2 * kv_heads) * head_dim, generator=gen)  # q: a strided view
    q = qkv[:, : q_heads * head_dim].reshape(len(seq_lens), q_heads, head_dim)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    out = cpu_kv_int8.paged_decode_attention(q, quant.key, quant.value, tables, lens, scale, window, **quant.scales)
    assert_close(out, paged_decode_attention_ref(q, quant.key, quant.value, tables, lens, scale, window,
                                                 **quant.scales), dense.value)
    exact = paged_decode_attention_ref(q, dense.key, dense.value, tables, lens, scale, window)
    check_within_bound(out, q, exact, dense, quant, tables, seq_lens, list(range(len(seq_lens) + 1)), scale, window)


@pytest.mark.parametrize("dtype,head_dim,q_heads,kv_heads", [
    (torch.int8, 64, 9, 3), (torch.int8, 128, 8, 2), (torch.int8, 80, 8, 2), (torch.int8, 32, 4, 4),
    (torch.float8_e4m3fn, 64, 9, 3), (torch.float8_e5m2, 80, 8, 2)])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_the_reference(dtype, head_dim, q_heads, kv_heads, window, block_size, two_threads):
    # (new tokens, context incl. them): fresh prompts, continuations of a cached prefix, past 64-token chunks and
    # 256-key tiles
    shapes = [(5, 5), (1, 9), (40, 100), (130, 300), (70, 400)]
    q_lens, seq_lens = [a for a, _ in shapes], [b for _, b in shapes]
    gen, tables, dense, quant = _setup(head_dim, kv_heads, block_size, seq_lens, seed=head_dim + 1, dtype=dtype)
    q = torch.randn(sum(q_lens), q_heads, head_dim, generator=gen)
    cu = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    cu_t, lens = torch.tensor(cu, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    out = cpu_kv_int8.prefill_attention(q, quant.key, quant.value, tables, cu_t, lens, scale, window, **quant.scales)
    assert_close(out, prefill_attention_ref(q, quant.key, quant.value, tables, cu_t, lens, scale, window,
                                            **quant.scales), dense.value)
    if head_dim == 64 and block_size == 16:  # the bound's loops are Python: one configuration
        exact = prefill_attention_ref(q, dense.key, dense.value, tables, cu_t, lens, scale, window)
        check_within_bound(out, q, exact, dense, quant, tables, seq_lens, cu, scale, window)


def test_head_sizes_off_the_vector_path_run_the_references_and_say_so(caplog):
    gen, tables, _, quant = _setup(20, 1, 16, [30, 5], seed=9)
    q = torch.randn(2, 4, 20, generator=gen)
    lens = torch.tensor([30, 5], dtype=torch.int32)
    with caplog.at_level("WARNING", logger="kernels.cpu_kv_int8"):
        out = cpu_kv_int8.paged_decode_attention(q, quant.key, quant.value, tables, lens, 0.2, **quant.scales)
    assert "head_dim 20 (not a multiple of 8)" in caplog.text
    assert torch.equal(out, paged_decode_attention_ref(q, quant.key, quant.value, tables, lens, 0.2,
                                                       **quant.scales))


def test_kernels_refuse_a_cache_that_is_not_int8_with_its_scales():
    gen, tables, dense, quant = _setup(64, 2, 16, [20, 30], seed=1)
    q = torch.randn(2, 4, 64, generator=gen)
    lens = torch.tensor([20, 30], dtype=torch.int32)
    with pytest.raises(TypeError, match="key_cache"):
        cpu_kv_int8.paged_decode_attention(q, dense.key, dense.value, tables, lens, 0.125, **quant.scales)
    with pytest.raises(ValueError, match="value_scales"):
        cpu_kv_int8.paged_decode_attention(q, quant.key, quant.value, tables, lens, 0.125,
                                           key_scales=quant.key_scales, value_scales=quant.value_scales[:, :8])
    bad = tables.clone()
    bad[1, 0] = quant.key.shape[0]
    with pytest.raises(ValueError, match="outside"):
        cpu_kv_int8.paged_decode_attention(q, quant.key, quant.value, bad, lens, 0.125, **quant.scales)
    with pytest.raises(ValueError, match="slot_mapping"):
        k = torch.randn(1, 2, 64)
        cpu_kv_int8.store_kv(k, k, quant.key, quant.value, torch.tensor([10 ** 6]), **quant.scales)


# (new tokens, context incl. them): prompts without a cached prefix (one past the 64-token chunks and a 256-key tile),
# continuations of a cached prefix (one crossing a 256-key tile), one new token
FRESH_SHAPES = [(5, 5), (40, 100), (300, 300), (130, 400), (1, 9)]


@pytest.mark.parametrize("dtype", [torch.int8, *FP8])
@pytest.mark.parametrize("window", [None, 100])
def test_prefill_with_fresh_kv_matches_the_reference_and_an_fp32_cache(dtype, window, two_threads):
    """Fresh K/V (kernels/prefill_attention.py): a marked sequence's new tokens are read from their rows as computed
    (strided views of a fused q|k|v buffer), its cached prefix from the 1-byte cache. Against the reference within
    fp32 reordering; a sequence without a cached prefix gives exactly the fp32 kernel's output over an fp32 cache
    holding the same rows (the same task loop on the same floats), and so does the reference against its own dense
    run; an unmarked sequence reads the cache alone, as without fresh K/V."""
    case = fresh_case(dtype, 64, 9, 3, 16, FRESH_SHAPES, seed=5)
    marks = torch.tensor([1, 1, 1, 1, 0], dtype=torch.int32)
    fresh = dict(fresh_key=case.fresh_key, fresh_value=case.fresh_value, fresh_seqs=marks)
    args, scales = case.kernel_args(case.quant), case.quant.scales
    out = cpu_kv_int8.prefill_attention(*args, 0.125, window, **scales, **fresh)
    ref = prefill_attention_ref(*args, 0.125, window, **scales, **fresh)
    assert_close(out, ref, case.dense.value)
    fp32 = cpu_native.prefill_attention(*case.kernel_args(case.dense), 0.125, window)
    fp32_ref = prefill_attention_ref(*case.kernel_args(case.dense), 0.125, window)
    cu = case.cu.tolist()
    for s in (0, 2):  # no cached prefix: bit for bit
        assert torch.equal(out[cu[s]:cu[s + 1]], fp32[cu[s]:cu[s + 1]]), s
        assert torch.equal(ref[cu[s]:cu[s + 1]], fp32_ref[cu[s]:cu[s + 1]]), s
    for s in (1, 3):  # a cached prefix read as stored (quantized): not the fp32 cache's output
        assert not torch.allclose(out[cu[s]:cu[s + 1]], fp32[cu[s]:cu[s + 1]], atol=1e-3), s
    cache_only = cpu_kv_int8.prefill_attention(*args, 0.125, window, **scales)
    assert torch.equal(out[cu[4]:], cache_only[cu[4]:])
    assert not torch.allclose(out[:cu[1]], cache_only[:cu[1]], atol=1e-3)  # marked: not the cache's rows


def test_fresh_rows_are_read_instead_of_the_cache(two_threads):
    """The new tokens' cache rows are not read: with their scales NaN the output is finite and unchanged. Fresh K/V
    needs both rows and their dtype; fresh_seqs None marks every sequence."""
    case = fresh_case(torch.int8, 64, 4, 2, 16, [(20, 20), (30, 50)], seed=6)
    args, fresh = case.kernel_args(case.quant), dict(fresh_key=case.fresh_key, fresh_value=case.fresh_value)
    want = cpu_kv_int8.prefill_attention(*args, 0.125, **case.quant.scales, **fresh)
    poisoned = kv_quant.LayerKV(case.quant.key, case.quant.value, case.quant.key_scales.clone(),
                                case.quant.value_scales.clone())
    for s, (n, new) in enumerate(((20, 20), (50, 30))):
        for p in range(n - new, n):
            block, offset = int(case.tables[s, p // 16]), p % 16
            poisoned.key_scales[block, offset] = poisoned.value_scales[block, offset] = float("nan")
    out = cpu_kv_int8.prefill_attention(*args, 0.125, **poisoned.scales, **fresh)
    assert torch.isfinite(out).all() and torch.equal(out, want)
    with pytest.raises(ValueError, match="only fresh_key was given"):
        cpu_kv_int8.prefill_attention(*args, 0.125, **case.quant.scales, fresh_key=case.fresh_key)
    with pytest.raises(TypeError, match="fresh_value has dtype torch.float16"):
        cpu_kv_int8.prefill_attention(*args, 0.125, **case.quant.scales, fresh_key=case.fresh_key,
                                      fresh_value=case.fresh_value.half())
    with pytest.raises(ValueError, match="fresh_seqs has shape"):
        cpu_kv_int8.prefill_attention(*args, 0.125, **case.quant.scales, **fresh,
                                      fresh_seqs=torch.ones(3, dtype=torch.int32))
