"""The Triton kernels' packed layout of a quantized weight (issue 48): one form for every format, GGUF blocks and
group-quantized checkpoints (GPTQ / AWQ / compressed-tensors) alike. No kernels here: the GEMM is
kernels/quant_gemm.py, the row gather + dequantize (token table, fallback) kernels/quant_rows.py.

A ``GpuQuant`` is a [rows, cols] weight as unsigned or signed integer quants ``q`` (4, 5, 6 or 8 bits) plus, per
group of ``group_size`` consecutive weights of a row, a float scale and optionally a float min or an integer
zero; the k-quants add a second level (``sub_scales`` / ``sub_mins``: one small integer per ``sub_group``
weights that multiplies the group's fp16 scale or min). Every per-group array is stored group-major, [groups,
rows] (AWQ's and GPTQ's own orientation): the GEMM loads one group's values for a tile's consecutive rows, one
coalesced load. Each weight is, in fp32 (the formats' own order of
operations, so the product roundings are theirs and a dequantization is bit-exact):

    s = scale [* sub_scale]           one fp32 product (k-quants: d * sc)
    w = (q - offset) * s              Q8_0, Q4_0, Q5_0, Q6_K, symmetric GPTQ (offset 2^(bits-1))
    w = (q - zero) * s                asymmetric GPTQ / AWQ / compressed-tensors (``zeros``: int16 per group)
    w = q * s + m                     Q4_1, Q5_1 (m the fp16 min); Q4_K, Q5_K (m = (-dmin) * mn: the negation is
                                      exact, so q * s + m is gguf's q * s - dmin * mn)

Quants are stored as the formats store them, split from their scales so each array is one strided 2-D tensor:
- 4 bits and the low 4 bits of 5 and 6: ``qs`` uint8 [rows, cols / 2], nibbles paired within runs of ``span``
  weights: byte j of a run holds weight j (low nibble) and weight j + span / 2 (high). This is each GGUF block's
  own byte order (span 32 for Q4_0 / Q4_1 / Q5_0 / Q5_1, 64 for Q4_K / Q5_K, 128 for Q6_K), so those bytes are the
  file's; group-quantized weights are paired in runs of 64 (32 when cols is not a multiple of 64).
- bits 4 and 5 (5 and 6 bits): ``qh`` int32 [cols / 32 * (bits - 4), rows], for each run of 32 weights one word
  per extra bit (word p: bit j is bit 4 + p of weight j), group-major as the scales. The Q5 blocks' uint32 is that word already; Q5_K's and
  Q6_K's high bits are moved into it (a lossless permutation of bits).
- 8 bits: ``qs`` int8 (Q8_0: signed, offset 0) or uint8 (G8: unsigned with zeros) [rows, cols].
Act order (GPTQ ``desc_act``): ``perm`` int32 [cols], packed column k is input column perm[k] (groups made
contiguous at load, kernels/quant_group.py's convention); the kernels gather x's columns through it.

Bytes against the file (``num_bytes``): Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q6_K the same; Q4_K 148 per 144 and
Q5_K 180 per 176 (the 6-bit sub-scales and mins widened to a byte each): within 1.03x.
``dequantize_ref`` (torch) gives exactly kernels/quant.py ``dequantize_ref`` of the packed QuantWeight
(tests/kernels/test_quant_gpu.py): the repack is lossless.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kernels.quant import GGUF_BLOCKS, QuantWeight

GPU_FORMATS = frozenset(GGUF_BLOCKS)  # every GGUF block type kernels/quant.py knows: Q4_0 .. Q8_0, Q4_K, Q5_K, Q6_K
FLOAT_SCALES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class GpuQuant:
    fmt: str  # a GGUF block type, or G4 / G8 (group-quantized checkpoints)
    rows: int
    cols: int
    bits: int  # 4, 5, 6 or 8
    span: int  # the nibble pairing run (32, 64, 128); 0 for 8 bits
    group_size: int  # weights per entry of scales / mins / zeros
    qs: torch.Tensor  # uint8 [rows, cols // 2] (nibbles) | int8 or uint8 [rows, cols] (8 bits)
    scales: torch.Tensor  # float16 / bfloat16 / float32 [cols // group_size, rows]
    offset: int = 0  # subtracted from every quant
    qh: torch.Tensor | None = None  # int32 [cols // 32 * (bits - 4), rows] (5 and 6 bits)
    sub_group: int = 0  # weights per entry of sub_scales / sub_mins (k-quants); 0: no second level
    sub_scales: torch.Tensor | None = None  # uint8 (Q4_K, Q5_K) / int8 (Q6_K) [cols // sub_group, rows]
    mins: torch.Tensor | None = None  # float [cols // group_size, rows]: w = q * s + m
    sub_mins: torch.Tensor | None = None  # uint8 [cols // sub_group, rows]: m = mins * sub_mins
    zeros: torch.Tensor | None = None  # int16 [cols // group_size, rows]: w = (q - zero) * s
    perm: torch.Tensor | None = None  # int32 [cols]: act order

    def __post_init__(self) -> None:
        r, c = self.rows, self.cols
        if self.bits not in (4, 5, 6, 8) or (self.bits == 8) != (self.span == 0):
            raise ValueError(f"{self.fmt}: bits {self.bits} with span {self.span}: 4, 5, 6 bits pair nibbles in "
                             f"runs of 32, 64 or 128; 8 bits have span 0")
        if self.span not in (0, 32, 64, 128) or c % max(self.span, 32) or c % self.group_size:
            raise ValueError(f"{self.fmt}: cols {c} must be a multiple of 32, of the span {self.span} and of the "
                             f"group size {self.group_size}")
        groups, subs = (c // self.group_size, r), (c // self.sub_group, r) if self.sub_group else None
        qs_shape = (r, c) if self.bits == 8 else (r, c // 2)
        want = {"qs": (qs_shape, (torch.int8, torch.uint8) if self.bits == 8 else (torch.uint8,)),
                "scales": (groups, FLOAT_SCALES),
                "qh": ((c // 32 * (self.bits - 4), r), (torch.int32,)) if self.bits in (5, 6) else None,
                "sub_scales": (subs, (torch.uint8, torch.int8)) if self.sub_group else None,
                "mins": (groups, FLOAT_SCALES) if self.mins is not None else None,
                "sub_mins": (subs, (torch.uint8,)) if self.sub_group and self.mins is not None else None,
                "zeros": (groups, (torch.int16,)) if self.zeros is not None else None,
                "perm": ((c,), (torch.int32,)) if self.perm is not None else None}
        for name, spec in want.items():
            t = getattr(self, name)
            if spec is None:
                if t is not None:
                    raise ValueError(f"{self.fmt}: {name} given where this layout has none")
                continue
            shape, dtypes = spec
            if t is None or tuple(t.shape) != shape or t.dtype not in dtypes or not t.is_contiguous():
                got = "None" if t is None else f"{t.dtype} {tuple(t.shape)}"
                raise ValueError(f"{self.fmt}: {name} must be a contiguous {'/'.join(map(str, dtypes))} {shape}, "
                                 f"got {got}")
        if self.mins is not None and self.zeros is not None:
            raise ValueError(f"{self.fmt}: a min and a zero point: one or the other")
        if self.sub_group and self.group_size % self.sub_group:
            raise ValueError(f"{self.fmt}: sub_group {self.sub_group} must divide group_size {self.group_size}")

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def tensors(self) -> list[torch.Tensor]:
        return [t for f in fields(self) if isinstance(t := getattr(self, f.name), torch.Tensor)]

    def to(self, device: torch.device | str) -> GpuQuant:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, t in moved.items():
            if isinstance(t, torch.Tensor):
                moved[name] = t.to(device)
        return GpuQuant(**moved)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float16 (the file's bytes)."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _gm(t: torch.Tensor) -> torch.Tensor:
    """[rows, ...] per-row values -> [values per row, rows] contiguous: the group-major orientation."""
    return t.reshape(t.shape[0], -1).T.contiguous()


def _bit_words(bits: torch.Tensor) -> torch.Tensor:
    """[..., 32] 0/1 ints (bit j of weight j) -> [...] int32 words (two's complement for bit 31)."""
    words = (bits.to(torch.int64) << torch.arange(32)).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32)


def pack_gpu(w: QuantWeight, device: torch.device | str | None = None) -> GpuQuant:
    """A GGUF weight's blocks in the kernels' layout (once, at load), on ``device`` (default: where ``w`` is)."""
    f = GGUF_BLOCKS[w.fmt]
    rows, nb = w.rows, w.num_blocks
    blocks = w.data.reshape(rows, nb, f.block_bytes)
    if f.k_quant:
        packed = _pack_k(w.fmt, blocks, rows, w.cols)
    else:
        d = _fp16(blocks[..., 0:2])
        qs = blocks[..., f.quant_start:].reshape(rows, -1).contiguous()
        if w.fmt == "Q8_0":
            qs = qs.view(torch.int8)
        qh = _gm(blocks[..., 4 if f.has_min else 2:f.quant_start].contiguous().view(torch.int32)) \
            if f.high_bits else None
        packed = GpuQuant(w.fmt, rows, w.cols, 8 if w.fmt == "Q8_0" else 5 if f.high_bits else 4,
                          0 if w.fmt == "Q8_0" else 32, 32, qs, _gm(d), offset=f.offset, qh=qh,
                          mins=_gm(_fp16(blocks[..., 2:4])) if f.has_min else None)
    return packed.to(device) if device is not None else packed


def _pack_k(fmt: str, blocks: torch.Tensor, rows: int, cols: int) -> GpuQuant:
    """The k-quants' 256-weight super-blocks (kernels/quant.py's layouts)."""
    nb = blocks.shape[1]
    if fmt == "Q6_K":
        # ql byte 64h + l: low nibble weight 128h + l, high 128h + 64 + l (span 128); qh byte 32h + l: bits 2k, 2k+1
        # are bits 4, 5 of weight 128h + 32k + l
        qh = blocks[..., 128:192].to(torch.int32).reshape(rows, nb, 2, 1, 1, 32)
        shifts = (2 * torch.arange(4).reshape(4, 1, 1) + torch.arange(2).reshape(1, 2, 1))  # [k, plane, 1]
        planes = _bit_words((qh >> shifts) & 1)  # [rows, nb, 2 (h), 4 (k), 2 (plane)]: run 4h + k
        return GpuQuant(fmt, rows, cols, 6, 128, 256, blocks[..., :128].reshape(rows, -1).contiguous(),
                        _gm(_fp16(blocks[..., 208:210])), offset=32, qh=_gm(planes), sub_group=16,
                        sub_scales=_gm(blocks[..., 192:208].contiguous().view(torch.int8)))
    s = blocks[..., 4:16].to(torch.int32)
    lo, hi, mid = s[..., 0:4], s[..., 4:8], s[..., 8:12]  # ggml's get_scale_min_k4, as kernels/quant.py _k_scales
    sc = torch.cat([lo & 63, (mid & 15) | ((lo >> 2) & 48)], dim=-1).to(torch.uint8).reshape(rows, -1)
    mn = torch.cat([hi & 63, (mid >> 4) | ((hi >> 2) & 48)], dim=-1).to(torch.uint8).reshape(rows, -1)
    d, neg_dmin = _gm(_fp16(blocks[..., 0:2])), _gm(-_fp16(blocks[..., 2:4]))
    qh = None
    if fmt == "Q5_K":  # byte l's bit j: bit 4 of sub-block j's weight l -> one word per sub-block
        qh = _gm(_bit_words((blocks[..., 16:48].to(torch.int32).reshape(rows, nb, 1, 32)
                             >> torch.arange(8).reshape(8, 1)) & 1))
    start = 48 if fmt == "Q5_K" else 16
    return GpuQuant(fmt, rows, cols, 5 if fmt == "Q5_K" else 4, 64, 256,
                    blocks[..., start:].reshape(rows, -1).contiguous(), d, qh=qh, sub_group=32, sub_scales=_gm(sc),
                    mins=neg_dmin, sub_mins=_gm(mn))


def pack_groups(bits: int, group_size: int, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                perm: torch.Tensor | None = None, device: torch.device | str | None = None) -> GpuQuant:
    """A group-quantized weight (GPTQ / AWQ / compressed-tensors, as kernels/quant_group.py's GroupQuantWeight
    holds it: ``q`` uint8 [rows, cols] in [0, 2^bits), ``scales`` [rows, groups], ``zeros`` int16 [rows, groups],
    ``perm`` int64 [cols] or None) in the kernels' layout; w = (q - zero) * scale. Zeros all 2^(bits - 1) (the
    symmetric schemes) become the constant offset (no zeros array)."""
    if bits not in (4, 8):
        raise ValueError(f"group-quantized weights have 4 or 8 bits, got {bits}")
    rows, cols = q.shape
    sym = zeros.numel() > 0 and bool((zeros == 1 << (bits - 1)).all())
    if bits == 8:
        qs, span = q.contiguous(), 0
    else:
        span = 64 if cols % 64 == 0 else 32
        runs = q.reshape(rows, cols // span, 2, span // 2)
        qs = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()
    packed = GpuQuant(f"G{bits}", rows, cols, bits, span, group_size, qs, _gm(scales),
                      offset=1 << (bits - 1) if sym else 0, zeros=None if sym else _gm(zeros),
                      perm=perm.to(torch.int32).contiguous() if perm is not None else None)
    return packed.to(device) if device is not None else packed


def quants(p: GpuQuant) -> torch.Tensor:
    """[rows, cols] int32: every weight's integer quant, from the packed arrays (torch)."""
    if p.bits == 8:
        return p.qs.to(torch.int32)
    runs = p.qs.to(torch.int32).reshape(p.rows, p.cols // p.span, 1, p.span // 2)
    q = ((runs >> torch.tensor([0, 4], device=p.device).reshape(2, 1)) & 15).reshape(p.rows, p.cols)
    if p.qh is not None:
        planes = p.bits - 4
        words = p.qh.T.reshape(p.rows, p.cols // 32, planes, 1)
        bits = (words >> torch.arange(32, device=p.device)) & 1  # [rows, runs, plane, 32]
        high = (bits << (4 + torch.arange(planes, device=p.device)).reshape(planes, 1)).sum(2)
        q = q | high.reshape(p.rows, p.cols).to(torch.int32)
    return q


def dequantize_ref(p: GpuQuant) -> torch.Tensor:
    """[rows, cols] float32 in the input's column order: the module docstring's formulas in torch."""
    def per_weight(t: torch.Tensor, group: int) -> torch.Tensor:  # [groups, rows] -> [rows, cols]
        return t.T.float().repeat_interleave(group, dim=1)

    q = quants(p)
    s = per_weight(p.scales, p.group_size)
    if p.sub_scales is not None:
        s = s * per_weight(p.sub_scales, p.sub_group)
    if p.mins is not None:
        m = per_weight(p.mins, p.group_size)
        if p.sub_mins is not None:
            m = m * per_weight(p.sub_mins, p.sub_group)
        w = q.float() * s + m
    elif p.zeros is not None:
        w = (q - p.zeros.T.to(torch.int32).repeat_interleave(p.group_size, dim=1)).float() * s
    else:
        w = (q - p.offset).float() * s
    if p.perm is None:
        return w
    out = torch.empty_like(w)
    out[:, p.perm.long()] = w
    return out
