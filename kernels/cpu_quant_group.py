"""Group-quantized linears (GPTQ / AWQ / compressed-tensors, kernels/quant_group.py) on the CPU, kept packed
(issue 48; C: kernels/cpu/quant_g.c).

``pack`` lays a ``GroupQuantWeight`` out once, at load, as kernels/cpu/quant.c lays out GGUF blocks: rows in groups
of 8, each 32-weight block's quant bytes of the 8 rows interleaved in 4-byte chunks (4 bits: two weights a byte in
ggml's nibble order; 8 bits: one), and one scale (the checkpoint's dtype, unconverted) and int16 zero per row and
group of ``group_size`` weights, [groups, ng, 8] — not one per 32-block: a group of 128 4-bit weights is 64 quant
bytes + 2 of scale + 2 of zero (the checkpoint's 64 + 2 + 0.5, 1.02x). ``unpack`` gives the ``GroupQuantWeight``
back exactly; ``dequantize(pack(w))`` is exactly ``dequantize_group_ref(w)`` (tests/kernels/test_cpu_quant_group.py).

``linear(x, p, bias)`` (kernels/cpu_quant.py's ``linear`` hands these weights here) takes fp32 activations only:
the int8-activation scheme of the GGUF kernels is not built for these formats, and the engine's
``quantized_activations: int8`` leaves them fp32, as it leaves the k-quants.
- M < ``GEMM_ROWS``: the C GEMV (kernels/cpu/quant_g.c's header): each packed byte read once per call for the
  whole batch, the quants widened to fp32 in registers as the GGUF fp32 kernel widens Q4_1's / Q8_0's, one scale
  FMA and one zero term (``(z - c) * s * sum(x)``) per group: a reordering of the reference's fp32 sums, within
  1e-5 of its RMS (tests).
- M >= ``GEMM_ROWS``: the weight dequantized (C, exactly the reference) in tiles of rows into torch's fp32 GEMM.
Act-order weights (``perm``, checked to be a permutation at ``pack``): x's columns are gathered into the kernel's
order once per call, [M, cols] — in C by the GEMV (in its pass summing x's groups), so a decode step of an act-order
model is C calls only and replays from a CPU recording (kernels/cpu_graph.py); by torch (``index_select``) before
the prefill tiles' GEMM. All paths have a scalar twin (no AVX2/FMA/F16C, or forced: ``scalar=True``,
DUET_QUANT_ISA=scalar).

Measured on this 2-vCPU machine, 2 threads, ``python -m bench.kernels.quant_group_gemv`` (µs per call, weights cold,
under /tmp/duet-bench.lock; other sessions' processes leave ~10 % noise), groups of 128 on Qwen2.5-1.5B's shapes
1536x1536 / 8960x1536 / 1536x8960, against the GGUF kernels' fp32 path on the same shapes and torch's fp32 GEMM:
  M=1:  G4 84-92 / 420-426 / 431-441 vs Q4_1 84-101 / 402-405 / 415-421, fp32 GEMM 277-317 / 1051-1296 / 1092-1183
        (two runs); G8 107 / 465 / 503 vs Q8_0 98 / 430 / 480, fp32 GEMM 354 / 1042 / 1075 (one run).
  M=16: G4 678-714 / 3723-3885 / 3777-3854 vs Q4_1 578-633 / 3234-3382 / 3225-3240.
  So at batch 1 the group kernels run at the GGUF kernels' speed within ~10 % (the same bytes: 4.25 bits a weight
  against Q4_1's 5), 2.4-3.5x torch's fp32 GEMM; at M=16 G4 is ~1.15-1.2x Q4_1's time.
  GEMM_ROWS: GEMV vs tiles + GEMM, groups of 64, SmolLM2's 576x576 / 1536x576 / 576x1536: G4 M=16 116/136, 279/376,
  267/449; M=24 165/162, 438/438, 462/499; M=32 225/170, 573/494, 561/585 (G8 alike): 24, as the GGUF kernels'.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from kernels.cpu_build import NativeKernelError, load
from kernels.quant_group import GroupQuantWeight

GEMM_ROWS = 24  # M at and above which linear dequantizes tiles for torch's GEMM (measured: see above)
FORCE_SCALAR = os.environ.get("DUET_QUANT_ISA", "") == "scalar"  # kernels/cpu_quant_isa.py's setting (no AVX-512 here)
_SCALE_KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
_TILE_ROWS = 8192


@dataclass(frozen=True)
class PackedGroup:
    """A GroupQuantWeight in the C kernels' layout (kernels/cpu/quant_g.c): rows in groups of 8, zero-padded."""
    fmt: str  # "G4" | "G8"
    bits: int
    group_size: int
    rows: int
    cols: int
    qs: torch.Tensor  # uint8 [groups, nb, 8 * qb] (qb 16 or 32)
    scales: torch.Tensor  # the checkpoint's scale dtype [groups, ng, 8]
    zeros: torch.Tensor  # int16 [groups, ng, 8]
    perm: torch.Tensor | None  # int64 [cols]: the kernel's column k is input column perm[k]

    def __post_init__(self) -> None:  # the C calls' leading arguments, once
        object.__setattr__(self, "_c_args", (self.bits, _SCALE_KINDS[self.scales.dtype], self.qs.data_ptr(),
                                             self.scales.data_ptr(), self.zeros.data_ptr()))

    @property
    def num_bytes(self) -> int:
        """Packed bytes: quants, scales, zeros (the last group's padding rows included) and the permutation."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.zeros, self.perm)
                   if t is not None)


def pack(w: GroupQuantWeight) -> PackedGroup:
    """``w`` in the kernels' layout (once, at load); an act-order ``perm`` must be a permutation of the columns
    (the C GEMV reads x at its entries unchecked)."""
    if w.perm is not None and not torch.equal(w.perm.sort().values, torch.arange(w.cols)):
        raise ValueError(f"perm must be a permutation of the {w.cols} columns")
    groups, nb, pad = -(-w.rows // 8), w.cols // 32, -w.rows % 8
    q = torch.cat([w.q, w.q.new_zeros(pad, w.cols)]) if pad else w.q
    if w.bits == 4:  # byte j of a block: weight j | weight j + 16 << 4
        blocks = q.reshape(groups * 8, nb, 2, 16)
        q = blocks[:, :, 0] | (blocks[:, :, 1] << 4)
    qb = 16 if w.bits == 4 else 32
    qs = q.reshape(groups, 8, nb, qb // 4, 4).permute(0, 2, 3, 1, 4).contiguous().reshape(groups, nb, 8 * qb)

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [rows, ng] -> [groups, ng, 8]
        t = torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t
        return t.reshape(groups, 8, -1).permute(0, 2, 1).contiguous()

    return PackedGroup(w.fmt, w.bits, w.group_size, w.rows, w.cols, qs, per_row(w.scales), per_row(w.zeros),
                       None if w.perm is None else w.perm.contiguous())


def unpack(p: PackedGroup) -> GroupQuantWeight:
    """The GroupQuantWeight ``p`` was packed from, exactly."""
    groups, nb = p.qs.shape[:2]
    q = p.qs.reshape(groups, nb, -1, 8, 4).permute(0, 3, 1, 2, 4).reshape(groups * 8, nb, -1)
    if p.bits == 4:
        q = torch.cat([q & 15, q >> 4], dim=-1)
    q = q.reshape(groups * 8, p.cols)[:p.rows]

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t.permute(0, 2, 1).reshape(groups * 8, -1)[:p.rows].contiguous()

    return GroupQuantWeight(p.bits, p.group_size, q.contiguous(), per_row(p.scales), per_row(p.zeros), p.perm)


_lib_ready: ctypes.CDLL | None = None
_I64, _INT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def _lib() -> ctypes.CDLL:
    global _lib_ready
    if _lib_ready is None:
        lib = load()
        lib.duet_group_linear_f32.restype = _INT
        lib.duet_group_linear_f32.argtypes = [_INT, _INT, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64,
                                              _PTR, _PTR, _I64, _INT, _INT]
        lib.duet_group_dequantize.restype = None
        lib.duet_group_dequantize.argtypes = [_INT, _INT, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _INT, _INT]
        _lib_ready = lib
    return _lib_ready


def _scalar(scalar: bool | None) -> int:
    return int(scalar if scalar is not None else FORCE_SCALAR)


def _dequantize_rows(p: PackedGroup, row0: int, count: int, scalar: bool | None) -> torch.Tensor:
    """Rows row0 .. row0 + count - 1, [count, cols] float32 in the kernel's column order."""
    out = torch.empty(count, p.cols, dtype=torch.float32)
    if count:
        _lib().duet_group_dequantize(*p._c_args, p.cols, p.group_size, row0, count, out.data_ptr(), _scalar(scalar),
                                     torch.get_num_threads())
    return out


def dequantize(p: PackedGroup, *, scalar: bool | None = None) -> torch.Tensor:
    """[rows, cols] float32 in the input's column order: exactly ``dequantize_group_ref(unpack(p))``."""
    out = _dequantize_rows(p, 0, p.rows, scalar)
    if p.perm is None:
        return out
    restored = torch.empty_like(out)
    restored[:, p.perm] = out
    return restored


def linear(x: torch.Tensor, p: PackedGroup, bias: torch.Tensor | None = None, *, scalar: bool | None = None,
           tiles: bool = True) -> torch.Tensor:
    """``x [M, cols] @ Wᵀ (+ bias)`` -> [M, rows] float32, W the dequantized weight (module docstring). ``tiles``
    False: the GEMV kernel at every M (benchmarks, tests)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu" or x.shape[1] != p.cols:
        raise ValueError(f"x must be a 2-D float32 CPU tensor of {p.cols} columns, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (p.rows,)
                             or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float32 [{p.rows}], got {bias.dtype} {tuple(bias.shape)}")
    m = x.shape[0]
    if tiles and m >= GEMM_ROWS:
        return _linear_gemm(x.index_select(1, p.perm) if p.perm is not None else x.contiguous(), p, bias, scalar)
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(m, p.rows, dtype=torch.float32)
    if m and p.rows and _lib().duet_group_linear_f32(
            *p._c_args, p.rows, p.cols, p.group_size, p.perm.data_ptr() if p.perm is not None else None,
            x.data_ptr(), x.stride(0), m, bias.data_ptr() if bias is not None else None, out.data_ptr(),
            out.stride(0), _scalar(scalar), torch.get_num_threads()):
        raise NativeKernelError("duet_group_linear_f32 failed (no scratch memory)")
    return out


def _linear_gemm(x: torch.Tensor, p: PackedGroup, bias: torch.Tensor | None, scalar: bool | None) -> torch.Tensor:
    """Prefill: up to ``_TILE_ROWS`` weight rows dequantized at a time, each tile one torch GEMM."""
    if p.rows <= _TILE_ROWS:
        return torch.nn.functional.linear(x, _dequantize_rows(p, 0, p.rows, scalar), bias)
    out = torch.empty(x.shape[0], p.rows, dtype=torch.float32)
    for r0 in range(0, p.rows, _TILE_ROWS):
        tile = _dequantize_rows(p, r0, min(_TILE_ROWS, p.rows - r0), scalar)
        out[:, r0:r0 + tile.shape[0]] = torch.nn.functional.linear(x, tile)
    return out + bias if bias is not None else out
