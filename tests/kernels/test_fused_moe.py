"""fused_moe (Triton) against fused_moe_ref, and the align step's block layout.

Shapes: decode (T = 1, most experts without a token), prefill spanning several row blocks per expert, H and I
not multiples of the tiles (masked K tails, wrapped columns), k from 1 to 3, experts with zero tokens forced.
Tolerances (tests/kernels/paged.py): fp32 2e-5 (the kernel sums in another order); fp16/bf16 2e-3/1.6e-2 abs
and rel: the kernel rounds the activation silu(gate) * up to the dtype before the down GEMM (the reference
keeps fp32), which with the output's own rounding stays within about one output ulp (measured in the
interpreter, bf16: max |Δ| 0.0039 on outputs up to 1.4).
"""
from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import _launch, _MoeConfig, fused_moe, fused_moe_ref, moe_align
from tests.kernels.paged import DEVICE, assert_close

CASES = [  # (T, E, top_k, H, I)
    (1, 8, 2, 64, 32),  # decode: 6 of 8 experts idle
    (1, 4, 1, 32, 24),
    (5, 6, 2, 48, 40),  # I and H not multiples of the 64-wide tiles
    (40, 4, 3, 100, 72),  # ~30 rows per expert: 2 row blocks each; K tails in both GEMMs
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def operands(t, e, top_k, h, i, dtype, seed=0, weights_fp32=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    gate_up = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    down = torch.randn(e, h, i, generator=g) / i ** 0.5
    weights, ids = torch.softmax(torch.randn(t, e, generator=g), -1).topk(top_k, -1)
    weights = weights if weights_fp32 else weights.to(dtype)
    return [a.to(DEVICE) for a in (x.to(dtype), weights, ids, gate_up.to(dtype), down.to(dtype))]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("t,e,top_k,h,i", CASES)
def test_fused_moe_matches_reference(t, e, top_k, h, i, dtype):
    args = operands(t, e, top_k, h, i, dtype)
    assert_close(fused_moe(*args), fused_moe_ref(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_router_weights_in_the_model_dtype_and_int32_ids(dtype):
    """Qwen's weights come rounded to the model dtype (Mixtral's stay fp32); ids may be int32."""
    x, weights, ids, gate_up, down = operands(6, 5, 2, 32, 40, dtype, seed=3, weights_fp32=False)
    assert_close(fused_moe(x, weights, ids.int(), gate_up, down), fused_moe_ref(x, weights, ids, gate_up, down))


def test_experts_with_zero_tokens():
    x, weights, _, gate_up, down = operands(9, 8, 2, 48, 40, torch.float32, seed=1)
    ids = torch.tensor([[1, 6], [6, 1], [6, 3]] * 3, device=DEVICE)  # experts 0, 2, 4, 5, 7 get none
    assert_close(fused_moe(x, weights, ids, gate_up, down), fused_moe_ref(x, weights, ids, gate_up, down))


@pytest.mark.parametrize("cfg", [_MoeConfig(16, 32, 32, 4, 1), _MoeConfig(32, 16, 16, 4, 1)],
                         ids=["bm16-bn32-bk32", "bm32-bn16-bk16"])
def test_other_tile_configs(cfg):
    """Smaller tiles than the interpreter's default: several column tiles, K loops of many steps, BLOCK_M 32."""
    args = operands(40, 4, 3, 100, 72, torch.float32, seed=2)
    assert_close(_launch(*args, cfg=cfg), fused_moe_ref(*args))


def test_no_tokens():
    x, weights, ids, gate_up, down = operands(1, 4, 2, 32, 24, torch.float32)
    out = fused_moe(x[:0], weights[:0], ids[:0], gate_up, down)
    assert out.shape == (0, 32) and out.dtype == torch.float32


@pytest.mark.parametrize("t,e,top_k,block_m", [(1, 8, 2, 16), (40, 4, 3, 16), (33, 64, 8, 64)])
def test_align_lays_each_pair_once_into_its_experts_blocks(t, e, top_k, block_m):
    g = torch.Generator().manual_seed(t)
    ids = torch.rand(t, e, generator=g).topk(top_k, -1).indices
    pair_ids, block_expert = moe_align(ids, e, block_m)
    flat, num_pairs = ids.reshape(-1), t * top_k
    assert pair_ids.numel() == block_expert.numel() * block_m
    assert block_expert.numel() == (num_pairs + min(e, num_pairs) * (block_m - 1)) // block_m  # the bound
    row_expert = block_expert.long().repeat_interleave(block_m)
    real = pair_ids < num_pairs
    assert sorted(pair_ids[real].tolist()) == list(range(num_pairs))  # each pair exactly once
    assert torch.equal(row_expert[real], flat[pair_ids[real].long()])  # in a block of its own expert
    used = torch.bincount(flat, minlength=e).gt(0).sum()
    assert (block_expert < e).sum() == (-(-torch.bincount(flat, minlength=e) // block_m)).sum()
    assert int(used) == len(set(block_expert[block_expert < e].tolist()))
    assert torch.equal(block_expert[block_expert < e], block_expert[block_expert < e].sort().values)  # ascending
    for expert in range(e):  # pairs in order within an expert (the stable sort)
        mine = pair_ids[real & (row_expert == expert)]
        assert torch.equal(mine, mine.sort().values)


def test_align_bound_is_met_when_every_expert_pads_a_block():
    ids = torch.tensor([[2], [0], [3], [1]], device=DEVICE)  # 4 experts of 1 pair: 4 blocks of 15 padding rows
    pair_ids, block_expert = moe_align(ids, 4, 16)
    assert block_expert.tolist() == [0, 1, 2, 3] and pair_ids[::16].tolist() == [1, 3, 0, 2]
    assert (pair_ids.view(4, 16)[:, 1:] == 4).all()


def _valid_args():
    x, weights, ids, gate_up, down = operands(3, 4, 2, 32, 24, torch.float16)
    return dict(x=x, weights=weights, ids=ids, gate_up_proj=gate_up, down_proj=down)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.update(x=a["x"][0]), ValueError, "x must have 2 dims"),
    (lambda a: a.update(x=a["x"].int()), TypeError, "x has dtype"),
    (lambda a: a.update(x=a["x"][:, :16]), ValueError, "x has 16 features but the experts' hidden size is 32"),
    (lambda a: a.update(ids=a["ids"].float()), TypeError, "ids has dtype"),
    (lambda a: a.update(ids=a["ids"][:2]), ValueError, r"ids has shape \(2, 2\), expected \[3, k\]"),
    (lambda a: a.update(ids=torch.zeros(3, 5, dtype=torch.long, device=DEVICE)), ValueError, "1 <= k <= 4"),
    (lambda a: a.update(ids=a["ids"] + 3), ValueError, r"ids must be in \[0, 4\)"),
    (lambda a: a.update(weights=a["weights"][:, :1]), ValueError, "weights has shape"),
    (lambda a: a.update(gate_up_proj=a["gate_up_proj"].float()), TypeError, "gate_up_proj has dtype"),
    (lambda a: a.update(gate_up_proj=a["gate_up_proj"][:, :40]), ValueError, "gate_up_proj has shape"),
    (lambda a: a.update(down_proj=a["down_proj"][:3]), ValueError, "gate_up_proj has shape"),
    (lambda a: a.update(down_proj=a["down_proj"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "down_proj must be contiguous in its last dim"),
    (lambda a: a.update(down_proj=a["down_proj"][:, :, :0]), ValueError, "has an empty dim"),
    (lambda a: a.update(weights=a["weights"].to("meta")), ValueError, "weights is on meta"),
])
def test_rejects_bad_arguments_by_name(change, error, match, monkeypatch):
    monkeypatch.setenv("DUET_KERNEL_CHECKS", "1")  # the ids' range is a value check (host read)
    args = _valid_args()
    change(args)
    with pytest.raises(error, match=match):
        fused_moe(**args)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device (the sync check and the graph capture are "
                                                  "CUDA's); the CPU suite runs the interpreter only")
def test_cuda_path_reads_nothing_on_the_host_and_replays_in_a_graph(monkeypatch):
    monkeypatch.setenv("DUET_KERNEL_CHECKS", "0")  # the value checks are the one host read, opt-in on CUDA
    args = operands(8, 16, 4, 256, 128, torch.bfloat16)
    want = fused_moe(*args)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
