"""engine/models/moe.py on its own: the grouped expert GEMMs against the per-token definition (every backend: torch, the
C kernels, Triton in the interpreter), the routing counts, the router's rounding (Qwen vs Mixtral), and which path
the layer takes (a backend's fused_moe when it has one: triton, kernels/fused_moe.py; tested in tests/kernels)."""
from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from engine.models.config_moe import MoeFields
from engine.models.kernel_backend import get_ops
from engine.models.moe import Experts, SparseMoE, grouped_experts, route


def experts(e: int = 5, hidden: int = 32, inter: int = 24, seed: int = 0) -> Experts:
    g = torch.Generator().manual_seed(seed)
    ex = Experts(e, hidden, inter)
    ex.gate_up_proj.data = torch.randn(e, 2 * inter, hidden, generator=g) / hidden ** 0.5
    ex.down_proj.data = torch.randn(e, hidden, inter, generator=g) / inter ** 0.5
    return ex


def by_definition(x, weights, ids, ex) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = (ex.gate_up_proj[ids[t, j]] @ x[t]).split([ex.inter] * 2)
            out[t] += weights[t, j] * (ex.down_proj[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    return out


BACKENDS = ["torch", "cpu"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens, top_k", [(1, 1), (7, 2), (40, 5)])
def test_grouped_experts_equal_the_per_token_definition(backend, tokens, top_k):
    ex, g = experts(), torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 32, generator=g)
    weights, ids = route(torch.randn(tokens, 5, generator=g), top_k, renormalize=True, weights_fp32=False)
    counts = torch.zeros(5, dtype=torch.int64)
    got = grouped_experts(x, weights, ids, ex, get_ops(backend), counts)
    torch.testing.assert_close(got, by_definition(x, weights, ids, ex), rtol=1e-4, atol=1e-5)
    assert counts.tolist() == torch.bincount(ids.reshape(-1), minlength=5).tolist()
    assert counts.sum() == tokens * top_k


def test_unused_experts_are_skipped_and_counted_as_zero():
    ex = experts()
    x = torch.randn(4, 32)
    ids = torch.tensor([[3], [3], [1], [3]])
    counts = torch.zeros(5, dtype=torch.int64)
    got = grouped_experts(x, torch.ones(4, 1), ids, ex, get_ops("torch"), counts)
    torch.testing.assert_close(got, by_definition(x, torch.ones(4, 1), ids, ex))
    assert counts.tolist() == [0, 1, 0, 3, 0]


def test_router_weights_qwen_rounds_to_the_model_dtype_mixtral_keeps_fp32():
    logits = torch.randn(6, 8).to(torch.bfloat16)
    w_qwen, ids = route(logits, 2, renormalize=False, weights_fp32=False)
    w_mix, ids2 = route(logits, 2, renormalize=True, weights_fp32=True)
    probs = torch.softmax(logits.float(), -1)
    top, want_ids = probs.topk(2, -1)
    assert torch.equal(ids, want_ids) and torch.equal(ids2, want_ids)
    assert w_qwen.dtype == torch.bfloat16 and torch.equal(w_qwen, top.to(torch.bfloat16))
    assert w_mix.dtype == torch.float32 and torch.allclose(w_mix.sum(-1), torch.ones(6))


def test_only_the_triton_backend_has_a_fused_moe():
    from kernels import fused_moe

    assert get_ops("triton").fused_moe is fused_moe.fused_moe and get_ops("triton", "cuda").fused_moe is not None
    assert get_ops("torch").fused_moe is None and get_ops("cpu").fused_moe is None


@pytest.mark.parametrize("fused", [True, False], ids=["fused_moe", "grouped"])
def test_sparse_moe_hands_the_experts_to_the_backends_fused_moe_when_it_has_one(fused):
    from kernels.fused_moe import fused_moe_ref

    calls = []

    def spy(*args):
        calls.append(args)
        return fused_moe_ref(*args)

    ops = dataclasses.replace(get_ops("torch"), fused_moe=spy if fused else None)
    cfg = SimpleNamespace(hidden_size=32, moe=MoeFields(5, 2, 24, norm_topk_prob=True))
    layer = SparseMoE(cfg, ops, dense_mlp=None)
    layer.experts = experts()
    layer.gate.weight.data = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(2))
    weights, ids = route(layer.gate(x), 2, renormalize=True, weights_fp32=False)
    torch.testing.assert_close(layer(x), by_definition(x, weights, ids, layer.experts), rtol=1e-4, atol=1e-5)
    assert len(calls) == int(fused)
    assert layer.tokens_per_expert.tolist() == torch.bincount(ids.reshape(-1), minlength=5).tolist()
