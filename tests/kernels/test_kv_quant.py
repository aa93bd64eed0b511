"""The quantized KV cache's layout and its torch references (kernels/kv_quant.py, the references' scale arguments):
a block is one range whose pages hold values then scales; a stored element is off by at most its derived bound
(int8: scale / 2); decode and prefill attention over a quantized cache stay within the bound derived in
tests/kernels/kv_quant_cases.py of attention over the fp32 cache."""
from __future__ import annotations

import pytest
import torch

from kernels import kv_quant
from kernels.decode_attention import paged_decode_attention_ref
from kernels.prefill_attention import prefill_attention_ref
from tests.kernels.kv_quant_cases import check_within_bound, element_bound, paged_case, random_kv, rows

DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def test_a_block_is_one_range_of_pages_values_then_scales():
    kv = kv_quant.allocate(3, 2, 4, 2, 8, torch.int8, "cpu")
    assert kv.shape == (3, 2, 2, 4 * 2 * (8 + 4)) and kv.is_contiguous()
    layer = kv_quant.layer_views(kv, 4, 2, 8)[1]
    layer.key[2, 3, 1] = torch.arange(1, 9, dtype=torch.int8)
    layer.value_scales[2, 3, 1] = 0.5
    raw = kv[2].view(-1)  # block 2, all layers, K and V: one range
    page = 4 * 2 * (8 + 4)
    k_page, v_page = raw[2 * page: 3 * page], raw[3 * page: 4 * page]  # layer 1's K, then its V
    assert k_page[(3 * 2 + 1) * 8: (3 * 2 + 2) * 8].tolist() == list(range(1, 9))  # token 3, head 1's values
    scales = v_page[4 * 2 * 8:].view(torch.float32)  # the values, then one fp32 scale per token and head
    assert scales.tolist() == [0.0] * 7 + [0.5]
    assert int(kv.count_nonzero()) == 8 + 1  # nothing else was touched (0.5 in fp32: one nonzero byte, 0x3f)


def test_views_refuse_a_page_of_another_geometry():
    with pytest.raises(ValueError, match="not 4 x 2"):
        kv_quant.layer_views(kv_quant.allocate(3, 2, 4, 2, 8, torch.int8, "cpu"), 4, 2, 16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_stored_element_is_within_its_bound(dtype):
    gen = torch.Generator().manual_seed(1)
    x = random_kv(64, 3, 64, gen)
    x[5, 1] = 0.0  # a zero row: scale 0, values 0
    values, scales = kv_quant.quantize_ref(x, dtype)
    assert values.dtype == dtype and scales.shape == (64, 3)
    assert torch.equal(scales, x.abs().amax(-1) / kv_quant.QMAX[dtype])
    err = (kv_quant.dequantize_ref(values, scales) - x).abs()
    assert bool((err <= element_bound(x, scales, dtype)).all())
    assert scales[5, 1] == 0 and not values[5, 1].float().any()
    if dtype == torch.int8:  # every row uses its range: the largest element is stored as +-127
        assert bool((values.abs().amax(-1)[scales > 0] == 127).all())


def test_int8_rounds_half_to_even_and_keeps_the_sign():
    x = torch.tensor([[[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -127.0, 3.0]]])  # scale exactly 1
    values, scales = kv_quant.quantize_ref(x, torch.int8)
    assert scales.item() == 1.0 and values.flatten().tolist() == [127, 0, 2, 2, 0, -2, -127, 3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_store_writes_each_row_with_its_scale(dtype):
    _, tables, dense, quant = paged_case(dtype, 32, 2, 16, [40, 7], seed=2)
    for s, n in enumerate([40, 7]):
        k, v = rows(dense, tables[s], n)
        k_hat, v_hat = rows(quant, tables[s], n)
        ks = quant.key_scales.index_select(0, tables[s, : -(-n // 16)].long()).reshape(-1, 2)[:n]
        assert bool(((k_hat - k).abs() <= element_bound(k, ks, dtype)).all())
        assert torch.equal(ks, k.abs().amax(-1) / kv_quant.QMAX[dtype])
        assert not torch.equal(v_hat, v)  # quantized: not the fp32 values


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 20])
def test_decode_reference_is_within_the_derived_bound(dtype, window):
    seq_lens, scale = [1, 37, 90], 64 ** -0.5
    gen, tables, dense, quant = paged_case(dtype, 64, 3, 16, seq_lens, seed=3)
    q = torch.randn(3, 9, 64, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    exact = paged_decode_attention_ref(q, dense.key, dense.value, tables, lens, scale, window)
    out = paged_decode_attention_ref(q, quant.key, quant.value, tables, lens, scale, window, **quant.scales)
    worst = check_within_bound(out, q, exact, dense, quant, tables, seq_lens, [0, 1, 2, 3], scale, window)
    assert 0 < worst <= 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_reference_is_within_the_derived_bound(dtype):
    seq_lens, cu, scale = [30, 21], [0, 12, 33], 32 ** -0.5  # sequence 0 continues a cached prefix of 18
    gen, tables, dense, quant = paged_case(dtype, 32, 2, 8, seq_lens, seed=4)
    q = torch.randn(33, 4, 32, generator=gen)
    cu_t, lens = torch.tensor(cu, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    exact = prefill_attention_ref(q, dense.key, dense.value, tables, cu_t, lens, scale)
    out = prefill_attention_ref(q, quant.key, quant.value, tables, cu_t, lens, scale, **quant.scales)
    check_within_bound(out, q, exact, dense, quant, tables, seq_lens, cu, scale, None)


def test_a_wrong_scale_breaks_the_bound():
    """The bound can fail: attention that reads every key scale doubled lands outside it (it is a worst case, 20 to
    1,000 times the error of a right kernel in these cases, so a wrong block or head is caught by the kernels'
    comparison with the reference at fp32 tolerance, tests/kernels/test_cpu_kv_int8.py)."""
    seq_lens, scale = [48], 64 ** -0.5
    gen, tables, dense, quant = paged_case(torch.int8, 64, 1, 16, seq_lens, seed=5)
    q = torch.randn(1, 2, 64, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    exact = paged_decode_attention_ref(q, dense.key, dense.value, tables, lens, scale)
    wrong = quant.key_scales * 2
    out = paged_decode_attention_ref(q, quant.key, quant.value, tables, lens, scale, key_scales=wrong,
                                     value_scales=quant.value_scales)
    with pytest.raises(AssertionError, match="over the bound"):
        check_within_bound(out, q, exact, dense, quant, tables, seq_lens, [0, 1], scale, None)
