"""GGUF block-quantized linears and embeddings on the CPU, kept packed (issue 48; C: kernels/cpu/quant.c).

``pack`` splits a ``QuantWeight``'s blocks once, at load, into arrays apart: the quants ``qs`` (nibbles as
ggml lays them out, or int8), the Q5 high bits ``qh`` (uint32 per block), the scales ``d`` and mins ``m``
(fp16 per block, converted 8 at a time by F16C). Same bytes as the file (``num_bytes`` is equal), and
``unpack`` gives them back byte for byte; ``dequantize(pack(w))`` is exactly ``dequantize_ref(w)``.

``linear`` (decode, M rows of x): a weight row is read from memory once per call for the whole batch and from
L1 once per 4 rows of x; threads (OpenMP, torch.get_num_threads()) over output rows. Two activation paths:
- ``"int8"`` (llama.cpp's): x quantized per 32-block to int8 (scale amax / 127), integer dots with
  _mm256_maddubs_epi16, one fp32 FMA per block. Error vs ``quant_linear_ref``: that of 8-bit activations,
  about 3e-3 of the output's RMS (measured on random data: tests/kernels/test_cpu_quant.py bounds it at 1e-2).
- ``"fp32"``: quants widened to fp32 in registers, fp32 FMAs: ~1e-6 of the RMS (reordered fp32 sums).
``ACTIVATIONS`` is the default, chosen by measurement (below). Both have a scalar twin, picked when the CPU
lacks AVX2/FMA/F16C or forced with ``scalar=True`` / DUET_QUANT_SCALAR=1.

Prefill (M >= ``GEMM_ROWS``): a tile of ``_TILE_ROWS`` weight rows is dequantized (C) and multiplied by torch's
GEMM, which beats the GEMV kernel there.

Measurements (2-vCPU AMD EPYC, AVX2, 2 threads; ``python -m bench.kernels.quant_gemv``): see the numbers filled
in below once measured.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from kernels.cpu_build import NativeKernelError, load
from kernels.quant import BLOCK_SIZE, GGUF_BLOCKS, QuantWeight, block_format

ACTIVATIONS = "int8"
GEMM_ROWS = 64  # M at and above which linear dequantizes tiles for torch's GEMM
_TILE_ROWS = 512
FORCE_SCALAR = os.environ.get("DUET_QUANT_SCALAR", "") not in ("", "0")  # read once: ~1 us a call otherwise


@dataclass(frozen=True)
class PackedQuant:
    """A QuantWeight in the C kernels' layout (see the module docstring); tensors are [rows, ...]."""
    fmt: str
    rows: int
    cols: int
    qs: torch.Tensor  # uint8 [rows, nb * 16] nibbles, or int8 [rows, nb * 32] (Q8_0)
    d: torch.Tensor  # float16 [rows, nb]
    m: torch.Tensor | None  # float16 [rows, nb] (Q4_1, Q5_1)
    qh: torch.Tensor | None  # int32 [rows, nb] (Q5_0, Q5_1): bit j is bit 4 of weight j

    def __post_init__(self) -> None:  # the C calls' leading arguments, once (a decode step makes ~120 calls)
        f = block_format(self.fmt)
        object.__setattr__(self, "_c_args", (f.ggml_type, self.qs.data_ptr(),
                                             self.qh.data_ptr() if self.qh is not None else None, self.d.data_ptr(),
                                             self.m.data_ptr() if self.m is not None else None))

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m, self.qh) if t is not None)


def pack(w: QuantWeight) -> PackedQuant:
    """``w``'s blocks split into the kernels' arrays (once, at load)."""
    f = GGUF_BLOCKS[w.fmt]
    nb = w.num_blocks
    blocks = w.data.reshape(w.rows, nb, f.block_bytes)

    def part(lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        return blocks[..., lo:hi].contiguous().view(dtype).reshape(w.rows, -1)

    qs = part(f.quant_start, f.block_bytes, torch.int8 if w.fmt == "Q8_0" else torch.uint8)
    return PackedQuant(w.fmt, w.rows, w.cols, qs, part(0, 2, torch.float16),
                       part(2, 4, torch.float16) if f.has_min else None,
                       part(2 + 2 * f.has_min, f.quant_start, torch.int32) if f.high_bits else None)


def unpack(p: PackedQuant) -> QuantWeight:
    """The GGUF bytes ``p`` was packed from, byte for byte."""
    nb = p.cols // BLOCK_SIZE
    parts = [t.contiguous().view(torch.uint8).reshape(p.rows, nb, -1) for t in (p.d, p.m, p.qh, p.qs)
             if t is not None]
    return QuantWeight(p.fmt, p.rows, p.cols, torch.cat(parts, dim=-1).reshape(p.rows, -1))


_lib_ready: ctypes.CDLL | None = None
_I64, _INT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def _lib() -> ctypes.CDLL:
    global _lib_ready
    if _lib_ready is None:
        lib = load()
        lib.duet_quant_simd.restype = _INT
        lib.duet_quant_simd.argtypes = []
        lib.duet_quant_linear.restype = _INT
        lib.duet_quant_linear.argtypes = [_INT, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR,
                                          _I64, _INT, _INT, _INT]
        lib.duet_quant_dequantize.restype = None
        lib.duet_quant_dequantize.argtypes = [_INT, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _PTR, _INT,
                                              _INT]
        _lib_ready = lib
    return _lib_ready


def simd_available() -> bool:
    """This CPU takes the AVX2 + FMA + F16C path."""
    return bool(_lib().duet_quant_simd())


def _scalar(scalar: bool | None) -> int:
    return int(scalar if scalar is not None else FORCE_SCALAR)


def _dequantize_rows(p: PackedQuant, ids: torch.Tensor | None, row0: int, count: int,
                     scalar: bool | None) -> torch.Tensor:
    out = torch.empty(count, p.cols, dtype=torch.float32)
    if count:
        _lib().duet_quant_dequantize(*p._c_args, p.cols, ids.data_ptr() if ids is not None else None, row0,
                                     count, out.data_ptr(), _scalar(scalar), torch.get_num_threads())
    return out


def dequantize(p: PackedQuant, *, scalar: bool | None = None) -> torch.Tensor:
    """[rows, cols] float32: exactly ``dequantize_ref(unpack(p))``."""
    return _dequantize_rows(p, None, 0, p.rows, scalar)


def rows(p: PackedQuant, ids: torch.Tensor, *, scalar: bool | None = None) -> torch.Tensor:
    """Rows ``ids`` dequantized (an embedding lookup) -> [len(ids), cols] float32."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= p.rows):
        raise ValueError(f"ids must be in [0, {p.rows})")
    return _dequantize_rows(p, ids, 0, ids.numel(), scalar)


def _check_x(x: torch.Tensor, p: PackedQuant, bias: torch.Tensor | None) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"x must be a 2-D float32 CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.shape[1] != p.cols or (x.numel() and x.stride(1) != 1):
        raise ValueError(f"x must have {p.cols} columns, contiguous, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (p.rows,)
                             or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float32 [{p.rows}], got {bias.dtype} {tuple(bias.shape)}")


def linear(x: torch.Tensor, p: PackedQuant, bias: torch.Tensor | None = None, *,
           activations: str | None = None, scalar: bool | None = None) -> torch.Tensor:
    """``x [M, cols] @ Wᵀ (+ bias)`` -> [M, rows] float32, W the dequantized weight (see the module docstring)."""
    _check_x(x, p, bias)
    acts = activations or ACTIVATIONS
    if acts not in ("int8", "fp32"):
        raise ValueError(f"activations must be 'int8' or 'fp32', got {acts!r}")
    m = x.shape[0]
    if m >= GEMM_ROWS and activations is None:
        return _linear_gemm(x, p, bias, scalar)
    out = torch.empty(m, p.rows, dtype=torch.float32)
    if m == 0 or p.rows == 0:
        return out
    rc = _lib().duet_quant_linear(*p._c_args, p.rows, p.cols, x.data_ptr(), x.stride(0), m,
                                  bias.data_ptr() if bias is not None else None, out.data_ptr(), out.stride(0),
                                  int(acts == "int8"), _scalar(scalar), torch.get_num_threads())
    if rc:
        raise NativeKernelError(f"duet_quant_linear failed (code {rc}: no scratch memory)")
    return out


def _linear_gemm(x: torch.Tensor, p: PackedQuant, bias: torch.Tensor | None, scalar: bool | None) -> torch.Tensor:
    """Prefill: each tile of weight rows dequantized, then one GEMM per tile (outᵀ's tile rows are contiguous)."""
    out_t = torch.empty(p.rows, x.shape[0], dtype=torch.float32)
    for r0 in range(0, p.rows, _TILE_ROWS):
        tile = _dequantize_rows(p, None, r0, min(_TILE_ROWS, p.rows - r0), scalar)
        torch.mm(tile, x.T, out=out_t[r0:r0 + tile.shape[0]])
    out = out_t.T.contiguous()
    return out + bias if bias is not None else out
