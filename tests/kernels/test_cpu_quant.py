"""GGUF block-quantized weights: the torch reference against gguf-py, the C kernels against the reference.

Every format of kernels/quant.GGUF_BLOCKS (the k-quants Q4_K, Q5_K, Q6_K among them): dequantize_ref is bit-exact
with ``gguf.dequantize`` on random bytes (finite fp16 scales, subnormals among them); pack/unpack gives the bytes back
and the packed form dequantizes to exactly the reference (the best instruction set this CPU has, and scalar), whole
or a run of rows; linear at M = 1, 3, 16, 64 with a row count that leaves a partial group of 8, bias, the int8
kernel, the fp32 kernel (forced at every M, relative RMS error 1e-5) and the fp32 tiles + GEMM; embedding rows; bad
input. The k-quants' weights are random super-blocks with sane scales (gguf-py cannot quantize them); their layout,
error bounds and every instruction set: tests/kernels/test_cpu_quant_k.py; the 32-weight formats' int8 kernel on
every instruction set: test_int8_kernel_on_every_level below.
"""
from __future__ import annotations

import threading

import gguf
import numpy as np
import pytest
import torch

from kernels import cpu_quant, cpu_quant_isa
from kernels.quant import GGUF_BLOCKS, QuantWeight, dequantize_ref, quant_linear_ref, quant_rows_ref

FORMATS = list(GGUF_BLOCKS)
INT8 = sorted(cpu_quant.INT8_FORMATS)
K_QUANTS = [f for f in FORMATS if GGUF_BLOCKS[f].k_quant]
_SCALES_AT = {"Q6_K": (208,)}  # byte offsets of a block's fp16 scales (the rest: d at 0, the *_1 / *_K min at 2)
# the scalar twin, AVX2 and the best instruction set here (VNNI: the int8 kernel's dots)
PATHS = sorted({"scalar", *cpu_quant_isa.supported_isas()[1:2], cpu_quant_isa.supported_isas()[-1]})
FP32_TOL = 1e-5  # max |error| / max |reference|: reordered fp32 sums
INT8_TOL = 1e-2  # RMS error / RMS of the reference: 8-bit activations per 32-block
# the k-quants' random super-blocks: their mins cancel most of each output (|y| << sum |x w|), so x's rounding per
# 256 weighs more against |y| (~1.5e-2 here); the per-output bound: tests/kernels/test_cpu_quant_k.py
INT8_TOL_K = 3e-2
FP32_KERNEL_TOL = 1e-5  # RMS error / RMS of the reference: the fp32 kernel's reordered sums (measured ~5e-7)



def cols_for(fmt: str, cols: int) -> int:
    """``cols`` rounded up to the format's block size (256 for the k-quants)."""
    bs = GGUF_BLOCKS[fmt].block_size
    return -(-cols // bs) * bs


def random_bytes(fmt: str, rows: int, cols: int, seed: int) -> QuantWeight:
    """Random blocks whose fp16 scale and min are finite (some subnormal)."""
    f = GGUF_BLOCKS[fmt]
    gen = torch.Generator().manual_seed(seed)
    nb = cols // f.block_size
    blocks = torch.randint(0, 256, (rows, nb, f.block_bytes), dtype=torch.uint8, generator=gen)
    for lo in _SCALES_AT.get(fmt, (0, 2) if f.has_min else (0,)):
        scale = torch.randn(rows, nb, generator=gen) * 0.05
        scale[0, 0] = 3e-7  # fp16 subnormal
        blocks[..., lo:lo + 2] = scale.half().view(torch.uint8).reshape(rows, nb, 2)
    return QuantWeight(fmt, rows, cols, blocks.reshape(rows, -1))


def quantized(fmt: str, rows: int, cols: int, seed: int) -> QuantWeight:
    """A Gaussian weight quantized by gguf-py (realistic scales and quants); a k-quant: random super-blocks."""
    if GGUF_BLOCKS[fmt].k_quant:
        return random_bytes(fmt, rows, cols_for(fmt, cols), seed)
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).numpy()
    data = gguf.quantize(w, gguf.GGMLQuantizationType[fmt])
    return QuantWeight(fmt, rows, cols, torch.from_numpy(np.ascontiguousarray(data)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_ref_matches_gguf_bit_exactly(fmt):
    w = random_bytes(fmt, 7, 3 * GGUF_BLOCKS[fmt].block_size, seed=1)
    expected = gguf.dequantize(w.data.numpy(), gguf.GGMLQuantizationType[fmt])
    assert torch.equal(dequantize_ref(w), torch.from_numpy(expected))
    assert w.num_bytes == 7 * 3 * GGUF_BLOCKS[fmt].block_bytes


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("isa", PATHS)
def test_pack_is_lossless(fmt, isa, two_threads):
    w = random_bytes(fmt, 301, cols_for(fmt, 96), seed=2)  # 37 groups of 8 rows and one of 5
    p = cpu_quant.pack(w)
    assert torch.equal(cpu_quant.unpack(p).data, w.data)
    assert p.num_bytes == w.num_bytes // 301 * 304  # the last group's 3 padding rows
    assert torch.equal(cpu_quant.dequantize(p, isa=isa), dequantize_ref(w))
    for r0, n in ((3, 9), (296, 5), (8, 8)):  # runs of rows that start and end inside groups (prefill tiles)
        assert torch.equal(cpu_quant._dequantize_rows(p, None, r0, n, isa), dequantize_ref(w)[r0:r0 + n])


def _assert_linear_close(out, ref, acts, k_quant=False):
    if acts == "int8":
        tol = INT8_TOL_K if k_quant else INT8_TOL
        assert ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item() < tol
    else:
        assert ((out - ref).abs().max() / ref.abs().max()).item() < FP32_TOL


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 16, 64])
@pytest.mark.parametrize("acts", ["int8", "fp32", None])  # fp32, and None at M >= GEMM_ROWS: tiles + GEMM
@pytest.mark.parametrize("isa", PATHS)
def test_linear_matches_reference(fmt, m, acts, isa, two_threads):
    cols = cols_for(fmt, 1024 if m == 3 else 160)
    w = quantized(fmt, 37, cols, seed=m)
    gen = torch.Generator().manual_seed(10 + m)
    x, bias = torch.randn(m, cols, generator=gen), torch.randn(37, generator=gen)
    out = cpu_quant.linear(x, cpu_quant.pack(w), bias, activations=acts, isa=isa)
    path = acts or (cpu_quant.ACTIVATIONS if m < cpu_quant.GEMM_ROWS else "fp32")  # tiles + GEMM: fp32
    k_quant = GGUF_BLOCKS[fmt].k_quant
    _assert_linear_close(out, quant_linear_ref(x, w, bias), path, k_quant)
    no_bias = cpu_quant.linear(x, cpu_quant.pack(w), activations=acts, isa=isa)
    _assert_linear_close(no_bias, quant_linear_ref(x, w), path, k_quant)


def _rel_rms(out, ref):
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 16, 64])
@pytest.mark.parametrize("isa", PATHS)
def test_fp32_kernel_matches_reference(fmt, m, isa, two_threads, monkeypatch):
    monkeypatch.setattr(cpu_quant, "GEMM_ROWS_FP32", 1 << 30)  # the kernel at every M (no tiles + GEMM)
    monkeypatch.setattr(cpu_quant, "GEMM_ROWS_PLANES", 1 << 30)
    monkeypatch.setattr(cpu_quant, "GEMM_ROWS_FP32_K", {})  # the k-quants' own thresholds too
    called = []
    real = cpu_quant._linear_gemm
    monkeypatch.setattr(cpu_quant, "_linear_gemm", lambda *a: called.append(1) or real(*a))
    cols = cols_for(fmt, 1024 if m == 3 else 576)
    for rows in (37, 5, 64):  # a partial last group, a lone partial group, whole groups
        w = quantized(fmt, rows, cols, seed=100 + m + rows)
        gen = torch.Generator().manual_seed(20 + m)
        x, bias = torch.randn(m, cols, generator=gen), torch.randn(rows, generator=gen)
        p = cpu_quant.pack(w)
        for b in (bias, None):
            ref = quant_linear_ref(x, w, b)
            assert _rel_rms(cpu_quant.linear(x, p, b, activations="fp32", isa=isa), ref) < FP32_KERNEL_TOL
    strided = torch.randn(m, cols + 64)[:, 32:32 + cols]  # rows of x strided
    assert _rel_rms(cpu_quant.linear(strided, p, activations="fp32", isa=isa),
                    quant_linear_ref(strided, w)) < FP32_KERNEL_TOL
    assert not called


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp32_kernel_scalar_twin_and_default(fmt, two_threads):
    w = quantized(fmt, 19, 576, seed=6)
    x = torch.randn(5, w.cols, generator=torch.Generator().manual_seed(6)) * 3 + 0.5  # sum(x) per block far from 0
    p = cpu_quant.pack(w)
    simd = cpu_quant.linear(x, p)  # the default: fp32
    assert cpu_quant.ACTIVATIONS == "fp32"
    scalar = cpu_quant.linear(x, p, isa="scalar")
    ref = quant_linear_ref(x, w)
    assert _rel_rms(simd, ref) < FP32_KERNEL_TOL and _rel_rms(scalar, ref) < FP32_KERNEL_TOL
    assert _rel_rms(simd, scalar) < FP32_KERNEL_TOL


@pytest.mark.parametrize("fmt", [f for f in INT8 if not GGUF_BLOCKS[f].k_quant])  # k-quants: test_cpu_quant_k.py
def test_int8_kernel_on_every_level(fmt, two_threads):
    """Each instruction set this CPU takes (VNNI: vpdpbusd) has the scalar twin's integer dots."""
    w = quantized(fmt, 19, 576, seed=5)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(5))
    p = cpu_quant.pack(w)
    scalar = cpu_quant.linear(x, p, activations="int8", isa="scalar")
    for isa in cpu_quant_isa.supported_isas()[1:]:
        simd = cpu_quant.linear(x, p, activations="int8", isa=isa)
        assert ((simd - scalar).abs().max() / simd.abs().max()).item() < 1e-5, isa


def test_linear_strided_x_and_empty():
    w = quantized("Q4_1", 9, 64, seed=3)
    p = cpu_quant.pack(w)
    wide = torch.randn(4, 100)
    x = wide[:, 10:74]  # rows strided, last dim contiguous
    _assert_linear_close(cpu_quant.linear(x, p, activations="fp32"), quant_linear_ref(x, w), "fp32")
    assert cpu_quant.linear(torch.empty(0, 64), p).shape == (0, 9)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_gathers_embeddings(fmt):
    w = random_bytes(fmt, 50, cols_for(fmt, 64), seed=4)
    ids = torch.tensor([3, 0, 49, 3, 17])
    assert torch.equal(cpu_quant.rows(cpu_quant.pack(w), ids), quant_rows_ref(w, ids))
    assert torch.equal(cpu_quant.rows(cpu_quant.pack(w), ids, isa="scalar"), quant_rows_ref(w, ids))
    with pytest.raises(ValueError, match="ids must be in"):
        cpu_quant.rows(cpu_quant.pack(w), torch.tensor([50]))


def test_bad_input_is_a_clear_value_error():
    with pytest.raises(ValueError, match="unsupported quantized format 'Q3_K'.*Q8_0, Q4_0, Q4_1.*Q4_K, Q5_K, Q6_K"):
        QuantWeight("Q3_K", 2, 256, torch.zeros(2, 110, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantWeight("Q4_0", 2, 40, torch.zeros(2, 18, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantWeight("Q4_K", 2, 32, torch.zeros(2, 18, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"shape \(2, 144\)"):
        QuantWeight("Q4_K", 2, 256, torch.zeros(2, 18, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        QuantWeight("Q4_0", 2, 32, torch.zeros(2, 18, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"shape \(2, 18\)"):
        QuantWeight("Q4_0", 2, 32, torch.zeros(2, 20, dtype=torch.uint8))
    p = cpu_quant.pack(QuantWeight("Q4_0", 2, 32, torch.zeros(2, 18, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="32 columns"):
        cpu_quant.linear(torch.zeros(1, 64), p)
    with pytest.raises(ValueError, match="float32"):
        cpu_quant.linear(torch.zeros(1, 32, dtype=torch.float64), p)
    with pytest.raises(ValueError, match="bias"):
        cpu_quant.linear(torch.zeros(1, 32), p, torch.zeros(3))
    with pytest.raises(ValueError, match="activations"):
        cpu_quant.linear(torch.zeros(1, 32), p, activations="int4")


@pytest.mark.parametrize("fmt", ["Q4_1", "Q6_K"])
def test_prefill_tiles_reuse_one_buffer(fmt, two_threads, monkeypatch):
    """Weight rows dequantized a tile at a time into one reused buffer (a fresh tile is page faults): several tiles,
    the last partial, each one GEMM on exactly the dequantized rows, bias added once."""
    cols = cols_for(fmt, 256)
    w = quantized(fmt, 37, cols, seed=8)
    monkeypatch.setattr(cpu_quant, "_TILE_BYTES", 16 * 4 * cols)  # 16 rows a tile: 16, 16, 5
    monkeypatch.setattr(cpu_quant, "_scratch", threading.local())  # no buffer left by other tests
    x, bias = torch.randn(cpu_quant.GEMM_ROWS, cols), torch.randn(37)
    p = cpu_quant.pack(w)
    first = cpu_quant.linear(x, p, bias)
    buffer = cpu_quant._scratch.buf
    again = cpu_quant.linear(x, p, bias)
    assert cpu_quant._scratch.buf is buffer and buffer.numel() == 16 * cols
    ref = x @ dequantize_ref(w).T + bias
    assert torch.equal(first, again)
    assert ((first - ref).abs().max() / ref.abs().max()).item() < FP32_TOL
