"""int8 activations' prefill on bf16 tiles (kernels/cpu_quant.py ``_linear_gemm_bf16``; C: quant.c / quant_k.c
``*_dequantize_bf16``): the weight rows dequantized straight into bf16 are exactly torch's ``.bfloat16()`` of the
exact fp32 dequantization (round to nearest even, ties included) on every format and instruction set, a run of
rows or several tiles; the GEMM is torch's bf16 one on those tiles, so ``linear`` equals
``F.linear(x.bfloat16(), w.bfloat16())`` bit for bit; where the CPU has AMX-BF16, ``linear`` takes this path for
int8 activations from ``GEMM_ROWS_BF16`` rows, and its error against the exact product stays below the int8 GEMV's.
"""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_quant, cpu_quant_isa
from kernels.quant import GGUF_BLOCKS, QuantWeight, dequantize_ref
from tests.kernels.test_cpu_quant import PATHS, cols_for, quantized

FORMATS = list(GGUF_BLOCKS)


def _dequant_bf16(p, row0: int, count: int, isa: str) -> torch.Tensor:
    out = torch.empty(count, p.cols, dtype=torch.bfloat16)
    if GGUF_BLOCKS[p.fmt].k_quant:
        rc = cpu_quant_isa.lib().duet_quant_k_dequantize_bf16(p._c_args[0], p.qs.data_ptr(), p.cols, row0, count,
                                                              out.data_ptr(), cpu_quant_isa.isa_level(isa), 2)
    else:
        rc = cpu_quant_isa.lib().duet_quant_dequantize_bf16(*p._c_args, p.cols, row0, count, out.data_ptr(),
                                                            cpu_quant_isa.isa_level(isa), 2)
    assert rc == 0
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("isa", PATHS)
def test_bf16_tiles_are_the_exact_weights_rounded(fmt, isa):
    w = quantized(fmt, 37, cols_for(fmt, 320), seed=3)
    p = cpu_quant.pack(w)
    exact = dequantize_ref(w)
    assert torch.equal(_dequant_bf16(p, 0, 37, isa), exact.bfloat16())
    assert torch.equal(_dequant_bf16(p, 5, 30, isa), exact[5:35].bfloat16())  # a run starting mid-group


def test_bf16_rounding_is_nearest_even_at_ties():
    """Q8_0 with d = 1 + 2^-8 and 1 + 3 * 2^-8: for some q, d * q lies exactly halfway between two bf16 values (its fp32 low 16 bits
    exactly 0x8000); nearest even rounds some of them down, some up."""
    d = torch.tensor([1.00390625, 1.01171875], dtype=torch.float16).view(torch.uint8).reshape(2, 2)
    q = torch.arange(-127, 129, dtype=torch.int32).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    blocks = torch.cat([d.repeat_interleave(8, 0), q.reshape(8, 32).repeat(2, 1)], dim=1)  # each d times every q
    w = QuantWeight("Q8_0", 1, 512, blocks.reshape(1, -1).contiguous())
    exact = dequantize_ref(w)
    low = exact.view(torch.int32) & 0xFFFF
    ties = low == 0x8000
    assert ties.sum() >= 8  # ties are there to round (14), some rounding down to an even bf16, some up
    rounded = exact.bfloat16().float()
    assert (rounded[ties].abs() > exact[ties].abs()).any() and (rounded[ties].abs() < exact[ties].abs()).any()
    for isa in PATHS:
        assert torch.equal(_dequant_bf16(cpu_quant.pack(w), 0, 1, isa), exact.bfloat16())


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_bf16_linear_is_torchs_bf16_gemm_over_tiles(fmt, two_threads, monkeypatch):
    w = quantized(fmt, 37, cols_for(fmt, 512), seed=4)
    p = cpu_quant.pack(w)
    gen = torch.Generator().manual_seed(5)
    x, bias = torch.randn(cpu_quant.GEMM_ROWS_BF16, p.cols, generator=gen), torch.randn(37, generator=gen)
    ref = torch.nn.functional.linear(x.bfloat16(), dequantize_ref(w).bfloat16()).float() + bias
    assert torch.equal(cpu_quant._linear_gemm_bf16(x, p, bias, None), ref)
    monkeypatch.setattr(cpu_quant, "_TILE_BYTES", 2 * 8 * p.cols)  # tiles of 8 rows: 5 tiles, the last partial
    assert torch.equal(cpu_quant._linear_gemm_bf16(x, p, bias, None), ref)


def test_int8_activations_take_bf16_tiles_where_the_cpu_has_amx(two_threads, monkeypatch):
    w = quantized("Q4_K", 64, 1024, seed=6)
    p = cpu_quant.pack(w)
    called = []
    real = cpu_quant._linear_gemm_bf16
    monkeypatch.setattr(cpu_quant, "_linear_gemm_bf16", lambda *a: called.append(1) or real(*a))
    x = torch.randn(cpu_quant.GEMM_ROWS_BF16, 1024, generator=torch.Generator().manual_seed(7))
    y = cpu_quant.linear(x, p, activations="int8")
    cpu_quant.linear(x, p, activations="fp32")  # exact activations: never bf16
    cpu_quant.linear(x, p, activations="int8", isa="avx2")  # an older CPU played: fp32 tiles or the GEMV
    assert called == ([1] if cpu_quant_isa.amx_bf16() else [])
    assert cpu_quant.bf16_prefill("int8") == cpu_quant_isa.amx_bf16()
    exact = x.double() @ dequantize_ref(w).double().T
    gemv = cpu_quant.linear(x, p, activations="int8", tiles=False)  # llama.cpp's int8 scheme
    err = {name: ((out.double() - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()
           for name, out in (("bf16", y), ("int8", gemv))}
    if called:  # bf16's 8-bit significands against int8's 8-bit integers per 256: measured ~3e-3 vs ~1.5e-2
        assert err["bf16"] < 5e-3 and err["bf16"] < err["int8"]
