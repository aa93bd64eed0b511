"""GGUF block-quantized weights kept quantized: the data type and its torch references (issue 48).

A ``QuantWeight`` is one linear's (or embedding table's) weight as the GGUF file stores it: ``rows`` output
rows of ``cols`` weights, each row a run of blocks (32 weights, or 256 for the k-quants), bytes
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

The k-quants (what Q4_K_M / Q5_K_M / Q6_K files hold), 256-weight super-blocks (``block_size``):
- Q4_K 144 B: fp16 d, fp16 dmin, 12 B of 6-bit scales sc and mins mn for 8 sub-blocks of 32, 128 B nibbles
  (bytes 32k..32k+31: low nibbles sub-block 2k, high 2k+1)            w = (d * sc) * q - dmin * mn
- Q5_K 176 B: as Q4_K with 32 B of high bits before the nibbles (byte l's bit j: bit 4 of sub-block j's weight l)
- Q6_K 210 B: 128 B low nibbles, 64 B high 2 bits, 16 int8 scales (one per 16 weights), fp16 d
                                                                      w = (d * sc) * (q - 32)

``dequantize_ref`` is bit-exact with ``gguf.dequantize`` (the reference nobody here wrote): the same fp32
operations in the same order (``q * d + m`` is two roundings, never an FMA).

``quantize_ref`` makes Q8_0 and Q4_1 blocks from a float weight (``quantization: int8 | int4`` at load,
engine/loading/quantize.py) by gguf-py's rules, which are llama.cpp's reference quantizers (``quantize_row_q8_0_ref``,
``quantize_row_q4_1_ref``), bit-exact with ``gguf.quantize`` (tests): round to nearest per 32-weight block,
- Q8_0: d = max|x| / 127, q = roundf(x / d) (halves away from zero), d stored fp16;
- Q4_1: d = (max - min) / 15, m = min, q = trunc((x - m) / d + 0.5) clipped to 0..15, d and m stored fp16.
The inverse 1 / d is taken once per block, as the reference does (x * (1 / d), not x / d).
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
    offset: int  # subtracted from the unsigned quant (Q4_0: 8, Q5_0: 16, Q6_K: 32)
    block_size: int = 32  # weights per block: 256 for the k-quants' super-blocks

    @property
    def k_quant(self) -> bool:
        return self.block_size == 256

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
    BlockFormat("Q4_K", 12, 144, has_min=True, high_bits=False, offset=0, block_size=256),
    BlockFormat("Q5_K", 13, 176, has_min=True, high_bits=True, offset=0, block_size=256),
    BlockFormat("Q6_K", 14, 210, has_min=False, high_bits=True, offset=32, block_size=256),
)}
BLOCK_SIZE = 32  # the smallest block: the 32-weight formats'


def block_format(fmt: str) -> BlockFormat:
    """The format named ``fmt``; a ValueError naming the supported ones otherwise."""
    f = GGUF_BLOCKS.get(fmt)
    if f is None:
        raise ValueError(f"unsupported quantized format {fmt!r}; supported: {', '.join(GGUF_BLOCKS)}")
    return f


@dataclass(frozen=True)
class QuantWeight:
    """A [rows, cols] weight in a GGUF block format; ``data``: uint8 [rows, cols // block_size * block_bytes],
    the file's bytes (row-major, blocks along each row)."""
    fmt: str
    rows: int
    cols: int
    data: torch.Tensor

    def __post_init__(self) -> None:
        f = block_format(self.fmt)
        if self.rows < 0 or self.cols <= 0 or self.cols % f.block_size:
            raise ValueError(f"a {self.fmt} weight needs cols a positive multiple of {f.block_size}, "
                             f"got rows={self.rows} cols={self.cols}")
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.uint8:
            raise ValueError(f"data must be a uint8 tensor, got {getattr(self.data, 'dtype', type(self.data))}")
        expected = (self.rows, self.cols // f.block_size * f.block_bytes)
        if tuple(self.data.shape) != expected:
            raise ValueError(f"data of a {self.rows}x{self.cols} {self.fmt} weight must have shape {expected}, "
                             f"got {tuple(self.data.shape)}")

    @property
    def num_blocks(self) -> int:
        """Blocks per row."""
        return self.cols // GGUF_BLOCKS[self.fmt].block_size

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
    if f.k_quant:
        return _dequantize_k(w.fmt, blocks).reshape(w.rows, w.cols)
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


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] uint8 -> the 8 sub-blocks' 6-bit scales and mins, [..., 8] float32 (ggml's get_scale_min_k4)."""
    s = s.to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc.float(), mn.float()


def _dequantize_k(fmt: str, blocks: torch.Tensor) -> torch.Tensor:
    """[rows, nb, block_bytes] k-quant super-blocks -> [rows, nb, ...] float32, gguf-py's operations."""
    rows, nb = blocks.shape[:2]
    b = blocks.to(torch.int32)
    if fmt == "Q6_K":
        ql = b[..., :128].reshape(rows, nb, 2, 1, 64)
        lo = (ql >> torch.tensor([0, 4]).reshape(2, 1)) & 15  # [rows, nb, 2, 2, 64]: weight 128h + 64s + l
        qh = b[..., 128:192].reshape(rows, nb, 2, 1, 32)
        hi = (qh >> torch.tensor([0, 2, 4, 6]).reshape(4, 1)) & 3  # [rows, nb, 2, 4, 32]: weight 128h + 32k + l
        q = (lo.reshape(rows, nb, 8, 32) | (hi.reshape(rows, nb, 8, 32) << 4)) - 32
        scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
        d = _fp16(blocks[..., 208:210]) * scales  # [rows, nb, 16]
        return d.unsqueeze(-1) * q.reshape(rows, nb, 16, 16).float()
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
    sc, mn = _k_scales(blocks[..., 4:16])
    start = 48 if fmt == "Q5_K" else 16
    qs = b[..., start:].reshape(rows, nb, 4, 1, 32)
    q = ((qs >> torch.tensor([0, 4]).reshape(2, 1)) & 15).reshape(rows, nb, 8, 32)  # sub-block j: weights 32j..
    if fmt == "Q5_K":
        qh = b[..., 16:48].reshape(rows, nb, 1, 32)
        q = q | (((qh >> torch.arange(8).reshape(8, 1)) & 1) << 4)
    return (d * sc).unsqueeze(-1) * q.float() - (dmin * mn).unsqueeze(-1)


QUANTIZE_FORMATS = ("Q8_0", "Q4_1")  # the formats quantize_ref makes


def quantize_ref(w: torch.Tensor, fmt: str) -> QuantWeight:
    """A float [rows, cols] weight (cols a multiple of 32) as ``fmt`` blocks, bit-exactly ``gguf.quantize``."""
    if fmt not in QUANTIZE_FORMATS:
        raise ValueError(f"quantize_ref makes {', '.join(QUANTIZE_FORMATS)}, not {fmt!r}")
    rows, cols = w.shape
    if cols % BLOCK_SIZE:
        raise ValueError(f"a {fmt} weight needs cols a multiple of {BLOCK_SIZE}, got {cols}")
    x = w.detach().float().reshape(rows, cols // BLOCK_SIZE, BLOCK_SIZE)
    if fmt == "Q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        a = (x * inv).abs()  # gguf's np_roundf: floor(a) + floor(2 * (a - floor(a))), the sign put back
        q = (torch.sign(x * inv) * (a.floor() + (2 * (a - a.floor())).floor())).to(torch.int8)
        parts = [d.half().view(torch.uint8), q.view(torch.uint8)]
    else:
        hi, lo = x.amax(-1, keepdim=True), x.amin(-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc((x - lo) * inv + 0.5).clamp(0, 15).to(torch.uint8)
        parts = [d.half().view(torch.uint8), lo.half().view(torch.uint8), q[..., :16] | (q[..., 16:] << 4)]
    return QuantWeight(fmt, rows, cols, torch.cat(parts, dim=-1).reshape(rows, -1).contiguous())


def quant_linear_ref(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, cols] @ dequantize_ref(w).T (+ bias [rows])`` -> [M, rows] float32."""
    out = x.float() @ dequantize_ref(w).T
    return out + bias if bias is not None else out


def quant_rows_ref(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the dequantized table (an embedding lookup) -> [len(ids), cols] float32."""
    ids = ids.reshape(-1).long()
    return dequantize_ref(QuantWeight(w.fmt, ids.numel(), w.cols, w.data[ids]))
