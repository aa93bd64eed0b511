"""The Triton kernels' packed quantized layout (kernels/quant_gpu.py) and its row gather + dequantize kernel
(kernels/quant_rows.py).

Lossless: every GGUF block type packed and dequantized (torch, and the Triton kernel in float32) gives exactly
kernels/quant.py ``dequantize_ref`` of the file's bytes (which is bit-exact with gguf-py: tests/kernels/
test_cpu_quant.py), on random blocks with finite scales (subnormals among them) and on gguf-py's own quantization;
the packed bytes are the file's (1.03x for Q4_K / Q5_K). Group-quantized weights (GPTQ / AWQ / compressed-tensors as
kernels/quant_group.py holds them: 4 / 8 bits, groups 32..128, zeros or symmetric, act order) dequantize to
(q - zero) * scale at each input column. Row gathers by id in fp32 / fp16 / bf16 equal the reference rounded once.
"""
from __future__ import annotations

import pytest
import torch

from kernels.quant import GGUF_BLOCKS
from kernels.quant import dequantize_ref as file_dequantize_ref
from kernels.quant_gpu import GpuQuant, dequantize_ref, pack_gpu, pack_groups
from kernels.quant_rows import quant_rows, quant_rows_ref
from tests.kernels.paged import DEVICE
from tests.kernels.test_cpu_quant import cols_for, quantized, random_bytes

FORMATS = list(GGUF_BLOCKS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_is_lossless(fmt):
    for w in (random_bytes(fmt, 9, cols_for(fmt, 96), seed=1), quantized(fmt, 5, 256, seed=2)):
        p = pack_gpu(w, DEVICE)
        expected = file_dequantize_ref(w)
        assert torch.equal(dequantize_ref(p).cpu(), expected)
        assert torch.equal(quant_rows(p).cpu(), expected)  # the kernel: no FMA, the formats' two roundings
        ratio = p.num_bytes / w.num_bytes
        assert ratio == (180 / 176 if fmt == "Q5_K" else 148 / 144 if fmt == "Q4_K" else 1.0)


def _groups(bits: int, rows: int, cols: int, group: int, sym: bool, act_order: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (rows, cols), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = (torch.rand(rows, cols // group, generator=gen) * 0.02 + 0.001).half()
    zeros = torch.full((rows, cols // group), 1 << (bits - 1), dtype=torch.int16) if sym else \
        torch.randint(0, 1 << bits, (rows, cols // group), generator=gen, dtype=torch.int16)
    perm = torch.randperm(cols, generator=gen) if act_order else None
    expected = torch.empty(rows, cols)
    for k in range(cols):  # the formats' dequantization, column by column: (q - z) * s in fp32
        w = (q[:, k].int() - zeros[:, k // group].int()).float() * scales[:, k // group].float()
        expected[:, perm[k] if act_order else k] = w
    return (q, scales, zeros, perm), expected


@pytest.mark.parametrize("bits, cols, group, sym, act_order", [
    (4, 256, 128, False, False), (4, 96, 32, True, False), (4, 128, 64, False, True), (8, 128, 32, False, True),
    (8, 64, 64, True, False)])
def test_group_quantized_weights_dequantize_as_their_formats(bits, cols, group, sym, act_order):
    (q, scales, zeros, perm), expected = _groups(bits, 7, cols, group, sym, act_order, seed=bits + cols)
    p = pack_groups(bits, group, q, scales, zeros, perm, DEVICE)
    assert (p.zeros is None) == sym and p.offset == ((1 << (bits - 1)) if sym else 0)
    assert p.span == (0 if bits == 8 else 64 if cols % 64 == 0 else 32)
    assert torch.equal(dequantize_ref(p).cpu(), expected)
    assert torch.equal(quant_rows(p).cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["Q4_0", "Q5_1", "Q8_0", "Q6_K"])
def test_rows_gather_by_id(fmt, dtype):
    w = pack_gpu(quantized(fmt, 40, 256, seed=3), DEVICE)
    for ids in (torch.tensor([3, 0, 39, 3, 17]), torch.tensor([[5], [6]], dtype=torch.int32), torch.arange(0)):
        got = quant_rows(w, ids.to(DEVICE), dtype)
        assert got.dtype == dtype and torch.equal(got.cpu(), quant_rows_ref(w, ids, dtype).cpu())


def test_bad_input_is_refused_by_name():
    w = pack_gpu(quantized("Q4_0", 8, 64, seed=4), DEVICE)
    with pytest.raises(ValueError, match=r"ids must be in \[0, 8\), got values in \[0, 8\]"):
        quant_rows(w, torch.tensor([0, 8], device=DEVICE))
    with pytest.raises(TypeError, match="ids has dtype torch.float32"):
        quant_rows(w, torch.zeros(2, device=DEVICE))
    with pytest.raises(TypeError, match="expected a kernels.quant_gpu.GpuQuant, got QuantWeight"):
        quant_rows(quantized("Q4_0", 8, 64, seed=4))
    with pytest.raises(ValueError, match="Q4_0: scales must be a contiguous"):
        GpuQuant("Q4_0", 8, 64, 4, 32, 32, w.qs, w.scales[:, :1].contiguous(), offset=8)
    zeros = torch.zeros(2, 8, dtype=torch.int16, device=DEVICE)
    with pytest.raises(ValueError, match="Q4_0: a min and a zero point: one or the other"):
        GpuQuant("Q4_0", 8, 64, 4, 32, 32, w.qs, w.scales, mins=w.scales, zeros=zeros)
    with pytest.raises(ValueError, match="Q4_0: qh given where this layout has none"):
        GpuQuant("Q4_0", 8, 64, 4, 32, 32, w.qs, w.scales, qh=torch.zeros(2, 8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="group-quantized weights have 4 or 8 bits, got 3"):
        pack_groups(3, 32, torch.zeros(2, 32, dtype=torch.uint8), torch.ones(2, 1), torch.zeros(2, 1))
