"""quant_gemm (Triton, weights dequantized in registers) against quant_gemm_ref / kernels/quant.py quant_linear_ref.

Every GGUF block type and group-quantized weights (4 / 8 bits, zeros, act order); x fp32 / fp16 / bf16; decode-like
M (1, 5) and a few row tiles; N not a multiple of the tile (wrapped columns), K not a multiple of the target K tile
(the launcher fits it: 96 and 160 columns take 32-wide tiles); bias; forced split-K with an uneven last split; the
large-M fallback (dequantize + torch's linear, in row tiles); configs by M; bad input.

Tolerances, max |error| / max |reference| (the reference in fp32 on x as given): fp32 1e-5 (a reordering of fp32
sums, measured 1e-7 to 3e-7 in the interpreter); fp16 2e-3 and bf16 8e-3: the output rounded once to the dtype
(half an ulp: 2^-11, 2^-8 of the largest value), plus on a GPU the weights rounded to the dtype before the dot,
as a dense engine on the dequantized weights in that dtype would (~2^-9 / sqrt(K) relative, far inside).
"""
from __future__ import annotations

import pytest
import torch

from kernels import quant_gemm as qg
from kernels.gemm import _GemmConfig
from kernels.quant import GGUF_BLOCKS, quant_linear_ref
from kernels.quant_gpu import pack_gpu, pack_groups
from tests.kernels.paged import DEVICE
from tests.kernels.test_cpu_quant import cols_for, quantized
from tests.kernels.test_quant_gpu import _groups

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
FORMATS = list(GGUF_BLOCKS)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.float().cpu() - ref.float().cpu()).abs().max() / ref.abs().max()).item()


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_matches_the_reference(fmt, dtype):
    k = cols_for(fmt, 160)  # 32-blocks: 5 blocks (K tiles of 32); k-quants: one super-block
    w = quantized(fmt, 37, k, seed=1)  # 37 rows: the tile's last columns wrap
    p = pack_gpu(w, DEVICE)
    for m in (1, 5):
        x = _x(m, k, dtype, seed=m)
        bias = torch.randn(37).to(dtype).to(DEVICE)
        ref = quant_linear_ref(x.float().cpu(), w, bias.float().cpu())
        out = qg.quant_gemm(x, p, bias)
        assert out.dtype == dtype and out.shape == (m, 37)
        assert _rel_err(out, ref) <= TOL[dtype], (fmt, m)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_split_k_and_row_tiles(fmt):
    """Forced split-K (3 splits of K = 3 blocks or super-blocks: the last split shorter), M over two row tiles."""
    k = cols_for(fmt, 96) * (3 if GGUF_BLOCKS[fmt].k_quant else 1)
    w = quantized(fmt, 40, k, seed=2)
    p = pack_gpu(w, DEVICE)
    x, bias = _x(20, k, torch.float32), torch.randn(40).to(DEVICE)
    ref = quant_linear_ref(x.cpu(), w, bias.cpu())
    for cfg in (_GemmConfig(16, 32, 32, 4, 1, split_k=3), _GemmConfig(16, 64, 256, 4, 1, split_k=2)):
        assert _rel_err(qg.quant_gemm(x, p, bias, cfg=cfg), ref) <= TOL[torch.float32], cfg
    assert _rel_err(qg.quant_gemm(x, p), quant_linear_ref(x.cpu(), w)) <= TOL[torch.float32]


@pytest.mark.parametrize("bits, cols, group, sym, act_order", [
    (4, 256, 128, False, True), (4, 96, 32, True, False), (8, 128, 64, False, True)])
def test_group_quantized_weights(bits, cols, group, sym, act_order):
    (q, scales, zeros, perm), dense = _groups(bits, 33, cols, group, sym, act_order, seed=5)
    p = pack_groups(bits, group, q, scales, zeros, perm, DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        x = _x(3, cols, dtype)
        ref = x.float().cpu() @ dense.T
        assert _rel_err(qg.quant_gemm(x, p), ref) <= TOL[dtype]
        assert _rel_err(qg.quant_gemm(x, p, cfg=_GemmConfig(16, 32, 64, 4, 1, split_k=2)), ref) <= TOL[dtype]


def test_large_m_falls_back_to_dequantize_and_torch_linear(monkeypatch):
    w = quantized("Q4_1", 40, 128, seed=6)
    p = pack_gpu(w, DEVICE)
    x, bias = _x(qg.DEQUANT_GEMM_ROWS, 128, torch.float32), torch.randn(40).to(DEVICE)
    ref = quant_linear_ref(x.cpu(), w, bias.cpu())
    lead = x[:5].view(5, 1, 128).expand(5, 2, 128)  # leading dims, strided rows: the kernel's path
    assert _rel_err(qg.quant_gemm(lead, p), quant_linear_ref(lead.reshape(10, 128).cpu(), w).view(5, 2, 40)) <= 1e-5

    def no_kernel(*args, **kwargs):
        raise AssertionError("the quantized kernel ran at M >= DEQUANT_GEMM_ROWS")
    monkeypatch.setattr(qg, "_launch", no_kernel)
    assert _rel_err(qg.quant_gemm(x, p, bias), ref) <= TOL[torch.float32]
    monkeypatch.setattr(qg, "_TILE_BYTES", 16 * 128 * 4)  # 16 rows at a time: 3 tiles, the last one short
    assert _rel_err(qg.quant_gemm(x, p, bias), ref) <= TOL[torch.float32]


def test_configs_by_m(monkeypatch):
    monkeypatch.setattr(qg.tu, "INTERPRET", False)  # the GPU's configs
    decode = qg.pick_config(1, 4096, 4096, torch.bfloat16, 132)
    assert (decode.block_m, decode.split_k) == (16, 4)  # 64 column tiles x 4 K splits: ~2 programs per SM
    assert qg.pick_config(1, 128256, 4096, torch.bfloat16, 132).split_k == 1  # enough tiles already
    assert qg.pick_config(64, 4096, 4096, torch.bfloat16, 132).block_m == 64
    assert qg.pick_config(200, 4096, 4096, torch.bfloat16, 132).block_m == 128
    p = pack_gpu(quantized("Q6_K", 2, 768, seed=7))
    assert qg._block_k(p, 64) == 128  # at least one span (Q6_K's nibble runs are 128 weights)
    assert qg._block_k(pack_gpu(quantized("Q4_0", 2, 160, seed=7)), 128) == 32  # 160 = 5 x 32


def test_bad_input_is_refused_by_name():
    p = pack_gpu(quantized("Q8_0", 8, 64, seed=8), DEVICE)
    with pytest.raises(ValueError, match="x has 32 input features but the Q8_0 weight"):
        qg.quant_gemm(_x(2, 32, torch.float32), p)
    with pytest.raises(ValueError, match="bias has shape"):
        qg.quant_gemm(_x(2, 64, torch.float32), p, torch.zeros(7, device=DEVICE))
    with pytest.raises(TypeError, match="bias has dtype torch.float16"):
        qg.quant_gemm(_x(2, 64, torch.float32), p, torch.zeros(8, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="x must be a float tensor"):
        qg.quant_gemm(torch.zeros(2, 64, dtype=torch.int32, device=DEVICE), p)
    assert qg.quant_gemm(_x(0, 64, torch.float32), p).shape == (0, 8)
