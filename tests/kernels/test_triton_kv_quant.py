"""The Triton kernels over a quantized KV cache (kernels/store_kv.py, kernels/_paged_kv.py's tile steps through
kernels/decode_attention.py and kernels/prefill_attention.py) against the torch references of the same KV dtype, in
the Triton interpreter on a CPU (on a CUDA machine the same tests run the compiled kernels).

The store writes the bytes the reference writes, values and scales, for int8 and both fp8s, from fp32, fp16 and bf16
rows: the tests compare whole cache tensors, including every rounding tie of each stored grid (``quantize_ref``
rounds half to even, torch's fp8 casts too). Attention reads the same dequantized values as the reference (value ×
scale in fp32) and differs only by fp32 sums in another order: the fp32 tolerance of tests/kernels/test_cpu_kv_int8.py
(2e-5, taken relative to the largest value: rows are scaled by up to 10x so that their scales differ), bf16 /
fp16 queries one output ulp as tests/kernels/paged.py's; a wrong scale, row, block or head gives errors of order 1e-1
(``test_a_wrong_scale_is_caught``). One case per dtype also stays within tests/kernels/kv_quant_cases.py's bound of
attention over the fp32 cache.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels import _triton_utils as tu
from kernels import kv_quant
from kernels.decode_attention import _paged_decode_attention, paged_decode_attention, paged_decode_attention_ref
from kernels.prefill_attention import prefill_attention, prefill_attention_ref
from kernels.prefill_tiles import configs_for
from kernels.store_kv import store_kv, store_kv_ref
from tests.kernels.kv_quant_cases import check_within_bound, fresh_case, paged_case, random_kv
from tests.kernels.paged import DEVICE, TOLERANCES

DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
IDS = ["int8", "e4m3", "e5m2"]


def assert_close(out: torch.Tensor, ref: torch.Tensor, values: torch.Tensor) -> None:
    """fp32 sums in another order (2e-5), or one output ulp of a 16-bit q, relative to the largest value."""
    tol = TOLERANCES[ref.dtype]["atol"] * max(1.0, float(values.float().abs().max()))
    torch.testing.assert_close(out.cpu(), ref, rtol=TOLERANCES[ref.dtype]["rtol"], atol=tol)


def on_device(layer: kv_quant.LayerKV) -> kv_quant.LayerKV:
    return layer if DEVICE.type == "cpu" else kv_quant.LayerKV(*(t.to(DEVICE) for t in layer))


def _stores(k, v, slots, dtype, num_blocks=8, block_size=16):
    """(the Triton store's cache, the reference's) after storing k, v at ``slots`` into layer 1 of 2."""
    kv_heads, head_dim = k.shape[1:]
    mine = kv_quant.allocate(num_blocks, 2, block_size, kv_heads, head_dim, dtype, DEVICE)
    ref = kv_quant.allocate(num_blocks, 2, block_size, kv_heads, head_dim, dtype, "cpu")
    a, b = (kv_quant.layer_views(c, block_size, kv_heads, head_dim)[1] for c in (mine, ref))
    store_kv(k.to(DEVICE), v.to(DEVICE), a.key, a.value, slots.to(DEVICE), **a.scales)
    store_kv_ref(k, v, b.key, b.value, slots, **b.scales)
    return mine.cpu().view(torch.uint8), ref.view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_store_writes_the_reference_bytes(dtype, x_dtype):
    gen = torch.Generator().manual_seed(7)
    qkv = random_kv(40, 3 + 2 + 2, 80, gen).to(x_dtype)  # K and V: strided views of a fused buffer
    k, v = qkv[:, 3:5], qkv[:, 5:7]
    k[3, 0] = 0.0  # a zero row: scale 0, values 0
    v[4, 1] = -0.0  # fp8 keeps the sign of a zero, as torch's cast does
    slots = torch.randperm(8 * 16, generator=gen)[:40]
    slots[7] = -1  # a padding token writes nothing
    mine, ref = _stores(k, v, slots, dtype)
    assert torch.equal(mine, ref)
    assert int(ref[:, 0].count_nonzero()) == 0 and int(ref[:, 1].count_nonzero()) > 0  # layer 1 only


def _ties(dtype: torch.dtype) -> torch.Tensor:
    """Every midpoint between adjacent non-negative values of the stored grid, and the fp32 numbers either side of
    it, with both signs: where round-half-to-even and a mishandled carry (e.g. 7.97 -> 8 in e4m3) show."""
    if dtype == torch.int8:
        grid = torch.arange(0, 128, dtype=torch.float32)
    else:
        every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
        grid = every[torch.isfinite(every) & (every >= 0)].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mid, torch.nextafter(mid, grid[1:]), torch.nextafter(mid, grid[:-1])])
    return torch.cat([near, -near])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_store_rounds_every_tie_as_the_reference(dtype):
    """Rows whose first element is +-qmax have scale exactly 1, so the quotient is the value itself: every tie of
    the grid is stored as ``quantize_ref`` stores it (int8: half to even; fp8: torch's cast)."""
    qmax = kv_quant.QMAX[dtype]
    values = _ties(dtype)
    head_dim = 64
    rows = -(-values.numel() // (head_dim - 1))
    x = torch.zeros(rows * (head_dim - 1))
    x[: values.numel()] = values
    x = torch.cat([torch.full((rows, 1), qmax), x.view(rows, head_dim - 1)], dim=1)
    k = x.view(rows, 1, head_dim)
    mine, ref = _stores(k, -k, torch.arange(rows), dtype, num_blocks=-(-rows // 16))
    assert torch.equal(mine, ref)
    scales = kv_quant.layer_views(ref.view(dtype), 16, 1, head_dim)[1].key_scales
    assert bool((scales.flatten()[:rows] == 1.0).all())


def _poisoned(layer: kv_quant.LayerKV, tables: torch.Tensor, seq_lens: list[int]) -> kv_quant.LayerKV:
    """The layer's scales with NaN in every slot outside the sequences, in place: a kernel reading a row it should
    not returns NaN (the references gather whole blocks, so they run before)."""
    block_size = layer.key.shape[1]
    keep = torch.zeros(layer.key_scales.shape[:2], dtype=torch.bool)
    for s, n in enumerate(seq_lens):
        for p in range(n):
            keep[int(tables[s, p // block_size]), p % block_size] = True
    for scales in (layer.key_scales, layer.value_scales):
        scales[~keep.to(scales.device)] = float("nan")
    return layer


DECODE_HEADS = [(64, 9, 3), (32, 4, 4), (80, 8, 1)]  # (head_dim, q heads, kv heads): GQA 3, MHA, MQA with a tail


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", DECODE_HEADS)
@pytest.mark.parametrize("window", [None, 20])
def test_decode_matches_the_reference(dtype, head_dim, q_heads, kv_heads, window):
    """One partition (what the launcher picks here) and the split path with its reduce (partitions of 32)."""
    seq_lens = [1, 37, 90]
    gen, tables, dense, quant = paged_case(dtype, head_dim, kv_heads, 16, seq_lens, seed=head_dim + kv_heads)
    q = torch.randn(len(seq_lens), q_heads, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    ref = paged_decode_attention_ref(q, quant.key, quant.value, tables, lens, scale, window, **quant.scales)
    dq, args = _poisoned(on_device(quant), tables, seq_lens), (q.to(DEVICE), tables.to(DEVICE), lens.to(DEVICE))
    single = paged_decode_attention(args[0], dq.key, dq.value, *args[1:], scale, window, **dq.scales)
    split = _paged_decode_attention(args[0], dq.key, dq.value, *args[1:], scale, window, partition_size=32,
                                    tile_n=32, **dq.scales)
    assert_close(single, ref, dense.value)
    assert_close(split, ref, dense.value)
    if (head_dim, window) == (64, None):  # the bound's loops are Python: one configuration per dtype
        exact = paged_decode_attention_ref(q, dense.key, dense.value, tables, lens, scale, window)
        check_within_bound(split.cpu(), q, exact, dense, quant, tables, seq_lens, [0, 1, 2, 3], scale, window)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_with_16_bit_queries_and_a_soft_cap(dtype, q_dtype):
    seq_lens = [5, 70, 41]
    gen, tables, dense, quant = paged_case(dtype, 64, 2, 8, seq_lens, seed=11)
    q = torch.randn(len(seq_lens), 14, 64, generator=gen).to(q_dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ref = paged_decode_attention_ref(q, quant.key, quant.value, tables, lens, 0.125, None, 5.0, **quant.scales)
    dq = on_device(quant)
    out = _paged_decode_attention(q.to(DEVICE), dq.key, dq.value, tables.to(DEVICE), lens.to(DEVICE), 0.125, None,
                                  partition_size=32, tile_n=32, softcap=5.0, **dq.scales)
    assert out.dtype == q_dtype
    assert_close(out, ref, dense.value)


# (new tokens, context incl. them): fresh prompts, a continuation of a cached prefix, one new token
PREFILL_SHAPES = [(5, 5), (40, 100), (1, 9), (33, 33)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("block_size", [16, 8], ids=["tile-in-block", "tile-spans-blocks"])
@pytest.mark.parametrize("window", [None, 24])
def test_prefill_matches_the_reference(dtype, block_size, window):
    """The interpreter's tiles are 32 queries x 16 keys: a block of 16 holds a tile (one table read), one of 8 does
    not (a block id per token); 100 keys give full tiles, the diagonal and, with a window, its lower edge."""
    q_lens, seq_lens = [a for a, _ in PREFILL_SHAPES], [b for _, b in PREFILL_SHAPES]
    gen, tables, dense, quant = paged_case(dtype, 32, 2, block_size, seq_lens, seed=block_size)
    q = torch.randn(sum(q_lens), 6, 32, generator=gen)
    cu = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    cu_t, lens = torch.tensor(cu, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    scale = 32 ** -0.5
    ref = prefill_attention_ref(q, quant.key, quant.value, tables, cu_t, lens, scale, window, **quant.scales)
    dq = _poisoned(on_device(quant), tables, seq_lens)
    out = prefill_attention(q.to(DEVICE), dq.key, dq.value, tables.to(DEVICE), cu_t.to(DEVICE), lens.to(DEVICE),
                            scale, window, **dq.scales)
    assert_close(out, ref, dense.value)
    if block_size == 16 and window is None:
        exact = prefill_attention_ref(q, dense.key, dense.value, tables, cu_t, lens, scale, window)
        check_within_bound(out.cpu(), q, exact, dense, quant, tables, seq_lens, cu, scale, window)


def test_prefill_with_bf16_queries_and_a_soft_cap():
    gen, tables, dense, quant = paged_case(torch.int8, 64, 1, 16, [50], seed=12)
    q = torch.randn(20, 4, 64, generator=gen).to(torch.bfloat16)
    cu_t, lens = torch.tensor([0, 20], dtype=torch.int32), torch.tensor([50], dtype=torch.int32)
    ref = prefill_attention_ref(q, quant.key, quant.value, tables, cu_t, lens, 0.125, None, 3.0, **quant.scales)
    dq = on_device(quant)
    out = prefill_attention(q.to(DEVICE), dq.key, dq.value, tables.to(DEVICE), cu_t.to(DEVICE), lens.to(DEVICE),
                            0.125, None, 3.0, **dq.scales)
    assert_close(out, ref, dense.value)


def test_a_wrong_scale_is_caught():
    """The comparison can fail: the kernel given one token's key scale doubled is far outside the tolerance."""
    seq_lens = [30]
    gen, tables, dense, quant = paged_case(torch.int8, 64, 1, 16, seq_lens, seed=13)
    q = torch.randn(1, 2, 64, generator=gen) * 4
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ref = paged_decode_attention_ref(q, quant.key, quant.value, tables, lens, 0.125, **quant.scales)
    wrong = on_device(quant)
    wrong.key_scales[int(tables[0, 1]), 3] *= 2  # token 19
    out = paged_decode_attention(q.to(DEVICE), wrong.key, wrong.value, tables.to(DEVICE), lens.to(DEVICE), 0.125,
                                 **wrong.scales)
    with pytest.raises(AssertionError):
        assert_close(out, ref, dense.value)


def test_launchers_refuse_a_quantized_cache_without_its_scales():
    gen, tables, dense, quant = paged_case(torch.int8, 64, 2, 16, [20, 30], seed=1)
    q, lens = torch.randn(2, 4, 64, generator=gen), torch.tensor([20, 30], dtype=torch.int32)
    args = (q.to(DEVICE), tables.to(DEVICE), lens.to(DEVICE))
    dq, dd = on_device(quant), on_device(dense)

    def decode(layer, **scales):
        return paged_decode_attention(args[0], layer.key, layer.value, *args[1:], 0.125, **scales)

    with pytest.raises(TypeError, match="key_cache has dtype torch.int8, a quantized KV cache: pass key_scales"):
        decode(dq)
    with pytest.raises(ValueError, match="only key_scales was given"):
        decode(dq, key_scales=dq.key_scales)
    with pytest.raises(ValueError, match="value_scales has shape"):
        decode(dq, key_scales=dq.key_scales, value_scales=dq.value_scales[:, :8])
    with pytest.raises(TypeError, match="key_scales has dtype torch.float16"):
        decode(dq, key_scales=dq.key_scales.half(), value_scales=dq.value_scales)
    with pytest.raises(ValueError, match="key_scales strides"):
        decode(dq, key_scales=dq.key_scales.contiguous(), value_scales=dq.value_scales)
    with pytest.raises(TypeError, match="key_cache has dtype torch.float32, expected one of"):
        decode(dd, **dq.scales)  # scales with a dense cache
    k = torch.randn(1, 2, 64, device=DEVICE)
    with pytest.raises(TypeError, match="key_cache has dtype torch.int8, a quantized KV cache"):
        store_kv(k, k, dq.key, dq.value, torch.tensor([3], device=DEVICE))


@triton.jit
def _plain_cast_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs).to(out_ptr.dtype.element_ty))


@pytest.mark.skipif(not tu.INTERPRET, reason="documents the Triton interpreter's fp8 cast (the compiled one is PTX's)")
def test_the_interpreters_own_fp8_cast_is_why_the_store_rounds_first():
    """Triton 3.9's interpreter casts fp32 -> fp8 with a lost rounding carry (7.97 -> 4.0 in e4m3): kernels/store_kv.py
    rounds onto the grid in fp32 first, so that the cast it runs is exact in the interpreter and on a GPU alike. Of
    4,096 N(0, 10) values (seed 0) the plain cast stores other bytes than torch's for 106 (e4m3) and 206 (e5m2),
    printed by ``pytest -s -k interpreters_own``."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 10
    x[0] = 7.97
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        out = torch.empty(4096, dtype=dtype)
        _plain_cast_kernel[(1,)](x, out, N=4096)
        bad = out.view(torch.uint8) != x.to(dtype).view(torch.uint8)
        print(f"the interpreter's plain cast to {dtype}: {int(bad.sum())} of 4096 bytes differ from torch's")
        assert float(out[0]) == 4.0 and float(x[0].to(dtype)) == 8.0
        assert int(bad.sum()) > 0


# (new tokens, context incl. them): prompts without a cached prefix, continuations (the 40 new ones start mid-tile)
FRESH_SHAPES = [(5, 5), (40, 100), (33, 33), (1, 9)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("block_size", [16, 8], ids=["tile-in-block", "tile-spans-blocks"])
@pytest.mark.parametrize("window", [None, 24])
def test_prefill_with_fresh_kv_matches_the_reference_and_a_dense_cache(dtype, block_size, window):
    """Fresh K/V (kernels/_paged_kv.py): the tile step loads a marked sequence's new positions from their rows as
    computed, scale 1, and never reads their cache rows (their scales are NaN here). Within fp32 reordering of the
    reference; for the sequences without a cached prefix, bit for bit the kernel's own output over a dense cache holding
    the same rows (the same tile config: the same dots on the same floats, products by 1)."""
    case = fresh_case(dtype, 32, 6, 2, block_size, FRESH_SHAPES, seed=block_size)
    marks = torch.tensor([1, 1, 1, 0], dtype=torch.int32)
    fresh = dict(fresh_key=case.fresh_key, fresh_value=case.fresh_value, fresh_seqs=marks)
    ref = prefill_attention_ref(*case.kernel_args(case.quant), 0.2, window, **case.quant.scales, **fresh)
    dq = _poisoned(on_device(case.quant), case.tables, [n - (new if m else 0) for (new, n), m in
                                                       zip(FRESH_SHAPES, marks.tolist())])
    dev = [t.to(DEVICE) for t in (case.q, case.tables, case.cu, case.lens)]
    on = {name: t.to(DEVICE) for name, t in fresh.items()}
    config = configs_for(case.q.dtype, 32)[0]
    out = prefill_attention(dev[0], dq.key, dq.value, *dev[1:], 0.2, window, **dq.scales, **on, config=config)
    assert_close(out, ref, case.dense.value)
    dd = on_device(case.dense)
    dense = prefill_attention(dev[0], dd.key, dd.value, *dev[1:], 0.2, window, config=config)
    cu = case.cu.tolist()
    for s in (0, 2):
        assert torch.equal(out[cu[s]:cu[s + 1]], dense[cu[s]:cu[s + 1]]), s
    dense_fresh = prefill_attention(dev[0], dd.key, dd.value, *dev[1:], 0.2, window, **on, config=config)
    assert_close(dense_fresh, dense.cpu(), case.dense.value)  # a dense cache's rows are the fresh rows
