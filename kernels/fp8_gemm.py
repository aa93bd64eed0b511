"""FP8 checkpoints' linears kept in FP8 (issue 49): W8A8 through ``torch._scaled_mm`` (cuBLAS on a GPU, oneDNN on a
CPU), the activations quantized per call the way the checkpoint's format says. The loader's ``Fp8Weight``
(engine/loading/hf_fp8.py) is packed once by ``pack``; ``linear`` multiplies.

Activations (``Fp8Fields.activations``), x [M, K] in the model dtype:
- ``dynamic-token``: per row, s = max(amax(|x|), floor) / 448 (FBGEMM: amax capped at its ``activation_scale_ub``),
  xq = e4m3(x / s) (round to nearest, saturated at +-448);
- ``static-tensor``: s the layer's calibrated ``input_scale``;
- ``dynamic-group``: per row and group of ``group_size`` columns (DeepSeek-V3's 1 x 128), as dynamic-token per group;
- ``none`` (weight-only FP8): per token too (the W8A16 checkpoints vLLM runs as W8A8 on FP8 hardware).
Weights: a tensor or channel scale goes to ``_scaled_mm`` as a [1, N] column scale, the activation's as [M, 1]: one
GEMM, fp32 accumulation, the product of the two scales applied to each output. A block scale [N / bn, K / bk] (with
group activations, bk = the group) is one ``_scaled_mm`` per column block of K, each with its block's per-column
scales, summed in fp32: exact to the format's definition, K / bk GEMMs (a fused Triton block kernel is not built).

``linear_ref`` is the same arithmetic in plain fp32 (xq and the weight dequantized, one matmul): ``linear`` equals
it within fp32 summation order (tests/kernels/test_fp8_gemm.py). Not timed on a GPU yet (none in any session since
this was written): ``prefer_fp8`` measures FP8 against the dequantized bf16 GEMM per layer shape at load on CUDA and
keeps the faster, as the issue asks ("bf16 where FP8 loses").
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
_FLOOR = 1e-12  # an all-zero row's scale: xq = 0


@dataclass(frozen=True)
class Fp8Packed:
    weight: torch.Tensor  # float8_e4m3fn [N, K] (row-major: its .t() is the column-major B _scaled_mm takes)
    scale: torch.Tensor  # float32 [1, N] (tensor / channel) or [N / bn, K / bk] (block)
    block: tuple[int, int] | None
    activations: str  # Fp8Fields.activations
    group_size: int = 0  # dynamic-group: columns per activation scale
    input_scale: torch.Tensor | None = None  # static-tensor: float32 []
    scale_ub: float | None = None  # dynamic-token: FBGEMM's cap on a row's amax
    dense: torch.Tensor | None = None  # ``as_dense``: the dequantized weight in the model dtype (weight then empty)
    block_cols: torch.Tensor | None = None  # block scales per K block as _scaled_mm's column scales [K / bk, N]
    fmt: str = "FP8"

    @property
    def rows(self) -> int:
        return (self.weight if self.dense is None else self.dense).shape[0]

    @property
    def cols(self) -> int:
        return (self.weight if self.dense is None else self.dense).shape[1]

    @property
    def num_bytes(self) -> int:
        if self.dense is not None:
            return self.dense.numel() * self.dense.element_size()
        cols = 0 if self.block_cols is None else self.block_cols.numel() * 4
        return self.weight.numel() + self.scale.numel() * 4 + cols


def pack(w, activations: str, group_size: int = 0, scale_ub: float | None = None,
         device: str | torch.device = "cpu") -> Fp8Packed:
    """An ``Fp8Weight`` on ``device``; a tensor scale widened to every column (exact: the same value)."""
    if w.block is not None:
        if activations not in ("dynamic-group", "none") or (activations == "dynamic-group"
                                                            and group_size != w.block[1]):
            raise ValueError(f"a {w.block[0]}x{w.block[1]} block weight needs activation groups of {w.block[1]} "
                             f"columns, got {activations} ({group_size})")
        scale = w.scale
    else:
        scale = w.scale.reshape(-1, 1).expand(w.rows, 1).reshape(1, w.rows)
    scale = scale.to(device, torch.float32).contiguous()
    cols = (scale.repeat_interleave(w.block[0], 0)[:w.rows].T.contiguous() if w.block is not None else None)
    return Fp8Packed(w.weight.to(device), scale, w.block, activations,
                     w.block[1] if w.block is not None else group_size,
                     None if w.input_scale is None else w.input_scale.to(device), scale_ub, block_cols=cols)


def quantize_activations(x: torch.Tensor, p: Fp8Packed, cols: slice | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq e4m3 [M, k], s float32 [M, 1]) for x's columns ``cols`` (all by default): x ~= xq * s."""
    x = x.float() if cols is None else x[:, cols].float()
    if p.activations == "static-tensor":
        s = p.input_scale.reshape(1, 1).expand(x.shape[0], 1)
    else:
        amax = x.abs().amax(dim=1, keepdim=True)
        if p.scale_ub is not None:
            amax = amax.clamp(max=p.scale_ub)
        s = amax.clamp(min=_FLOOR) / E4M3_MAX
    return (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s.contiguous()


def _k_blocks(p: Fp8Packed):
    """(column slice of K, its per-column weight scale [1, N]) per K block of a block-scaled weight (expanded once,
    at ``pack``)."""
    bk = p.block[1]
    for j, k0 in enumerate(range(0, p.cols, bk)):
        yield slice(k0, min(k0 + bk, p.cols)), p.block_cols[j:j + 1]


def linear(x: torch.Tensor, p: Fp8Packed, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` in x's dtype, W8A8 (see the module docstring)."""
    if x.shape[-1] != p.cols:
        raise ValueError(f"x has {x.shape[-1]} columns, the FP8 weight {p.cols}")
    if p.dense is not None:
        y = torch.nn.functional.linear(x, p.dense, bias)
        return y if out is None else out.copy_(y)
    if p.block is None:
        xq, s = quantize_activations(x, p)
        y = torch._scaled_mm(xq, p.weight.t(), scale_a=s, scale_b=p.scale, out_dtype=torch.float32)
    else:
        y = None
        for cols, scale_b in _k_blocks(p):
            xq, s = quantize_activations(x, p, cols)
            part = torch._scaled_mm(xq, p.weight[:, cols].t(), scale_a=s, scale_b=scale_b,
                                    out_dtype=torch.float32)
            y = part if y is None else y.add_(part)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype) if out is None else out.copy_(y)


def linear_ref(x: torch.Tensor, p: Fp8Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same in plain fp32: xq * s and the weight dequantized, one matmul; float32 [M, N]."""
    if p.block is None:
        xq, s = quantize_activations(x, p)
        xd, w = xq.float() * s, p.weight.float() * p.scale.reshape(-1, 1)
    else:
        parts, scales = zip(*[(xq.float() * s, sb.reshape(-1, 1).expand(-1, c.stop - c.start))
                              for c, sb in _k_blocks(p) for xq, s in [quantize_activations(x, p, c)]])
        xd, w = torch.cat(parts, dim=1), p.weight.float() * torch.cat(scales, dim=1)
    y = xd @ w.T
    return y if bias is None else y + bias.float()


def prefer_fp8(p: Fp8Packed, dtype: torch.dtype, rows: tuple[int, ...] = (1, 256), reps: int = 20) -> bool:
    """On a GPU: whether the FP8 GEMM beats the dequantized weight in ``dtype`` (cuBLAS) summed over ``rows`` of x
    (decode and prefill sizes), timed here; True off CUDA (nothing to compare: the CPU backends dequantize)."""
    if p.weight.device.type != "cuda":
        return True
    dense = dequantize(p).to(dtype)
    fp8_s = dense_s = 0.0
    for m in rows:
        x = torch.randn(m, p.cols, device=p.weight.device, dtype=dtype)
        fp8_s += _time(linear, (x, p), reps)
        dense_s += _time(torch.matmul, (x, dense.T), reps)
    return fp8_s < dense_s


def _time(fn, args: tuple, reps: int) -> float:
    fn(*args)  # warm (cuBLAS heuristics, allocations)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def as_dense(p: Fp8Packed, dtype: torch.dtype) -> Fp8Packed:
    """``p`` holding its dequantized weight in ``dtype`` instead (where FP8 measured slower), FP8 bytes dropped."""
    from dataclasses import replace

    return replace(p, dense=dequantize(p).to(dtype), weight=p.weight[:0, :0])


def dequantize(p: Fp8Packed) -> torch.Tensor:
    """The weight in fp32 [N, K] (float(q) * its scale)."""
    if p.block is None:
        return p.weight.float() * p.scale.reshape(-1, 1)
    bn, bk = p.block
    s = p.scale.repeat_interleave(bn, 0)[:p.rows].repeat_interleave(bk, 1)[:, :p.cols]
    return p.weight.float() * s
