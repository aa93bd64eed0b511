"""gemm and w8a16_gemm (Triton) against gemm_ref / w8a16_gemm_ref.

Shapes cover decode-like M (1, 5), prefill-like M spanning several row tiles, N and K that are not
multiples of the tiles (masked K tail, wrapped M/N rows), per-channel and per-group int8 scales, split-K,
and the config heuristic by M that the GPU path uses.
"""
from __future__ import annotations

import pytest
import torch

from kernels import _triton_utils as tu
from kernels.gemm import (
    _GemmConfig,
    _launch_gemm,
    _pick_config,
    gemm,
    gemm_ref,
    quantize_weight_int8,
    w8a16_gemm,
    w8a16_gemm_ref,
)
from tests.kernels.paged import DEVICE, assert_close

SHAPES = [(1, 48, 64), (5, 70, 96), (70, 40, 100), (33, 64, 128)]  # (M, N, K)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _operands(m, n, k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype=dtype, device=DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype=dtype, device=DEVICE)  # |y| ~ N(0, 1)
    bias = torch.randn(n, generator=gen).to(dtype=dtype, device=DEVICE)
    return x, weight, bias


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_matches_reference(m, n, k, dtype):
    x, weight, bias = _operands(m, n, k, dtype)
    # the reference in fp32, rounded once to the output dtype, as the kernel does
    expected = gemm_ref(x.float(), weight.float(), bias.float()).to(dtype)
    assert_close(gemm(x, weight, bias), expected)
    assert_close(gemm(x, weight), gemm_ref(x.float(), weight.float()).to(dtype))


@pytest.mark.parametrize("group_size", [None, 16, 32], ids=["per-channel", "g16", "g32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (70, 40, 96)])
def test_w8a16_matches_reference(m, n, k, dtype, group_size):
    x, weight, bias = _operands(m, n, k, dtype)
    qweight, scales = quantize_weight_int8(weight, group_size)
    expected = w8a16_gemm_ref(x, qweight, scales, bias)
    assert_close(w8a16_gemm(x, qweight, scales, bias), expected)


def test_w8a16_is_close_to_the_float_gemm():
    """Sanity of the quantization itself: int8 per-group weights stay within ~1% of the float result."""
    x, weight, _ = _operands(4, 64, 128, torch.float32)
    qweight, scales = quantize_weight_int8(weight, 32)
    err = (w8a16_gemm(x, qweight, scales) - gemm_ref(x, weight)).abs().max()
    assert err < 0.02 * gemm_ref(x, weight).abs().max()


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("group_size", [None, 32])
def test_split_k(split_k, group_size):
    """The skinny-M path on GPU splits K across programs; forced here on a config with 16 x 32 x 32 tiles."""
    x, weight, bias = _operands(3, 40, 256, torch.float32, seed=1)
    cfg = _GemmConfig(16, 32, 32, 4, 1, split_k=split_k)
    assert_close(_launch_gemm(x, weight, None, bias, None, cfg), gemm_ref(x, weight, bias))
    qweight, scales = quantize_weight_int8(weight, group_size)
    out = _launch_gemm(x, qweight, scales, bias, group_size or 256, cfg)
    assert_close(out, w8a16_gemm_ref(x, qweight, scales, bias))


def test_leading_dims_and_strided_rows():
    x, weight, bias = _operands(12, 40, 64, torch.float32)
    x3 = x.view(3, 4, 64)
    assert_close(gemm(x3, weight, bias), gemm_ref(x3, weight, bias))
    wide = torch.randn(12, 80, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    rows = wide[:, 8:72]  # stride(0) = 80
    assert_close(gemm(rows, weight), gemm_ref(rows, weight))


def test_config_heuristic_by_m(monkeypatch):
    monkeypatch.setattr(tu, "INTERPRET", False)
    decode = _pick_config(1, 4096, 4096, torch.bfloat16, num_sms=132)
    prefill = _pick_config(4096, 4096, 4096, torch.bfloat16, num_sms=132)
    assert decode.block_m == 16 and decode.split_k > 1  # 64 column tiles alone would leave SMs idle
    assert prefill.block_m == 128 and prefill.block_n == 256 and prefill.split_k == 1
    assert _pick_config(64, 4096, 4096, torch.bfloat16, num_sms=132).block_m == 64


def _valid_gemm_args():
    x, weight, bias = _operands(4, 32, 64, torch.float16)
    return dict(x=x, weight=weight, bias=bias)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.update(weight=a["weight"][:, :32]), ValueError, "x has 64 input features but weight"),
    (lambda a: a.update(weight=a["weight"].float()), TypeError, "weight has dtype torch.float32 but x has"),
    (lambda a: a.update(bias=a["bias"][:5]), ValueError, "bias has shape"),
    (lambda a: a.update(bias=a["bias"].float()), TypeError, "bias has dtype"),
    (lambda a: a.update(x=a["x"][0]), ValueError, "x must have >= 2 dims"),
    (lambda a: a.update(x=a["x"].to(torch.int32)), TypeError, "x has dtype"),
    (lambda a: a.update(weight=a["weight"].t().contiguous().t()), ValueError, "weight must be contiguous"),
    (lambda a: a.update(bias=torch.zeros(32, dtype=torch.float16, device="meta")), ValueError, "bias is on meta"),
])
def test_gemm_rejects_bad_arguments_by_name(change, error, match):
    args = _valid_gemm_args()
    change(args)
    with pytest.raises(error, match=match):
        gemm(**args)


def _valid_w8a16_args():
    x, weight, bias = _operands(4, 32, 64, torch.float16)
    qweight, scales = quantize_weight_int8(weight, 32)
    return dict(x=x, qweight=qweight, scales=scales, bias=bias)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.update(qweight=a["qweight"].float()), TypeError, "qweight has dtype"),
    (lambda a: a.update(scales=a["scales"].half()), TypeError, "scales has dtype"),
    (lambda a: a.update(scales=a["scales"][:16]), ValueError, r"scales has shape \(16, 2\)"),
    (lambda a: a.update(scales=torch.ones(32, 3, device=DEVICE)), ValueError, "scales has shape"),
    (lambda a: a.update(scales=torch.ones(32, 8, device=DEVICE)), ValueError, "group_size 8 .* multiple of 16"),
    (lambda a: a.update(x=a["x"][:, :32]), ValueError, "x has 32 input features but qweight"),
])
def test_w8a16_rejects_bad_arguments_by_name(change, error, match):
    args = _valid_w8a16_args()
    change(args)
    with pytest.raises(error, match=match):
        w8a16_gemm(**args)
