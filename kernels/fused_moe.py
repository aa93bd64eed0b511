"""fused_moe: ``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every token t, each expert a SwiGLU MLP.

The experts' weights are engine/models/moe.py's ``Experts`` layout: ``gate_up_proj`` [E, 2I, H] (gate rows first),
``down_proj`` [E, H, I]. ``fused_moe_ref`` is the definition (fp32, one GEMM pair per expert in use).

The Triton path, after vLLM's fused_moe (our own code), reads no value on the host, so it can sit in a CUDA graph
(by construction: the GPU test of tests/kernels/test_fused_moe.py checks it, not yet run on a GPU; the value
checks of the ids run on CPU tensors only, as everywhere in kernels/):
1. ``moe_align`` (torch ops on the device): the T*k (token, expert) pairs, named by ``pair = t * k + j``, are
   sorted by expert (stable: tokens in order within an expert) and laid out in per-expert blocks of BLOCK_M
   rows, each expert's last block padded with the sentinel ``T * k``. The buffers are sized by the bound
   ``T*k + min(E, T*k) * (BLOCK_M - 1)`` rows, not by the routing; ``block_expert`` holds E past the last used
   block, and those programs return at once. Counts by ``scatter_add_``: ``torch.bincount`` reads the ids'
   min and max on the host on CUDA.
2. ``_moe_gemm_kernel`` over (row block, column tile): every row of a block belongs to the block's one expert,
   so a program is a plain tiled GEMM on gathered rows of its A operand against ``W[e]``. The first launch
   (``SWIGLU``) reads x's rows (``pair // k``), computes the gate and the up tile of ``gate_up_proj[e]`` side
   by side and stores ``silu(gate) * up`` once, rounded to x's dtype (the torch path also rounds gate_up and
   the SiLU: in bf16 the kernel was measured closer to the fp32 definition than grouped_experts, mean error
   2.2 vs 5.7 ulps): no [T*k, 2I] intermediate, no separate SwiGLU kernel. The second
   reads those rows (one per pair) against ``down_proj[e]``, multiplies the router weight in and stores fp32.
3. Each token's k rows (its top-k slots, in the router's order) are summed by torch in fp32 (``sum(dim=1)``: a
   reduction order fixed by the shape, so deterministic run to run; *not* the torch path's ascending expert
   order) and rounded once to x's dtype. Against the reference: fp32 within 2e-5 (reassociated sums), bf16/fp16
   within about one output ulp (the activation rounded to the dtype; tests/kernels/test_fused_moe.py).

Tiles are picked by the mean rows per expert (decode: BLOCK_M 16, the tl.dot minimum); not tuned on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import _triton_utils as tu
from kernels.fused import _round


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k] router weights
    ids: torch.Tensor,  # [T, k] expert ids
    gate_up_proj: torch.Tensor,  # [E, 2I, H], gate rows first
    down_proj: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:  # [T, H], dtype of x
    """The definition, in fp32 and rounded once: for each expert in use, its tokens through gate_up, SwiGLU, down,
    scaled by their router weights and added to their rows."""
    inter = down_proj.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(gate_up_proj.shape[0]):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        if tokens.numel():
            gate, up = (x[tokens].float() @ gate_up_proj[e].float().T).split([inter, inter], dim=-1)
            y = (torch.nn.functional.silu(gate) * up) @ down_proj[e].float().T
            out.index_add_(0, tokens, y * weights[tokens, slots].float()[:, None])
    return out.to(x.dtype)


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_ids [num_blocks * block_m] int32, block_expert [num_blocks] int32) for ``ids [T, k]`` (module doc,
    step 1): block b holds the pairs ``pair_ids[b*block_m : (b+1)*block_m]`` of expert ``block_expert[b]``,
    padded with T*k; ``block_expert`` is ``num_experts`` past the last used block. No host reads."""
    flat = ids.reshape(-1).long()
    num_pairs = flat.numel()
    num_blocks = (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m  # padded rows, a multiple
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    block_expert = torch.searchsorted(block_end, torch.arange(num_blocks, device=ids.device), right=True,
                                      out_int32=True)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - (counts.cumsum(0) - counts)[expert]  # within its expert
    dest = (block_end - blocks)[expert] * block_m + rank
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=ids.device)
    pair_ids.scatter_(0, dest, order.to(torch.int32))
    return pair_ids, block_expert


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [rows, K]: x [T, H] (SWIGLU: a row per token) or the activations [T*k, I] (a row per pair)
    w_ptr,  # [E, N_w, K]: gate_up_proj [E, 2I, H] (SWIGLU, N = I) or down_proj [E, H, I]
    pair_ids_ptr,  # [num_blocks * BLOCK_M] int32, pairs sorted by expert, padded with num_pairs
    block_expert_ptr,  # [num_blocks] int32, num_experts past the last used block
    route_w_ptr,  # [T * k] router weights (read only without SWIGLU)
    out_ptr,  # [T * k, N] a row per pair
    N, K, num_pairs, num_experts,
    stride_am, stride_we, stride_wn, stride_om,
    pairs_per_a_row,  # k for x, 1 for the activations
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWIGLU: tl.constexpr,  # out = silu(A @ W[e, :N].T) * (A @ W[e, N:2N].T) in a's dtype; else (A @ W[e].T) * weight
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:  # past the routed blocks: the grid is sized by the bound, not the routing
        return
    pairs = tl.load(pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    pairs = tl.where(valid, pairs, 0).to(tl.int64)  # padding rows read pair 0, their store is masked
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (offs_n % N).to(tl.int64)  # wrapped: loads need no column mask
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // pairs_per_a_row)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + offs_k[:, None]  # W[e].T tile
    up_ptrs = w_ptrs + N * stride_wn

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if SWIGLU:
            if EVEN_K:
                u = tl.load(up_ptrs)
            else:
                u = tl.load(up_ptrs, mask=k_mask[:, None], other=0.0)
            if UPCAST:
                u = u.to(tl.float32)
            acc_up = tl.dot(a, u, acc_up, input_precision=DOT_PRECISION)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    out_mask = valid[:, None] & (offs_n[None, :] < N)
    out_ptrs = out_ptr + pairs[:, None] * stride_om + offs_n[None, :]
    if SWIGLU:
        act = acc / (1.0 + tl.exp(-acc)) * acc_up
        tl.store(out_ptrs, _round(act, out_ptr.dtype.element_ty, RNE_BF16), mask=out_mask)
    else:
        acc = acc * tl.load(route_w_ptr + pairs).to(tl.float32)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True)
class _MoeConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _pick_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> _MoeConfig:
    """By the mean rows per expert (host-side shapes only); BLOCK_M rows are padded per expert in use."""
    if tu.INTERPRET:
        return _MoeConfig(16, 64, 64, 4, 1)  # few, large programs: the interpreter pays per program
    rows_per_expert = num_pairs / num_experts
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64
    if dtype == torch.float32:
        return _MoeConfig(block_m, 64, 32, 4, 3)
    return _MoeConfig(block_m, 64, 64, 4, 3 if block_m < 64 else 2)


def _launch_grouped_gemm(a, w, pair_ids, block_expert, route_w, out, pairs_per_a_row: int, swiglu: bool,
                         cfg: _MoeConfig) -> None:
    n, k = out.shape[1], a.shape[1]
    num_blocks = block_expert.shape[0]
    grid = (num_blocks, triton.cdiv(n, cfg.block_n))
    _moe_gemm_kernel[grid](
        a, w, pair_ids, block_expert, route_w, out,
        n, k, out.shape[0], w.shape[0],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        pairs_per_a_row,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SWIGLU=swiglu,
        EVEN_K=k % cfg.block_k == 0,
        UPCAST=tu.INTERPRET,  # the interpreter gets bf16 arithmetic wrong: compute in fp32 after loading
        RNE_BF16=tu.INTERPRET and a.dtype == torch.bfloat16,
        DOT_PRECISION=tu.dot_precision(a.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _launch(x, weights, ids, gate_up_proj, down_proj, cfg: _MoeConfig | None = None) -> torch.Tensor:
    """Shared launcher body (arguments already checked); ``cfg`` lets tests force a config."""
    t, top_k = ids.shape
    num_experts, hidden, inter = down_proj.shape
    num_pairs = t * top_k
    if num_pairs == 0:
        return torch.zeros(t, hidden, dtype=x.dtype, device=x.device)
    cfg = cfg or _pick_config(num_pairs, num_experts, x.dtype)
    pair_ids, block_expert = moe_align(ids, num_experts, cfg.block_m)
    route_w = weights.reshape(-1)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _launch_grouped_gemm(x, gate_up_proj, pair_ids, block_expert, route_w, act, top_k, True, cfg)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _launch_grouped_gemm(act, down_proj, pair_ids, block_expert, route_w, y, 1, False, cfg)
    return y.view(t, top_k, hidden).sum(dim=1).to(x.dtype)


def _check_args(x, weights, ids, gate_up_proj, down_proj) -> None:
    tu.check_tensor("x", x, 2, tu.FLOAT_DTYPES)
    tu.check_tensor("weights", weights, 2, tu.FLOAT_DTYPES)
    tu.check_tensor("ids", ids, 2, tu.INDEX_DTYPES)
    tu.check_tensor("gate_up_proj", gate_up_proj, 3, tu.FLOAT_DTYPES)
    tu.check_tensor("down_proj", down_proj, 3, tu.FLOAT_DTYPES)
    device = tu.check_device(x=x, weights=weights, ids=ids, gate_up_proj=gate_up_proj, down_proj=down_proj)
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but x has {x.dtype}")
        tu.check_last_dim_contiguous(name, t)
    num_experts, hidden, inter = down_proj.shape
    if num_experts < 1 or hidden < 1 or inter < 1:
        raise ValueError(f"down_proj [E, H, I] has an empty dim: {tuple(down_proj.shape)}")
    tu.check_shape("gate_up_proj", gate_up_proj, (num_experts, 2 * inter, hidden))
    if x.shape[1] != hidden:
        raise ValueError(f"x has {x.shape[1]} features but the experts' hidden size is {hidden}")
    tu.check_last_dim_contiguous("x", x)
    t, top_k = ids.shape
    if ids.shape[0] != x.shape[0] or not 1 <= top_k <= num_experts:
        raise ValueError(f"ids has shape {tuple(ids.shape)}, expected [{x.shape[0]}, k] with 1 <= k <= {num_experts}")
    tu.check_shape("weights", weights, (t, top_k))
    if tu.value_checks_enabled(device) and ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"ids must be in [0, {num_experts}), got [{lo}, {hi}]")


def fused_moe(
    x: torch.Tensor,  # [T, H] fp16/bf16/fp32
    weights: torch.Tensor,  # [T, k] router weights, fp32 or x's dtype
    ids: torch.Tensor,  # [T, k] int32/int64 expert ids, each in [0, E)
    gate_up_proj: torch.Tensor,  # [E, 2I, H] dtype of x, gate rows first
    down_proj: torch.Tensor,  # [E, H, I] dtype of x
) -> torch.Tensor:  # [T, H], dtype of x
    """Triton fused MoE; same semantics as ``fused_moe_ref`` (module doc: the steps, summation order, tolerance)."""
    _check_args(x, weights, ids, gate_up_proj, down_proj)
    return _launch(x, weights, ids, gate_up_proj, down_proj)
