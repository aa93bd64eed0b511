"""The k-quants' digit-plane fp32 kernel (kernels/cpu/quant_k_planes.c, AVX512-VNNI, one row of x): within the bound
its method gives per output, chosen by ``linear`` only where it runs, refused below VNNI, honest on non-finite x."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_quant, cpu_quant_isa, cpu_quant_k
from kernels.cpu_quant_isa import isa_level, lib
from kernels.quant import dequantize_ref

from .test_cpu_quant import random_bytes

VNNI = "vnni" in cpu_quant_isa.supported_isas()
needs_vnni = pytest.mark.skipif(not VNNI, reason="the digit-plane kernel runs on AVX512-VNNI CPUs only")


def planes(x: torch.Tensor, p, isa: str = "vnni") -> tuple[int, torch.Tensor]:
    out = torch.full((x.shape[0], p.rows), -7.0)
    rc = lib().duet_quant_k_linear_planes(p._c_args[0], p.qs.data_ptr(), p.rows, p.cols, x.data_ptr(), x.stride(0),
                                          x.shape[0], None, out.data_ptr(), out.stride(0), isa_level(isa), 2)
    return rc, out


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each x within 2^-22 of its super-block's largest |x|, times |w|; plus fp32's roundings (2^-21 sum |x w|)."""
    amax = x.abs().reshape(x.shape[0], -1, 256).amax(-1).repeat_interleave(256, dim=1).double()
    return (amax * 2.0**-22) @ w.abs().double().T + 2.0**-21 * (x.abs().double() @ w.abs().double().T)


@needs_vnni
@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows", [37, 64])
def test_within_the_methods_bound(fmt, rows, two_threads):
    w = random_bytes(fmt, rows, 1024, seed=rows)
    p, wd = cpu_quant.pack(w), dequantize_ref(w)
    gen = torch.Generator().manual_seed(rows)
    for m, scale in ((1, 1.0), (2, 1e-3), (3, 1e4), (1, 1e-39)):  # the last: subnormal x (exact as X)
        x = (torch.randn(m, 1024, generator=gen).double() * scale).float()
        x[0, 256:512] = 0.0  # a super-block of zeros
        rc, out = planes(x, p)
        assert rc == 0
        err = (out.double() - x.double() @ wd.double().T).abs()
        assert bool((err <= bound(x, wd) + 1e-44).all()), (err / bound(x, wd)).max()


@needs_vnni
def test_linear_takes_it_at_one_row_and_nan_stays_nan(two_threads):
    w = random_bytes("Q4_K", 24, 512, seed=3)
    p = cpu_quant.pack(w)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(3))
    assert torch.equal(cpu_quant.linear(x, p), planes(x, p)[1])
    two = torch.cat([x, x])  # past PLANES_MAX_ROWS: the widened-quants kernel
    assert cpu_quant_k.PLANES_MAX_ROWS == 1 and not torch.equal(cpu_quant.linear(two, p)[:1], planes(x, p)[1])
    x[0, 300] = float("nan")
    assert bool(planes(x, p)[1].isnan().all())


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_refused_below_vnni(isa):
    if isa not in cpu_quant_isa.supported_isas():
        pytest.skip(f"this CPU has no {isa}")
    p = cpu_quant.pack(random_bytes("Q4_K", 8, 256, seed=4))
    rc, _ = planes(torch.randn(1, 256), p, isa)
    assert rc == 2
