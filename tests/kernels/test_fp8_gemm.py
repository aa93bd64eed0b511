"""kernels/fp8_gemm.py: FP8 checkpoints' W8A8 linears through ``torch._scaled_mm`` (oneDNN here; cuBLAS on a GPU).

``linear`` against ``linear_ref`` (the same quantized activations and weights in plain fp32, one matmul): within
fp32 summation order (1e-5 of the output's largest value), for each activation scheme and scale layout, block scales
whose blocks do not divide the weight included. The activation quantization itself against its definition: each
x within half an e4m3 step of xq * s (3 mantissa bits: 2^-4 relative, saturating at 448 * s), the row scale
amax / 448 (FBGEMM's capped), a static scale the checkpoint's. Fused pieces joined (engine/loading/hf_fp8.py
``join_rows``) give each piece's own output, bit for bit, and what one GEMM cannot do is refused.
"""
from __future__ import annotations

import pytest
import torch

from engine.loading.hf_fp8 import Fp8Weight, join_rows
from kernels import fp8_gemm


def weight(rows: int, cols: int, block: tuple[int, int] | None, per_row: bool, seed: int = 0, **kw) -> Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(rows, cols, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    if block is not None:
        shape = (-(-rows // block[0]), -(-cols // block[1]))
    else:
        shape = (rows, 1) if per_row else (1, 1)
    scale = torch.rand(shape, generator=g) * 0.01 + 1e-3
    return Fp8Weight(q, scale, block, **kw)


CASES = {
    "channel-dynamic-token": dict(block=None, per_row=True, activations="dynamic-token"),
    "tensor-static": dict(block=None, per_row=False, activations="static-tensor", input_scale=torch.tensor(0.02)),
    "channel-fbgemm-capped": dict(block=None, per_row=True, activations="dynamic-token", scale_ub=1.5),
    "block-48x40-dynamic-group": dict(block=(48, 40), per_row=False, activations="dynamic-group", group_size=40),
    "tensor-weight-only": dict(block=None, per_row=False, activations="none"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("m", [1, 7])
def test_linear_is_its_fp32_reference_within_summation_order(case, m):
    kw = dict(CASES[case])
    w = weight(100, 130, kw.pop("block"), kw.pop("per_row"), **kw)
    p = fp8_gemm.pack(w, w.activations, w.group_size, w.scale_ub)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 130, generator=g) * torch.logspace(-2, 1, m).reshape(-1, 1)
    bias = torch.randn(100, generator=g)
    y, ref = fp8_gemm.linear(x, p, bias), fp8_gemm.linear_ref(x, p, bias)
    assert y.dtype == torch.float32 and y.shape == (m, 100)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    dense = x @ fp8_gemm.dequantize(p).T + bias  # activations unquantized: the W8A16 answer, close, not equal
    assert not torch.equal(y, dense)
    if case != "tensor-static" and case != "channel-fbgemm-capped":  # nothing saturates
        assert ((y - dense).norm() / dense.norm()) < 0.05
    bf16, ref16 = fp8_gemm.linear(x.bfloat16(), p, bias), fp8_gemm.linear_ref(x.bfloat16(), p, bias)
    assert bf16.dtype == torch.bfloat16 and (bf16.float() - ref16).abs().max() <= 2 ** -8 * ref16.abs().max()


def test_activations_are_quantized_as_defined():
    w = weight(16, 64, None, True, activations="dynamic-token")
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(5)) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0]).reshape(-1, 1)
    xq, s = fp8_gemm.quantize_activations(x, fp8_gemm.pack(w, "dynamic-token"))
    amax = x.abs().amax(1, keepdim=True)
    assert torch.equal(s[amax > 0], (amax / 448)[amax > 0]) and torch.all(xq[3].float() == 0)
    err = (xq.float() * s - x).abs()
    assert torch.all(err <= 2 ** -4 * x.abs() + 2 ** -9 * s)  # half a step of 3 mantissa bits (subnormals: 2^-9)
    capped = fp8_gemm.pack(w, "dynamic-token", scale_ub=2.0)
    xq, s = fp8_gemm.quantize_activations(x, capped)
    assert torch.allclose(s[2], torch.tensor(2.0 / 448)) and xq[2].float().abs().max() == 448  # saturates
    static = fp8_gemm.pack(Fp8Weight(w.weight, w.scale, None, torch.tensor(0.05), "static-tensor"), "static-tensor")
    xq, s = fp8_gemm.quantize_activations(x, static)
    assert torch.all(s == 0.05) and xq[2].float().abs().max() == 448


def test_a_block_weight_needs_groups_of_its_block_columns():
    w = weight(96, 80, (48, 40), False)
    with pytest.raises(ValueError, match="needs activation groups of 40 columns"):
        fp8_gemm.pack(w, "dynamic-token")
    with pytest.raises(ValueError, match="x has 81 columns, the FP8 weight 80"):
        fp8_gemm.linear(torch.randn(2, 81), fp8_gemm.pack(w, "dynamic-group", 40))


@pytest.mark.parametrize("per_row", [True, False])
def test_joined_pieces_give_each_pieces_own_output(per_row):
    parts = [weight(r, 64, None, per_row, seed=r, activations="dynamic-token") for r in (32, 16, 16)]
    joined = join_rows(parts)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    one = fp8_gemm.linear(x, fp8_gemm.pack(joined, "dynamic-token"))
    each = torch.cat([fp8_gemm.linear(x, fp8_gemm.pack(p, "dynamic-token")) for p in parts], dim=1)
    assert torch.equal(one, each)
    blocks = [weight(r, 64, (16, 32), False, seed=r, activations="dynamic-group", group_size=32) for r in (32, 16, 8)]
    joined = join_rows(blocks)
    one = fp8_gemm.linear(x, fp8_gemm.pack(joined, "dynamic-group", 32))
    each = torch.cat([fp8_gemm.linear(x, fp8_gemm.pack(p, "dynamic-group", 32)) for p in blocks], dim=1)
    assert torch.equal(one, each)


def test_what_one_gemm_cannot_compute_is_not_joined():
    static = [Fp8Weight(weight(16, 64, None, False).weight, torch.ones(1, 1), None, torch.tensor(v), "static-tensor")
              for v in (0.1, 0.2)]
    assert join_rows(static) is None  # each piece quantizes x with its own input scale
    ragged = [weight(r, 64, (16, 32), False, activations="dynamic-group", group_size=32) for r in (24, 16)]
    assert join_rows(ragged) is None  # the first piece's last block is cut short
    mixed = [weight(16, 64, None, True, activations=a) for a in ("dynamic-token", "none")]
    assert join_rows(mixed) is None


def test_as_dense_is_the_dequantized_weight():
    w = weight(32, 64, None, True, activations="dynamic-token")
    p = fp8_gemm.as_dense(fp8_gemm.pack(w, "dynamic-token"), torch.float32)
    x = torch.randn(4, 64)
    assert p.weight.numel() == 0 and p.num_bytes == 32 * 64 * 4
    assert torch.equal(fp8_gemm.linear(x, p), torch.nn.functional.linear(x, w.weight.float() * w.scale))
