"""The 32-weight formats' digit-plane fp32 kernel (kernels/cpu/quant_planes.c): x as 24-bit fixed point per block,
three int8 digit planes, exact integer dots. Its instruction sets (scalar twin, AVX2, 256- and 512-bit VNNI) agree
to the bit; its error is within the bound its method gives; non-finite x and extreme scales stay honest."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_quant, cpu_quant_isa
from kernels.cpu_quant_isa import isa_level, lib
from kernels.quant import dequantize_ref

from .test_cpu_quant import quantized

FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
LEVELS = [isa for isa in cpu_quant_isa.supported_isas() if isa != "avx512"]  # avx512 runs the avx2 kernel


def planes(x: torch.Tensor, p: cpu_quant.PackedQuant, isa: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.full((x.shape[0], p.rows), -7.0)
    rc = lib().duet_quant_linear_planes(*p._c_args, p.rows, p.cols, x.data_ptr(), x.stride(0), x.shape[0],
                                        bias.data_ptr() if bias is not None else None, out.data_ptr(), out.stride(0),
                                        isa_level(isa), torch.get_num_threads())
    assert rc == 0
    return out


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|error| per output the method allows: each x within 2^-22 of its block's largest |x| (half a unit of X, whose
    largest is >= 2^21), times |w|; plus fp32's roundings of the per-block sums and their sum (2^-21 of sum |x w|)."""
    amax = x.abs().reshape(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1).double()
    return (amax * 2.0**-22) @ w.abs().double().T + 2.0**-21 * (x.abs().double() @ w.abs().double().T)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [37, 64, 8, 16])  # odd groups (the last one 256-bit) with a partial one, pairs only
def test_every_level_gives_the_same_bits_within_the_methods_bound(fmt, rows, two_threads):
    w = quantized(fmt, rows, 576, seed=rows)
    p, wd = cpu_quant.pack(w), dequantize_ref(w)
    gen = torch.Generator().manual_seed(rows)
    for m in (1, 3, 6):
        x = torch.randn(m, 576, generator=gen) * torch.logspace(-3, 3, m).reshape(m, 1)  # scales apart per row
        x[0, 64:96] = 0.0  # a block of zeros
        bias = torch.randn(rows, generator=gen)
        outs = {isa: planes(x, p, isa, bias) for isa in LEVELS}
        first = outs[LEVELS[0]]
        for isa, out in outs.items():
            assert torch.equal(out, first), (isa, (out - first).abs().max())
        err = (first.double() - bias.double() - x.double() @ wd.double().T).abs()
        assert bool((err <= bound(x, wd)).all()), (err / bound(x, wd)).max()


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
def test_non_finite_x_makes_its_row_nan_and_leaves_the_others(fmt, two_threads):
    w = quantized(fmt, 24, 128, seed=3)
    p = cpu_quant.pack(w)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3))
    clean = {isa: planes(x, p, isa) for isa in LEVELS}
    x[1, 40], x[2, 100] = float("inf"), float("nan")
    for isa in LEVELS:
        out = planes(x, p, isa)
        assert bool(out[1:3].isnan().all())
        assert torch.equal(out[[0, 3]], clean[isa][[0, 3]])


@pytest.mark.parametrize("scale", [1e-30, 1e-38, 1e-42, 1e33])  # 2^s normal, 2^s past fp32's range, subnormal x, 2^s < 1
def test_extreme_scales_stay_within_the_bound(scale, two_threads):
    w = quantized("Q4_1", 16, 96, seed=4)
    p, wd = cpu_quant.pack(w), dequantize_ref(w)
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(4)).double() * scale
    x32 = x.float()
    outs = [planes(x32, p, isa) for isa in LEVELS]
    assert all(torch.equal(o, outs[0]) for o in outs)
    ref = x32.double() @ wd.double().T
    if scale < 1e-37:  # x subnormal: fp32 itself holds few bits; the outputs (~1e-38 and below) within 1 % of |y|
        assert bool(((outs[0].double() - ref).abs() <= 1e-2 * ref.abs() + 1e-44).all())
    else:
        assert bool(((outs[0].double() - ref).abs() <= bound(x32, wd)).all())


def test_the_default_fp32_linear_takes_this_kernel_from_vnni(two_threads):
    w = quantized("Q4_1", 40, 576, seed=5)
    p = cpu_quant.pack(w)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(5))
    for isa in cpu_quant_isa.supported_isas():
        kernel = lib().duet_quant_linear_planes if isa == "vnni" else lib().duet_quant_linear_f32
        out = torch.empty(2, 40)
        assert kernel(*p._c_args, 40, 576, x.data_ptr(), 576, 2, None, out.data_ptr(), 40, isa_level(isa), 2) == 0
        assert torch.equal(cpu_quant.linear(x, p, isa=isa), out), isa
