"""Group-quantized weights of the Hugging Face formats (GPTQ, AWQ, compressed-tensors; issue 48): the data type and
its torch references.

A ``GroupQuantWeight`` is one linear's [rows, cols] weight as those formats define it, unpacked from their int32
words into one unsigned integer per weight (engine/loading/hf_quantized.py): ``bits`` 4 or 8, each row's columns
in groups of ``group_size`` (a multiple of 32; a whole row for per-channel schemes), each group with its own
scale ``s`` and integer zero point ``z``:

    w = (q - z) * s        q in [0, 2^bits), z an integer, s fp16 / bf16 / fp32 as the checkpoint stores it

computed in fp32: q - z exactly in integers, then one fp32 product (exact when s is fp16 or bf16: at most 9 bits
times 11 or 8). That is each format's published dequantization (GPTQ's ``scales * (q - zeros)``, AWQ's
``(q - zeros) * scales``, compressed-tensors' ``(x_q - zero_point) * scale``) carried out in fp32; their own code
computes it in the scale's dtype, which rounds the product to fp16 / bf16 — ours is that product unrounded.
Symmetric schemes have one zero for every group (2^(bits - 1)), stored all the same.

Act-order (GPTQ ``desc_act``, compressed-tensors' ``actorder: group``): a ``g_idx`` maps each input column to its
group, and a group's columns are scattered. The loader permutes the columns once so each group's are contiguous
(``perm``: column k of ``q`` is input column ``perm[k]``), and the kernels take x's columns in the same order
(``x[:, perm]``; the C GEMV gathers them itself): the same products, so the result is exact as without act-order.

``num_bytes`` counts ``q`` at ``bits`` per weight (the packed kernels' form, kernels/cpu_quant_group.py), scales,
zeros and ``perm``: what a packed copy holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_FORMATS = {4: "G4", 8: "G8"}  # bits -> the kernels' format name (KernelOps.quant_formats)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class GroupQuantWeight:
    bits: int
    group_size: int
    q: torch.Tensor  # uint8 [rows, cols], values in [0, 2^bits), columns in ``perm``'s order
    scales: torch.Tensor  # float16 | bfloat16 | float32 [rows, cols // group_size]
    zeros: torch.Tensor  # int16 [rows, cols // group_size]
    perm: torch.Tensor | None = None  # int64 [cols]; None: the identity

    def __post_init__(self) -> None:
        if self.bits not in GROUP_FORMATS:
            raise ValueError(f"group-quantized weights have 4 or 8 bits, got {self.bits}")
        if self.q.dtype != torch.uint8 or self.q.dim() != 2:
            raise ValueError(f"q must be a 2-D uint8 tensor, got {self.q.dtype} {tuple(self.q.shape)}")
        rows, cols = self.q.shape
        if self.group_size <= 0 or self.group_size % 32 or cols % self.group_size:
            raise ValueError(f"group_size must be a positive multiple of 32 dividing cols {cols}, "
                             f"got {self.group_size}")
        groups = (rows, cols // self.group_size)
        if self.scales.dtype not in SCALE_DTYPES or tuple(self.scales.shape) != groups:
            raise ValueError(f"scales must be float16 / bfloat16 / float32 {groups}, got {self.scales.dtype} "
                             f"{tuple(self.scales.shape)}")
        if self.zeros.dtype != torch.int16 or tuple(self.zeros.shape) != groups:
            raise ValueError(f"zeros must be int16 {groups}, got {self.zeros.dtype} {tuple(self.zeros.shape)}")
        if self.perm is not None and (self.perm.dtype != torch.int64 or tuple(self.perm.shape) != (cols,)):
            raise ValueError(f"perm must be int64 [{cols}], got {self.perm.dtype} {tuple(self.perm.shape)}")

    @property
    def fmt(self) -> str:
        return GROUP_FORMATS[self.bits]

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def cols(self) -> int:
        return self.q.shape[1]

    @property
    def num_bytes(self) -> int:
        """Bytes of a packed copy: ``bits`` per weight, the scales, the zeros and the permutation."""
        extra = [self.scales, self.zeros] + ([self.perm] if self.perm is not None else [])
        return self.q.numel() * self.bits // 8 + sum(t.numel() * t.element_size() for t in extra)


def join_rows(parts: list[GroupQuantWeight]) -> GroupQuantWeight:
    """The parts stacked row-wise (a fused q/k/v or gate/up): one format, group size and column order."""
    first = parts[0]
    for p in parts[1:]:
        same_perm = (p.perm is None) == (first.perm is None) and (p.perm is None or torch.equal(p.perm, first.perm))
        if (p.bits, p.group_size, p.cols, p.scales.dtype) != (first.bits, first.group_size, first.cols,
                                                               first.scales.dtype) or not same_perm:
            raise ValueError("parts of one weight differ in bits, group size, width, scale dtype or column order")
    return GroupQuantWeight(first.bits, first.group_size, torch.cat([p.q for p in parts]),
                            torch.cat([p.scales for p in parts]), torch.cat([p.zeros for p in parts]), first.perm)


def dequantize_group_ref(w: GroupQuantWeight) -> torch.Tensor:
    """[rows, cols] float32 in the input's column order: (q - z) * s in fp32 (module docstring)."""
    rows, groups = w.scales.shape
    q = w.q.to(torch.int32).reshape(rows, groups, w.group_size) - w.zeros.to(torch.int32).unsqueeze(-1)
    out = (q.float() * w.scales.float().unsqueeze(-1)).reshape(rows, w.cols)
    if w.perm is None:
        return out
    restored = torch.empty_like(out)
    restored[:, w.perm] = out
    return restored


def group_linear_ref(x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, cols] @ dequantize_group_ref(w).T (+ bias)`` -> [M, rows] float32: torch's linear on the dequantized
    weight, the dense engine's own GEMM (kernels/gemm.py ``gemm_ref``)."""
    return torch.nn.functional.linear(x.float(), dequantize_group_ref(w), bias)
