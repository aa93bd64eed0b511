"""Group-quantized weights (GPTQ / AWQ / compressed-tensors, kernels/quant_group.py): the reference's arithmetic, and
the C kernels (kernels/cpu_quant_group.py, kernels/cpu/quant_g.c) against it.

Random quants, zeros (up to 2^bits: GPTQ v1's stored zero + 1) and scales in each scale dtype (fp16, bf16, fp32), 4 and
8 bits, group sizes 32 to a whole row, act-order permutations: ``dequantize_group_ref`` is (q - z) * s in fp32 with the
input columns put back; pack / unpack is lossless; the packed form dequantizes to exactly the reference (AVX2 and
scalar, whole and in runs of rows); ``linear`` at M = 1, 3, 16 (the GEMV, forced) and 40 (tiles + GEMM) within a
relative RMS of 1e-5 of the reference (the GEMV's reordered fp32 sums), exactly for the tiles; through
kernels/cpu_quant.py's ``linear`` (the engine's entry) too; an act-order GEMV (x's columns gathered in C) recorded and
replayed on new values (kernels/cpu_graph.py); bad input refused."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_graph, cpu_quant, cpu_quant_group
from kernels.quant_group import GroupQuantWeight, dequantize_group_ref, group_linear_ref, join_rows

PATHS = [False, True]  # scalar: the AVX2 path (where the CPU has it), then the forced scalar twin
KERNEL_TOL = 1e-5  # RMS error / RMS of the reference


def random_weight(bits: int, rows: int, cols: int, group_size: int, scale_dtype=torch.float16,
                  perm: bool = False, seed: int = 0) -> GroupQuantWeight:
    gen = torch.Generator().manual_seed(seed)
    groups = cols // group_size
    q = torch.randint(0, 2 ** bits, (rows, cols), dtype=torch.uint8, generator=gen)
    scales = ((torch.rand(rows, groups, generator=gen) + 0.05) * 0.02).to(scale_dtype)
    zeros = torch.randint(0, 2 ** bits + 1, (rows, groups), dtype=torch.int16, generator=gen)
    return GroupQuantWeight(bits, group_size, q, scales, zeros,
                            torch.randperm(cols, generator=gen) if perm else None)


CASES = [(4, 32, torch.float16, False), (4, 64, torch.bfloat16, True), (4, 256, torch.float32, False),
         (8, 32, torch.bfloat16, False), (8, 128, torch.float16, True), (8, 256, torch.float32, True)]


def test_the_reference_is_q_minus_z_times_s_in_fp32():
    w = random_weight(4, 3, 64, 32, perm=True)
    out = dequantize_group_ref(w)
    for r in range(3):
        for k in range(64):  # kernel column k is input column perm[k], in group k // 32
            g = k // 32
            want = (int(w.q[r, k]) - int(w.zeros[r, g])) * float(w.scales[r, g])  # exact in double
            assert out[r, w.perm[k]].item() == want


@pytest.mark.parametrize("bits, group_size, scale_dtype, perm", CASES)
@pytest.mark.parametrize("scalar", PATHS)
def test_pack_is_lossless_and_dequantizes_exactly(bits, group_size, scale_dtype, perm, scalar, two_threads):
    w = random_weight(bits, 301, 256, group_size, scale_dtype, perm)  # 37 groups of 8 rows and one of 5
    p = cpu_quant_group.pack(w)
    back = cpu_quant_group.unpack(p)
    assert torch.equal(back.q, w.q) and torch.equal(back.scales, w.scales) and torch.equal(back.zeros, w.zeros)
    assert p.num_bytes == w.num_bytes + 3 * (256 * bits // 8 + 256 // group_size * (w.scales.element_size() + 2))
    assert torch.equal(cpu_quant_group.dequantize(p, scalar=scalar), dequantize_group_ref(w))
    kernel_order = dequantize_group_ref(GroupQuantWeight(bits, group_size, w.q, w.scales, w.zeros))
    for r0, n in ((3, 9), (296, 5), (8, 8)):  # runs of rows that start and end inside groups (prefill tiles)
        assert torch.equal(cpu_quant_group._dequantize_rows(p, r0, n, scalar), kernel_order[r0:r0 + n])


@pytest.mark.parametrize("bits, group_size, scale_dtype, perm", CASES)
@pytest.mark.parametrize("scalar", PATHS)
def test_linear_matches_the_reference(bits, group_size, scale_dtype, perm, scalar, two_threads):
    w = random_weight(bits, 77, 256, group_size, scale_dtype, perm, seed=1)
    p = cpu_quant_group.pack(w)
    bias = torch.randn(77)
    for m in (1, 3, 16, 40):
        x = torch.randn(m, 256)
        ref = group_linear_ref(x, w, bias)
        out = cpu_quant_group.linear(x, p, bias, scalar=scalar, tiles=m == 40)
        err = (out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
        assert err <= KERNEL_TOL, (m, err)
        if m == 40:  # tiles + GEMM: the reference's own math (the GEMM on the same columns, permuted alike)
            want = torch.nn.functional.linear(x[:, w.perm] if perm else x, cpu_quant_group._dequantize_rows(
                p, 0, 77, scalar), bias)
            assert torch.equal(out, want)
    x = torch.randn(2, 256)  # the engine's entry point hands these weights over
    assert torch.equal(cpu_quant.linear(x, p, bias, activations="fp32", isa="scalar" if scalar else None),
                       cpu_quant_group.linear(x, p, bias, scalar=scalar))


@pytest.mark.parametrize("scalar", PATHS)
def test_an_act_order_gemv_is_c_calls_only_and_replays(scalar):
    """The permutation applied in C: the call records (no torch operator) and a replay on new x values gives what an
    eager call gives, bit for bit (the same kernel)."""
    w = random_weight(4, 40, 256, 64, perm=True, seed=3)
    p = cpu_quant_group.pack(w)
    x = torch.randn(3, 256)
    cpu_quant_group.linear(x, p, scalar=scalar)  # ctypes looks the function up before the recording
    rec, out = cpu_graph.record(lambda: cpu_quant_group.linear(x, p, scalar=scalar))
    assert [fn.__name__ for fn, _ in rec.calls] == ["duet_group_linear_f32"]
    x.copy_(torch.randn(3, 256))
    rec.replay()
    assert torch.equal(out, cpu_quant_group.linear(x, p, scalar=scalar))
    ref = group_linear_ref(x, w)
    assert (out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt() <= KERNEL_TOL


def test_join_rows_and_bad_input():
    a, b = random_weight(4, 8, 64, 32, seed=1), random_weight(4, 16, 64, 32, seed=2)
    joined = join_rows([a, b])
    assert torch.equal(dequantize_group_ref(joined), torch.cat([dequantize_group_ref(a), dequantize_group_ref(b)]))
    with pytest.raises(ValueError, match="column order"):
        join_rows([a, random_weight(4, 8, 64, 32, perm=True)])
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 32 dividing cols 64, got 48"):
        GroupQuantWeight(4, 48, a.q, a.scales, a.zeros)
    with pytest.raises(ValueError, match="4 or 8 bits, got 2"):
        GroupQuantWeight(2, 32, a.q, a.scales, a.zeros)
    with pytest.raises(ValueError, match="zeros must be int16"):
        GroupQuantWeight(4, 32, a.q, a.scales, a.zeros.int())
    with pytest.raises(ValueError, match="perm must be a permutation of the 64 columns"):
        cpu_quant_group.pack(GroupQuantWeight(4, 32, a.q, a.scales, a.zeros, torch.zeros(64, dtype=torch.int64)))
    p = cpu_quant_group.pack(a)
    with pytest.raises(ValueError, match="x must be a 2-D float32 CPU tensor of 64 columns"):
        cpu_quant_group.linear(torch.randn(2, 32), p)
