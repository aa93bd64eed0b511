"""The Triton fused per-token ops (kernels/fused.py) against the eager torch code they replace
(engine/models/layers.py).

fp32: equal within 1e-5 relative (the row sum of RMSNorm is added in another order). bf16 / fp16: the kernels
round where torch's separate ops round, so the values are the same (measured in the interpreter: every bf16 case
here exact; fp16 SwiGLU 2 of 6,144 elements one ulp off, an fp32 exp one ulp apart rounding to the other
neighbour): we allow at most 1 % of elements off, and those by at most one ulp of the dtype.

Compiled on a GPU the fp32 steps between those roundings are the GPU's (``tl.exp`` is ``ex2.approx``; measured on
an H200, 2026-11-25: 13 % of bf16 rotary elements and fp16 SwiGLU elements 2 ulps apart from torch's), so there
the rotary and SwiGLU kernels are held to accuracy instead: every element within torch's own error of the exact
(float64) value plus two ulps of the magnitude of the terms it sums.
"""
from __future__ import annotations

import pytest
import torch

from engine.models.config import ModelConfig
from engine.models.layers import RMSNorm, RotaryEmbedding
from kernels import fused
from tests.kernels.paged import DEVICE

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
COMPILED = DEVICE.type == "cuda"  # the kernels run compiled (else in the interpreter, numpy's fp32)


def assert_matches(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor | None = None,
                   terms: torch.Tensor | None = None) -> None:
    """``got`` (the kernel) against ``want`` (torch's eager ops); with ``exact`` (float64) and ``terms`` (the
    magnitude of what each element sums), compiled low-precision results are held to accuracy (module doc)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    if COMPILED and exact is not None:
        g, w, x = got.double().cpu(), want.double().cpu(), exact.double().cpu()
        fin = torch.finfo(got.dtype)
        bound = (w - x).abs() + 2 * fin.eps * terms.double().cpu().clamp_min(fin.tiny)
        worst = float(((g - x).abs() - bound).max()) if g.numel() else 0.0
        assert worst <= 0, f"an element is {worst:.3g} further from the exact value than torch's + 2 ulps"
        return
    g, w = got.float().cpu(), want.float().cpu()
    diff = (g - w).abs()
    ulp = torch.finfo(got.dtype).eps * w.abs().clamp_min(torch.finfo(got.dtype).tiny)
    off = diff > 0
    assert int(off.sum()) <= 0.01 * off.numel(), f"{int(off.sum())} of {off.numel()} elements differ"
    assert bool((diff <= ulp * 1.01 + 1e-30).all()), f"max difference {float(diff.max())} is more than one ulp"


def rows(t: int, n: int, dtype, seed: int, width: int | None = None, scale: float = 1.0) -> torch.Tensor:
    """[t, n] rows, as a column slice of a [t, width] buffer when width is given (strided rows)."""
    gen = torch.Generator().manual_seed(seed)
    buf = (torch.randn(t, width or n, generator=gen) * scale).to(dtype=dtype, device=DEVICE)
    return buf[:, :n]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n,width", [(5, 576, None), (3, 72, 200), (1, 64, None), (0, 64, None)])
def test_rms_norm_with_and_without_residual(dtype, t, n, width):
    norm = RMSNorm(n, 1e-5).to(DEVICE)
    norm.weight.data = (torch.rand(n, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype=dtype, device=DEVICE)
    x = rows(t, n, dtype, 1, width, scale=3.0)
    assert_matches(fused.rms_norm(x, norm.weight, norm.eps), norm(x))

    residual = rows(t, n, dtype, 2, width)
    want_out, want_res = norm(x, residual.clone())
    got_res = residual.clone()
    got_out = fused.rms_norm(x, norm.weight, norm.eps, got_res)
    assert_matches(got_out, want_out)
    assert torch.equal(got_res, want_res)  # one rounded add: exact


def _rope(head_dim: int, partial_rotary_factor: float = 1.0) -> RotaryEmbedding:
    cfg = ModelConfig(architecture="Phi3ForCausalLM" if partial_rotary_factor != 1.0 else "LlamaForCausalLM",
                      vocab_size=64, hidden_size=head_dim * 4, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=head_dim, intermediate_size=8, max_position_embeddings=256, rms_norm_eps=1e-5,
                      partial_rotary_factor=partial_rotary_factor)
    return RotaryEmbedding(cfg, 256).to(DEVICE)


def rope_exact(rope: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x rotated in float64 with the tables rounded to x's dtype as both implementations use them, the
    magnitude |x·cos| + |rotate_half(x)·sin| of its two terms) for ``x [T, H, D]``."""
    cos = rope.cos[positions].to(x.dtype).double()[:, None, :]
    sin = rope.sin[positions].to(x.dtype).double()[:, None, :]
    xd = x.double()
    half = xd.shape[-1] // 2
    rot = torch.cat((-xd[..., half:], xd[..., :half]), dim=-1)
    return xd * cos + rot * sin, (xd * cos).abs() + (rot * sin).abs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(64, 9, 3), (32, 4, 4), (80, 2, 1)])
def test_rotary_in_place_on_the_fused_qkv_rows(dtype, head_dim, q_heads, kv_heads):
    rope = _rope(head_dim)
    t = 6
    qkv = rows(t, (q_heads + 2 * kv_heads) * head_dim, dtype, 4, scale=2.0).contiguous()
    positions = torch.tensor([0, 1, 7, 100, 255, 31], device=DEVICE)
    q = qkv[:, : q_heads * head_dim].reshape(t, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim: (q_heads + kv_heads) * head_dim].reshape(t, kv_heads, head_dim)
    want_q, want_k = rope(positions, q, k)
    exact_q, exact_k = rope_exact(rope, positions, q), rope_exact(rope, positions, k)
    v_before = qkv[:, (q_heads + kv_heads) * head_dim:].clone()
    fused.rotary_(qkv, q_heads + kv_heads, head_dim, positions, rope.cos, rope.sin)
    assert_matches(qkv[:, : q_heads * head_dim], want_q.reshape(t, -1), *(e.reshape(t, -1) for e in exact_q))
    assert_matches(qkv[:, q_heads * head_dim: (q_heads + kv_heads) * head_dim], want_k.reshape(t, -1),
                   *(e.reshape(t, -1) for e in exact_k))
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_dim:], v_before)  # the v heads are not touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,factor", [(16, 0.75), (64, 0.75), (32, 0.25)])  # half 6: a masked tile
def test_partial_rotary_turns_the_front_of_each_head_only(dtype, head_dim, factor):
    """Phi-4-mini's partial rotary: the first rotary_dim dims of each q/k head as the torch layer rotates them
    (transformers' Phi-3 arithmetic), the rest of each head and the v heads bit for bit as they were."""
    rope, t, q_heads, kv_heads = _rope(head_dim, factor), 5, 4, 2
    rot = rope.rotary_dim
    assert rot == int(head_dim * factor) < head_dim and rope.cos.shape == (256, rot)
    qkv = rows(t, (q_heads + 2 * kv_heads) * head_dim, dtype, 7, scale=2.0).contiguous()
    positions = torch.tensor([0, 5, 77, 255, 31], device=DEVICE)
    heads = qkv[:, : (q_heads + kv_heads) * head_dim].reshape(t, q_heads + kv_heads, head_dim)
    want = torch.cat(rope(positions, heads[:, :q_heads], heads[:, q_heads:]), dim=1)
    exact, terms = rope_exact(rope, positions, heads[..., :rot])
    before = qkv.clone()
    fused.rotary_(qkv, q_heads + kv_heads, head_dim, positions, rope.cos, rope.sin, rotary_dim=rot)
    got = qkv[:, : (q_heads + kv_heads) * head_dim].reshape(t, q_heads + kv_heads, head_dim)
    assert_matches(got[..., :rot].reshape(t, -1), want[..., :rot].reshape(t, -1), exact.reshape(t, -1),
                   terms.reshape(t, -1))
    passed = before[:, : (q_heads + kv_heads) * head_dim].reshape(t, q_heads + kv_heads, head_dim)[..., rot:]
    assert torch.equal(got[..., rot:], passed) and torch.equal(want[..., rot:], passed)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_dim:], before[:, (q_heads + kv_heads) * head_dim:])
    with pytest.raises(ValueError, match=rf"\[max_positions, {head_dim}\] table"):  # a partial table, no rotary_dim
        fused.rotary_(qkv, q_heads + kv_heads, head_dim, positions, rope.cos, rope.sin)
    with pytest.raises(ValueError, match="rotary_dim 7 must be even"):
        fused.rotary_(qkv, q_heads + kv_heads, head_dim, positions, rope.cos, rope.sin, rotary_dim=7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n,width", [(4, 1536, None), (3, 40, 100), (0, 8, None)])
def test_silu_mul(dtype, t, n, width):
    x = rows(t, 2 * n, dtype, 5, width, scale=4.0)
    gate, up = x[:, :n], x[:, n:]
    exact = torch.nn.functional.silu(gate.double()) * up.double()
    assert_matches(fused.silu_mul(x), torch.nn.functional.silu(gate) * up, exact, exact.abs())


def test_silu_mul_extremes():
    x = torch.tensor([[-100.0, 100.0, 0.0, -1e-3, 2.0, 2.0, 2.0, 3.0]], device=DEVICE)
    gate, up = x[:, :4], x[:, 4:]
    out = fused.silu_mul(x)
    assert bool(out.isfinite().all())
    assert_matches(out, torch.nn.functional.silu(gate) * up)


def test_argument_errors():
    x = torch.randn(3, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="x has rows of 8, expected 4"):
        fused.rms_norm(x, w[:4], 1e-5)
    with pytest.raises(TypeError, match="weight has dtype"):
        fused.rms_norm(x, w.half(), 1e-5)
    with pytest.raises(ValueError, match="residual has shape"):
        fused.rms_norm(x, w, 1e-5, torch.zeros(2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        fused.rms_norm(x.t().contiguous().t(), w, 1e-5)
    with pytest.raises(ValueError, match="gate and up"):
        fused.silu_mul(torch.randn(2, 7, device=DEVICE))
    rope = _rope(4 * 2)
    qkv = torch.randn(2, 24, device=DEVICE)
    with pytest.raises(ValueError, match="no room"):
        fused.rotary_(qkv, 4, 8, torch.tensor([0, 1], device=DEVICE), rope.cos, rope.sin)
    with pytest.raises(ValueError, match=r"positions must be in \[0, 256\)"):
        fused.rotary_(qkv, 3, 8, torch.tensor([0, 256], device=DEVICE), rope.cos, rope.sin)
    with pytest.raises(TypeError, match="positions has dtype"):
        fused.rotary_(qkv, 3, 8, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), rope.cos, rope.sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_on_an_offset_column_slice_touches_nothing_else(dtype):
    rope, t, head_dim, heads = _rope(32), 5, 32, 3
    buf = rows(t, 8 + heads * head_dim + 8, dtype, 6).contiguous()  # the slice starts 8 columns in
    x = buf[:, 8: 8 + heads * head_dim]
    positions = torch.tensor([3, 0, 9, 200, 17], device=DEVICE)
    want = rope(positions, x.reshape(t, heads, head_dim), x.reshape(t, heads, head_dim))[0].reshape(t, -1)
    exact = [e.reshape(t, -1) for e in rope_exact(rope, positions, x.reshape(t, heads, head_dim))]
    before = buf.clone()
    fused.rotary_(x, heads, head_dim, positions, rope.cos, rope.sin)
    assert_matches(x, want, *exact)
    assert torch.equal(buf[:, :8], before[:, :8]) and torch.equal(buf[:, -8:], before[:, -8:])


def test_rotary_on_no_rows():
    rope = _rope(32)
    x = torch.zeros(0, 96, device=DEVICE)
    fused.rotary_(x, 3, 32, torch.zeros(0, dtype=torch.long, device=DEVICE), rope.cos, rope.sin)
    assert x.shape == (0, 96)
