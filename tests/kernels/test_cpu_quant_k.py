"""The k-quants' packed kernels (kernels/cpu_quant_k.py, kernels/cpu/quant_k*.c) on every instruction set this CPU
takes (kernels/cpu_quant_isa.py), against the torch reference (kernels/quant.py, itself bit-exact with gguf-py).

- the 8-row layout: bytes where kernels/cpu/quant_k.h says they are, pack / unpack lossless with a partial group,
  dequantize and rows exactly ``dequantize_ref`` at every level;
- the fp32 GEMV within its stated bound of ``quant_linear_ref``, per output: |y - y_ref| <= 2 gamma_n *
  sum_j |x_j| (|d sc q_j| + |dmin mn|) (gamma_n = n u / (1 - n u), u = 2^-24, n = cols), at M = 1, 3, 5, 16
  (the kernels take 4 or 2 rows of x a pass), bias, strided x;
- the int8 GEMV within x's rounding, sum_j |w_j| dx_j / 2, plus fp32 rounding; its SIMD levels bit-identical (the
  same integer dots and the same fp32 order), the scalar twin within 1e-5;
- DUET_QUANT_ISA: a level the CPU lacks or a bad name is a ValueError naming it.
A level this CPU lacks is skipped, saying so (a hardware skip).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_quant, cpu_quant_isa
from kernels.quant import GGUF_BLOCKS, QuantWeight, dequantize_ref, quant_linear_ref, quant_rows_ref

K_QUANTS = [f for f, b in GGUF_BLOCKS.items() if b.k_quant]
ISAS = list(cpu_quant_isa.ISAS)
U = 2.0 ** -24
ROOT = Path(__file__).resolve().parents[2]


def need(isa: str) -> None:
    if isa not in cpu_quant_isa.supported_isas():
        pytest.skip(f"this CPU lacks {isa} (it takes {', '.join(cpu_quant_isa.supported_isas())})")


def k_weight(fmt: str, rows: int, cols: int, seed: int) -> QuantWeight:
    """Random super-blocks, fp16 scales finite (one subnormal), signs mixed."""
    f = GGUF_BLOCKS[fmt]
    gen = torch.Generator().manual_seed(seed)
    nb = cols // 256
    blocks = torch.randint(0, 256, (rows, nb, f.block_bytes), dtype=torch.uint8, generator=gen)
    for lo in (208,) if fmt == "Q6_K" else (0, 2):
        scale = torch.randn(rows, nb, generator=gen) * 0.01
        scale[0, 0] = 3e-7  # fp16 subnormal
        blocks[..., lo:lo + 2] = scale.half().view(torch.uint8).reshape(rows, nb, 2)
    return QuantWeight(fmt, rows, cols, blocks.reshape(rows, -1))


def magnitudes(w: QuantWeight) -> torch.Tensor:
    """|d sc q| + |dmin mn| per weight (Q6_K: |w|): the reference with d made positive and dmin negative."""
    if w.fmt == "Q6_K":
        return dequantize_ref(w).abs()
    b = w.data.reshape(w.rows, w.num_blocks, -1).clone()
    b[..., 1] &= 0x7F
    b[..., 3] |= 0x80
    return dequantize_ref(QuantWeight(w.fmt, w.rows, w.cols, b.reshape(w.rows, -1)))


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def test_layout_is_the_8x8_interleave():
    w = k_weight("Q4_K", 16, 512, seed=1)
    p = cpu_quant.pack(w)
    assert tuple(p.qs.shape) == (2, 2, 8 * 144)
    blocks = w.data.reshape(16, 2, 144)
    g, b, r = 1, 1, 5  # row 13, super-block 1
    gb = p.qs[g, b]
    assert torch.equal(gb[2 * r:2 * r + 2], blocks[13, 1, 0:2])  # d
    assert torch.equal(gb[16 + 2 * r:18 + 2 * r], blocks[13, 1, 2:4])  # dmin
    assert torch.equal(gb[32 + 8 * torch.arange(12) + r], blocks[13, 1, 4:16])  # scales [12][8]
    for c in range(16):  # qs [16][8][8]
        assert torch.equal(gb[128 + 64 * c + 8 * r:128 + 64 * c + 8 * r + 8], blocks[13, 1, 16 + 8 * c:24 + 8 * c])
    q6 = k_weight("Q6_K", 8, 256, seed=2)
    gb6, b6 = cpu_quant.pack(q6).qs[0, 0], q6.data.reshape(8, 210)
    assert torch.equal(gb6[1024 + 64 * 3 + 8 * r:1024 + 64 * 3 + 8 * r + 8], b6[r, 128 + 24:128 + 32])  # qh chunk 3
    assert torch.equal(gb6[1536 + 8 * torch.arange(16) + r], b6[r, 192:208])  # scales [16][8]
    assert torch.equal(gb6[1664 + 2 * r:1666 + 2 * r], b6[r, 208:210])  # d


@pytest.mark.parametrize("fmt", K_QUANTS)
@pytest.mark.parametrize("isa", ISAS)
def test_pack_lossless_and_dequantize_exact(fmt, isa, two_threads):
    need(isa)
    w = k_weight(fmt, 21, 768, seed=3)  # two groups of 8 and one of 5
    p = cpu_quant.pack(w)
    assert torch.equal(cpu_quant.unpack(p).data, w.data)
    assert p.num_bytes == w.num_bytes // 21 * 24  # the last group's 3 padding rows
    ref = dequantize_ref(w)
    assert torch.equal(cpu_quant.dequantize(p, isa=isa), ref)
    for r0, n in ((3, 9), (16, 5)):  # runs starting and ending inside groups (prefill tiles)
        assert torch.equal(cpu_quant._dequantize_rows(p, None, r0, n, isa), ref[r0:r0 + n])
    ids = torch.tensor([20, 0, 7, 8, 20])
    assert torch.equal(cpu_quant.rows(p, ids, isa=isa), quant_rows_ref(w, ids))


@pytest.mark.parametrize("fmt", K_QUANTS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 3, 5, 16])
def test_fp32_kernel_within_its_bound(fmt, isa, m, two_threads):
    need(isa)
    cols = 768 if m == 3 else 512
    w = k_weight(fmt, 37, cols, seed=10 + m)
    gen = torch.Generator().manual_seed(20 + m)
    x = torch.randn(m, cols + 16, generator=gen)[:, 8:8 + cols] * 3 + 0.5  # strided rows; sum(x) far from 0
    bias = torch.randn(37, generator=gen)
    p = cpu_quant.pack(w)
    out = cpu_quant.linear(x, p, bias, activations="fp32", isa=isa, tiles=False)
    err = (out - quant_linear_ref(x, w, bias)).abs()
    bound = 2 * gamma(cols + 2) * (x.abs() @ magnitudes(w).T + bias.abs())
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3g}"


def _int8_bound(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """sum_j |w_j| dx_j / 2 + fp32 rounding, per output: x's rounding to int8 per 256 (dx = amax / 127)."""
    blocks = x.reshape(x.shape[0], -1, 256)
    dx = (blocks.abs().amax(-1, keepdim=True) / 127).expand_as(blocks).reshape(x.shape)
    mag = magnitudes(w)
    return (dx / 2) @ dequantize_ref(w).abs().T * 1.001 + 4 * gamma(w.cols + 2) * ((x.abs() + dx) @ mag.T)


@pytest.mark.parametrize("fmt", K_QUANTS)
@pytest.mark.parametrize("m", [1, 3, 5, 16])
def test_int8_kernel_within_its_bound_on_every_level(fmt, m, two_threads):
    cols = 768 if m == 3 else 512
    w = k_weight(fmt, 37, cols, seed=30 + m)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(40 + m)) * 2 + 0.3
    p = cpu_quant.pack(w)
    bound = _int8_bound(x, w)
    ref = quant_linear_ref(x, w)
    outs = {isa: cpu_quant.linear(x, p, activations="int8", isa=isa, tiles=False)
            for isa in cpu_quant_isa.supported_isas()}
    for isa, out in outs.items():
        err = (out - ref).abs()
        assert (err <= bound).all(), f"{isa}: max err/bound {(err / bound).max().item():.3g}"
    simd = [outs[isa] for isa in outs if isa != "scalar"]
    for other in simd[1:]:  # the same integers, the same fp32 order: bit-identical
        assert torch.equal(other, simd[0])
    if simd:
        assert ((simd[0] - outs["scalar"]).abs().max() / simd[0].abs().max()).item() < 1e-5


def test_linear_default_takes_both_activations_and_the_tiles(two_threads, monkeypatch):
    w = k_weight("Q6_K", 19, 512, seed=5)
    p = cpu_quant.pack(w)
    assert cpu_quant.gemm_rows("Q6_K", "fp32") == cpu_quant.GEMM_ROWS_FP32_K["Q6_K"] > cpu_quant.GEMM_ROWS_FP32
    planes = cpu_quant_isa.isa_level(None) >= cpu_quant_isa.PLANES_LEVEL  # the digit-plane kernel's own crossover
    assert cpu_quant.gemm_rows("Q4_1", "fp32") == (cpu_quant.GEMM_ROWS_PLANES if planes else cpu_quant.GEMM_ROWS_FP32)
    assert cpu_quant.gemm_rows("Q4_1", "fp32", "avx2") == cpu_quant.GEMM_ROWS_FP32
    assert cpu_quant.gemm_rows("Q6_K", "int8") == (cpu_quant.GEMM_ROWS_BF16 if cpu_quant.bf16_prefill("int8")
                                                   else cpu_quant.GEMM_ROWS)
    assert cpu_quant.gemm_rows("Q6_K", "int8", "avx2") == cpu_quant.GEMM_ROWS  # no bf16 tiles below AVX-512
    x = torch.randn(cpu_quant.gemm_rows("Q6_K", "fp32"), 512)
    assert cpu_quant.ACTIVATIONS == "fp32"
    called = []
    real = cpu_quant._linear_gemm
    monkeypatch.setattr(cpu_quant, "_linear_gemm", lambda *a: called.append(1) or real(*a))
    tiles = cpu_quant.linear(x, p)  # M >= Q6_K's rows: the dequantized tiles, torch's GEMM on exact weights
    assert called == [1]
    cpu_quant.linear(x[:-1], p)  # one row fewer: the GEMV
    assert called == [1]
    assert torch.allclose(tiles, quant_linear_ref(x, w), rtol=0, atol=1e-5 * tiles.abs().max().item())
    assert cpu_quant.linear(x[:2], p, activations="int8").shape == (2, 19)


def test_isa_choice_is_checked():
    have = cpu_quant_isa.supported_isas()
    assert have[0] == "scalar" and cpu_quant_isa.default_isa() in have
    with pytest.raises(ValueError, match="isa must be one of scalar, avx2, avx512, vnni, got 'sse'"):
        cpu_quant_isa.isa_level("sse")
    missing = [isa for isa in cpu_quant_isa.ISAS if isa not in have]
    if missing:
        with pytest.raises(ValueError, match=f"isa='{missing[0]}', but this CPU takes at most '{have[-1]}'"):
            cpu_quant_isa.isa_level(missing[0])
    code = "from kernels import cpu_quant_isa as i; print(i.default_isa())"
    env = {**os.environ, "DUET_QUANT_ISA": "scalar"}
    env.pop("DUET_QUANT_SCALAR", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.stdout.strip() == "scalar", run.stderr[-2000:]
    env["DUET_QUANT_ISA"] = "avx1024"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "DUET_QUANT_ISA='avx1024': expected one of scalar, avx2, avx512, vnni" in run.stderr


def _vm_flags(addr: int) -> list[str] | None:
    """VmFlags of the mapping holding ``addr`` (/proc/self/smaps; "hg": madvise(MADV_HUGEPAGE) applied), None off
    Linux."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return None


def test_large_packed_weights_live_in_huge_pages():
    w = k_weight("Q4_K", 8 * 256, 2048, seed=7)  # 2.4 MB packed
    p = cpu_quant.pack(w)
    assert torch.equal(cpu_quant.unpack(p).data, w.data)
    assert p.qs.data_ptr() % (2 << 20) == 0  # its first whole huge page starts the tensor
    small = torch.arange(1000, dtype=torch.float32)
    assert cpu_quant_isa.in_huge_pages(small) is small  # under 2 MB: as it is
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("this kernel grants no transparent huge pages")  # the copy and its alignment are checked above
    # asked for (the kernel backs it with huge pages when it has free ones: under memory pressure, e.g. the whole
    # suite beside other work, it may give none for a while, so the backing itself is not asserted)
    assert "hg" in (_vm_flags(p.qs.data_ptr()) or ["hg"])
