"""Batched LoRA (issue 50): every token's adapter delta added in place into the base projection's output, the
adapter chosen per token by its slot (SGMV's semantics, Punica / S-LoRA):

    out[t] += scaling[s] * (x[t] @ a[s]^T) @ bt[s]        s = token_slots[t]; s == -1: the base alone, skipped

``a`` [slots, S*R, K] and ``bt`` [slots, S*R, N] (B transposed) for a projection of S shards (a fused q/k/v or
gate/up; 1 otherwise) at R ranks per shard: shard i's A rows are i*R .. i*R + R-1, and its B rows, over its own
output columns ``shard_cols[i] .. shard_cols[i+1]`` only (``bt`` block-diagonal, zero elsewhere: the layout of
engine/lora/pool.py). The kernels read only the diagonal blocks; the reference multiplies the whole ``bt`` (its
zero blocks add exactly 0). The scaling is applied to the rank-R intermediate.

Launcher ``lora_add`` (Triton, the ``triton`` kernel backend), one signature with kernels/cpu_lora.py's C kernel
(the ``cpu`` backend) and the reference ``lora_add_ref``. Two kernels, the intermediate ``h`` [T, S*R] in fp32
between them, each one program per (token, tile) that returns at once for a token of slot -1 (BGMV-style: a
token's adapter weights are read by its own programs; on a GPU many tokens of one adapter read it from L2). Math in
fp32 from the loads on (bf16 / fp16 models included), the output rounded once to its dtype; the slots are read on
the device, so a step holding them in a static buffer replays from a CUDA graph (not wired in the engine yet: its
CUDA graphs stay off with LoRA, engine/model_runner.py). Tested in the interpreter (tests/kernels/test_lora.py) and
compiled for sm_90 (tests/kernels/sm90_compile.py); never timed on a GPU here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _triton_utils as tu
from kernels.fused import _round


@triton.jit
def _lora_shrink_kernel(
    x_ptr,        # [T, K]
    a_ptr,        # [slots, SR, K] contiguous
    scaling_ptr,  # [slots] fp32
    slots_ptr,    # [T] int64: each token's slot, -1 = base
    h_ptr,        # [T, SR] fp32 out
    stride_x, K, SR,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    mask_j = offs_j < SR
    rows = a_ptr + slot * SR * K + offs_j.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_J], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xv = tl.load(x_ptr + t * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        av = tl.load(rows + offs_k[None, :], mask=mask_j[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    scale = tl.load(scaling_ptr + slot).to(tl.float32)
    tl.store(h_ptr + t * SR + offs_j, acc * scale, mask=mask_j)


@triton.jit
def _lora_expand_kernel(
    h_ptr,           # [T, SR] fp32
    bt_ptr,          # [slots, SR, N] contiguous
    slots_ptr,       # [T] int64
    shard_cols_ptr,  # [S + 1] int64: shard i's columns are shard_cols[i] .. shard_cols[i + 1]
    out_ptr,         # [T, N], updated in place
    stride_o, N, SR, R,
    S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    shard = tl.zeros([BLOCK_N], dtype=tl.int64)
    for i in tl.static_range(1, S):
        shard += (offs_n >= tl.load(shard_cols_ptr + i)).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask = (offs_r < R)[:, None] & mask_n[None, :]
        rows = shard[None, :] * R + offs_r[:, None]  # [BLOCK_R, BLOCK_N]: each column's own shard's B rows
        hv = tl.load(h_ptr + t * SR + rows, mask=mask, other=0.0)
        bv = tl.load(bt_ptr + slot * SR * N + rows * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(hv * bv, axis=0)
    o = out_ptr + t * stride_o + offs_n
    base = tl.load(o, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(o, _round(base + acc, out_ptr.dtype.element_ty, RNE_BF16), mask=mask_n)


def check_lora_args(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scaling: torch.Tensor,
                    token_slots: torch.Tensor, shard_cols: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """Shapes, dtypes and layouts of a ``lora_add`` call (both launchers); the values are the kernels' (the C one
    checks them on every call) or ``check_lora_values``'. Every projection of every step calls this: one combined
    test first (~1 us), the checks that name the argument only when it fails."""
    dt, i64 = out.dtype, torch.int64
    try:
        t, k = x.shape
        n_slots, sr, _ = a.shape
        ok = (dt in dtypes and x.dtype == dt and a.dtype in tu.FLOAT_DTYPES and bt.dtype == a.dtype
              and scaling.dtype in (torch.float32, dt) and token_slots.dtype == i64 and shard_cols.dtype == i64
              and out.dim() == 2 and out.shape[0] == t and a.shape[2] == k
              and bt.shape == (n_slots, sr, out.shape[1]) and scaling.shape == (n_slots,)
              and token_slots.shape == (t,) and shard_cols.dim() == 1 and 1 <= shard_cols.shape[0] - 1
              and sr % (shard_cols.shape[0] - 1) == 0 and a.is_contiguous() and bt.is_contiguous()
              and scaling.is_contiguous() and token_slots.is_contiguous() and shard_cols.is_contiguous()
              and (k <= 1 or x.stride(1) == 1) and (out.shape[1] <= 1 or out.stride(1) == 1))
    except (AttributeError, ValueError):  # not tensors, or a tensor of other dims
        ok = False
    if not ok:
        _explain_lora_args(out, x, a, bt, scaling, token_slots, shard_cols, dtypes)


def _explain_lora_args(out, x, a, bt, scaling, token_slots, shard_cols, dtypes) -> None:
    """The error naming the first argument ``check_lora_args`` refused."""
    tu.check_tensor("out", out, 2, dtypes)
    tu.check_tensor("x", x, 2, (out.dtype,))
    tu.check_tensor("a", a, 3, tu.FLOAT_DTYPES)
    tu.check_tensor("bt", bt, 3, (a.dtype,))
    tu.check_tensor("scaling", scaling, 1, (torch.float32, out.dtype))
    tu.check_tensor("token_slots", token_slots, 1, (torch.int64,))
    tu.check_tensor("shard_cols", shard_cols, 1, (torch.int64,))
    t, k = x.shape
    n_slots, sr = a.shape[0], a.shape[1]
    tu.check_shape("out", out, (t, out.shape[1]))
    tu.check_shape("a", a, (n_slots, sr, k))
    tu.check_shape("bt", bt, (n_slots, sr, out.shape[1]))
    tu.check_shape("scaling", scaling, (n_slots,))
    tu.check_shape("token_slots", token_slots, (t,))
    for name, tensor in (("a", a), ("bt", bt), ("scaling", scaling), ("token_slots", token_slots),
                         ("shard_cols", shard_cols)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
    tu.check_last_dim_contiguous("x", x)
    tu.check_last_dim_contiguous("out", out)
    shards = shard_cols.shape[0] - 1
    if shards < 1 or sr % shards:
        raise ValueError(f"shard_cols {tuple(shard_cols.shape)} must hold S + 1 offsets, S dividing a's {sr} rows")
    raise AssertionError("check_lora_args refused arguments _explain_lora_args accepts")  # the two must agree


def check_lora_values(out: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, shard_cols: torch.Tensor) -> None:
    """Read on the host: every slot in [-1, slots), ``shard_cols`` a partition of ``out``'s columns."""
    if token_slots.numel() and (int(token_slots.min()) < -1 or int(token_slots.max()) >= a.shape[0]):
        raise ValueError(f"token_slots must be in [-1, {a.shape[0]}), got {token_slots.tolist()}")
    cols = shard_cols.tolist()
    if cols[0] != 0 or cols[-1] != out.shape[1] or any(b < a for a, b in zip(cols, cols[1:])):
        raise ValueError(f"shard_cols {cols} must rise from 0 to out's {out.shape[1]} columns")


def lora_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scaling: torch.Tensor,
             token_slots: torch.Tensor, shard_cols: torch.Tensor) -> torch.Tensor:
    """``out`` [T, N] += each token's adapter delta (module docstring), in place; returns ``out``. x [T, K] in out's
    dtype; a [slots, S*R, K], bt [slots, S*R, N] in one float dtype (the LoRA weights' storage: ``lora_dtype``);
    scaling [slots] fp32 or out's dtype; token_slots [T] int64; shard_cols [S + 1] int64 (on the device)."""
    check_lora_args(out, x, a, bt, scaling, token_slots, shard_cols, tu.FLOAT_DTYPES)
    device = tu.check_device(out=out, x=x, a=a, bt=bt, scaling=scaling, token_slots=token_slots,
                             shard_cols=shard_cols)
    if tu.value_checks_enabled(device):
        check_lora_values(out, a, token_slots, shard_cols)
    t, k = x.shape
    n, sr, s = out.shape[1], a.shape[1], shard_cols.shape[0] - 1
    if t == 0 or n == 0:
        return out
    h = torch.empty(t, sr, dtype=torch.float32, device=device)
    block_j = min(triton.next_power_of_2(sr), 64)
    _lora_shrink_kernel[(t, triton.cdiv(sr, block_j))](
        x, a, scaling, token_slots, h, x.stride(0), k, sr, BLOCK_J=block_j,
        BLOCK_K=min(triton.next_power_of_2(k), 128))
    r = sr // s
    block_n = min(triton.next_power_of_2(n), 128)
    _lora_expand_kernel[(t, triton.cdiv(n, block_n))](
        h, bt, token_slots, shard_cols, out, out.stride(0), n, sr, r, S=s, BLOCK_N=block_n,
        BLOCK_R=min(triton.next_power_of_2(r), 32), RNE_BF16=tu.INTERPRET and out.dtype == torch.bfloat16)
    return out


def add_groups_(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scaling: torch.Tensor,
                groups) -> torch.Tensor:
    """The reference's arithmetic, in torch: for each (slot, rows of its tokens) of ``groups``, two GEMMs on those
    rows (shrink to the S*R ranks, times the slot's scaling; expand over the whole ``bt``), added at the rows."""
    for slot, rows in groups:  # weights stored in another dtype than x's (lora_dtype) are widened to it first
        h = (x.index_select(0, rows) @ a[slot].to(x.dtype).T) * scaling[slot]
        out.index_add_(0, rows, h @ bt[slot].to(x.dtype))
    return out


def lora_add_ref(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scaling: torch.Tensor,
                 token_slots: torch.Tensor, shard_cols: torch.Tensor) -> torch.Tensor:
    """The torch reference of ``lora_add`` (``bt``'s off-diagonal blocks must be zero: they are multiplied here,
    skipped by the kernels)."""
    check_lora_args(out, x, a, bt, scaling, token_slots, shard_cols, tu.FLOAT_DTYPES)
    check_lora_values(out, a, token_slots, shard_cols)
    slots = sorted(set(token_slots.tolist()) - {-1})
    return add_groups_(out, x, a, bt, scaling, [(s, (token_slots == s).nonzero()[:, 0]) for s in slots])
