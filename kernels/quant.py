"""GGUF block-quantized weights kept quantized: the data type and its torch references (issue 48).

A ``QuantWeight`` is one linear's (or embedding table's) weight as the GGUF file stores it: ``rows`` output
rows of ``cols`` weights, each row a run of 32-weight blocks, each block its scale(s) then its quants, bytes
exactly as in the file. The loader makes it; the kernels pack it once into their own layout
(kernels/cpu_quant.py, ``pack``) and dequantizing that packed form gives exactly ``dequantize_ref``
(DESIGN.md, "Quantized weights": a repack is lossless).

The formats of this slice (``GGUF_BLOCKS``), all with 32 weights per block and an fp16 scale ``d``:
- Q8_0  34 B: d, 32 int8 q                                  w = q * d
- Q4_0  18 B: d, 16 B nibbles                               w = (q - 8) * d
- Q4_1  20 B: d, fp16 min m, 16 B nibbles                   w = q * d + m
- Q5_0  22 B: d, 4 B high bits, 16 B nibbles                w = (q - 16) * d
- Q5_1  24 B: d, m, 4 B high bits, 16 B nibbles             w = q * d + m
Nibbles as ggml lays them out: byte j's low nibble is weight j, its high nibble weight j + 16; a Q5 block's
high bits are one little-endian uint32 whose bit j is bit 4 of weight j.

``dequantize_ref`` is bit-exact with ``gguf.dequantize`` (the reference nobody here wrote): the same fp32
operations in the same order (``q * d + m`` is two roundings, never an FMA).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # GGMLQuantizationType's value: the kernels' format code too
    block_bytes: int
    has_min: bool  # *_1: an fp16 min after the scale
    high_bits: bool  # Q5_*: a uint32 of 5th bits before the nibbles
    offset: int  # subtracted from the unsigned quant (Q4_0: 8, Q5_0: 16)
    block_size: int = 32

    @property
    def quant_start(self) -> int:
        """Byte offset of the low quants (nibbles or int8) in a block."""
        return 2 + 2 * self.has_min + 4 * self.high_bits


GGUF_BLOCKS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("Q8_0", 8, 34, has_min=False, high_bits=False, offset=0),
    BlockFormat("Q4_0", 2, 18, has_min=False, high_bits=False, offset=8),
    BlockFormat("Q4_1", 3, 20, has_min=True, high_bits=False, offset=0),
    BlockFormat("Q5_0", 6, 22, has_min=False, high_bits=True, offset=16),
    BlockFormat("Q5_1", 7, 24, has_min=True, high_bits=True, offset=0),
)}
BLOCK_SIZE = 32


def block_format(fmt: str) -> BlockFormat:
    """The format named ``fmt``; a ValueError naming the supported ones otherwise."""
    f = GGUF_BLOCKS.get(fmt)
    if f is None:
        raise ValueError(f"unsupported quantized format {fmt!r}; supported: {', '.join(GGUF_BLOCKS)}")
    return f


@dataclass(frozen=True)
class QuantWeight:
    """A [rows, cols] weight in a GGUF block format; ``data``: uint8 [rows, cols // 32 * block_bytes], the
    file's bytes (row-major, blocks along each row)."""
    fmt: str
    rows: int
    cols: int
    data: torch.Tensor

    def __post_init__(self) -> None:
        f = block_format(self.fmt)
        if self.rows < 0 or self.cols <= 0 or self.cols % BLOCK_SIZE:
            raise ValueError(f"a {self.fmt} weight needs cols a positive multiple of {BLOCK_SIZE}, "
                             f"got rows={self.rows} cols={self.cols}")
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.uint8:
            raise ValueError(f"data must be a uint8 tensor, got {getattr(self.data, 'dtype', type(self.data))}")
        expected = (self.rows, self.cols // BLOCK_SIZE * f.block_bytes)
        if tuple(self.data.shape) != expected:
            raise ValueError(f"data of a {self.rows}x{self.cols} {self.fmt} weight must have shape {expected}, "
                             f"got {tuple(self.data.shape)}")

    @property
    def num_blocks(self) -> int:
        """Blocks per row."""
        return self.cols // BLOCK_SIZE

    @property
    def num_bytes(self) -> int:
        return self.data.numel()


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian fp16) -> [..., 1] float32."""
    return b.contiguous().view(torch.float16).float()


def dequantize_ref(w: QuantWeight) -> torch.Tensor:
    """[rows, cols] float32, bit-exactly ``gguf.dequantize(w.data.numpy(), type)``."""
    f = GGUF_BLOCKS[w.fmt]
    blocks = w.data.reshape(w.rows, w.num_blocks, f.block_bytes)
    d = _fp16(blocks[..., 0:2])
    qs = blocks[..., f.quant_start:]
    if w.fmt == "Q8_0":
        q = qs.contiguous().view(torch.int8).float()
        return (q * d).reshape(w.rows, w.cols)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int32)  # [rows, nb, 32]: weights 0..15, then 16..31
    if f.high_bits:
        qh = blocks[..., 2 + 2 * f.has_min:f.quant_start].contiguous().view(torch.int32)  # [rows, nb, 1]
        q = q | (((qh >> torch.arange(32, dtype=torch.int32)) & 1) << 4)
    if f.has_min:
        m = _fp16(blocks[..., 2:4])
        return (d * q.float() + m).reshape(w.rows, w.cols)
    return (d * (q - f.offset).float()).reshape(w.rows, w.cols)


def quant_linear_ref(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, cols] @ dequantize_ref(w).T (+ bias [rows])`` -> [M, rows] float32."""
    out = x.float() @ dequantize_ref(w).T
    return out + bias if bias is not None else out


def quant_rows_ref(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the dequantized table (an embedding lookup) -> [len(ids), cols] float32."""
    ids = ids.reshape(-1).long()
    return dequantize_ref(QuantWeight(w.fmt, ids.numel(), w.cols, w.data[ids]))
