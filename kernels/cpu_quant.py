"""GGUF block-quantized linears and embeddings on the CPU, kept packed (issue 48; C: kernels/cpu/quant.c, the
k-quants kernels/cpu_quant_k.py and kernels/cpu/quant_k*.c).

``pack`` rearranges a ``QuantWeight``'s blocks once, at load: rows in groups of 8, each block's quant bytes of
the 8 rows interleaved in 4-byte chunks (llama.cpp's repacked layout: one 32-byte load is 4 weights of 8 rows),
the Q5 high bits, fp16 scales and mins in arrays apart, [groups, nb, 8]. Same bytes as the file, plus the last
group's padding rows (``num_bytes``); ``unpack`` gives the file's bytes back exactly and ``dequantize(pack(w))``
is exactly ``dequantize_ref(w)`` (tests/kernels/test_cpu_quant.py).

``linear(x, p, bias, activations=)`` picks by activations (default ``ACTIVATIONS``, "fp32") and M (rows of x):
- "fp32", M < ``GEMM_ROWS_FP32`` (``GEMM_ROWS_PLANES`` where the digit planes below run; the default; token-exact):
  the C GEMV on fp32 x. Each packed byte read from
  memory once per call for the whole batch; per block, the 32 weights of a group's 8 rows widened in registers
  (byte -> int32 -> float, Q5 with its high bit, Q4_0 / Q5_0 their offset taken off in the bytes: exact),
  FMAed against x in fp32, the block's sum times its fp16 scale (F16C), plus for *_1 min * sum(x) (per-block
  sums of x once per call); OpenMP over groups. A reordering of ``quant_linear_ref``'s fp32 sums: the reference
  rounds w = q * d + m first (two roundings) and sums x * w, here sum(x * q) * d + m * sum(x). Error vs the
  reference: ~3e-7 to 5e-7 of the output's RMS (tests bound it at 1e-5). SmolLM2-135M Q4_1, 8 prompts x 64
  greedy tokens: identical to the dense model (quantized_weights="dense") on all 512.
  On a CPU with AVX512-VNNI (``PLANES_LEVEL``) the fp32 path is instead kernels/cpu/quant_planes.c: x written as
  24-bit fixed point per 32-block (within 2^-22 of the block's largest |x|) in three balanced base-255 int8 digits,
  so the int8 kernel's exact integer dots (vpdpbusd, 512-bit: two groups of 8 rows per register) run three times
  and combine per block; its error is of the reference's own order (tests/kernels/test_cpu_quant_planes.py derives
  the bound per output; every level bitwise equal), SmolLM2-135M Q4_1 8 prompts x 64 greedy tokens: identical to
  the dense model on all 512. ``python /tmp``-style timing, 2 threads, hot weights, M=1, µs: 3072x576 Q4_1 35 vs
  the widened-weights kernel's 51 (int8 27), 576x1536 19 vs 27, 49152x576 Q8_0 603 vs 790; M=4 84 vs 109;
  engine batch-1 decode of SmolLM2 Q4_1 (recorded steps) 104 -> 137-145 tok/s. Below VNNI (AVX2 only) the
  widened-weights kernel stays: the planes' AVX2 variant (maddubs) measured slower at M >= 4.
- "int8", M < ``GEMM_ROWS``: llama.cpp's method: x quantized per 32-block to int8 (amax / 127), integer
  dots (_mm256_maddubs_epi16; with AVX512-VNNI _mm256_dpbusd_epi32) whose 8 lanes are a group's 8 rows, one scale
  FMA per block and group; each packed
  byte read from memory once per call; OpenMP over groups (torch.get_num_threads()). Error vs
  ``quant_linear_ref``: 8-bit activations, ~5e-3 of the output's RMS (576x576 Q4_1 and Q8_0, Gaussian x; the
  tests bound it at 1e-2). Faster, but on SmolLM2-135M Q4_1 greedy tokens drift from the dense model's: 8
  prompts x 64 tokens stayed identical for 1 to 52 tokens.
- "fp32" at M >= ``gemm_rows`` (``GEMM_ROWS_FP32``, ``GEMM_ROWS_PLANES`` or the k-quants' own), int8 at M >=
  ``GEMM_ROWS`` without AMX-BF16: tiles of weight rows dequantized
  (C) then torch's fp32 GEMM: exactly ``quant_linear_ref``'s math.
- "int8" at M >= ``GEMM_ROWS_BF16`` on a CPU with AMX-BF16 (``bf16_prefill``): tiles dequantized straight into bf16
  (C: the exact weights rounded to nearest even, through a per-thread fp32 scratch of 8 rows) and torch's bf16 GEMM
  (oneDNN on the AMX tiles, fp32 accumulation, output rounded to bf16): int8 activations' accuracy class or better
  (bf16 keeps 8 significant bits of every x and w, with no block scale to share). Measured against the exact
  product, 1.5B Q4_K / Q6_K layers, M=512, Gaussian x with every 97th channel x20: relative RMS error 2.9e-3,
  against 2.7e-2 for the int8 GEMV (x per 256 in int8; the outlier channels widen its blocks' steps) and 3.7e-7 for
  the fp32 tiles. ms per call, 2 threads, int8 GEMV / bf16 tiles / fp32 tiles (/tmp script, bench lock held):
  Q4_K 2048x2048 M=32 0.63 / 0.95 / 1.81, M=64 1.28 / 1.08 / 2.44, M=512 9.27 / 2.72 / 11.79;
  Q4_K 8192x2048 M=32 2.32 / 3.30 / 6.95, M=64 4.42 / 3.72 / 9.61, M=512 36.0 / 11.6 / 49.1;
  Q6_K 2048x8192 M=32 3.62 / 3.56 / 7.07, M=64 7.31 / 4.39 / 9.80, M=512 62.1 / 13.3 / 47.1;
  SmolLM2 Q4_1 1536x576 M=32 0.20 / 0.30 / 0.38, M=64 0.38 / 0.36 / 0.62, M=512 2.82 / 0.85 / 2.32.
  So ``GEMM_ROWS_BF16`` = 48 (between the crossovers, 32-64), and a 512-token prefill's GEMMs run 3.5-4.3x the
  fp32 tiles. Without AMX (or DUET_QUANT_ISA below avx512) int8 keeps the fp32 tiles from ``GEMM_ROWS``.
Instruction sets: kernels/cpu_quant_isa.py (``isa=``; the default the best the CPU has, DUET_QUANT_ISA forces
one): every kernel has a scalar twin and an AVX2 one; the int8 kernel a VNNI one (256-bit vpdpbusd). The fp32
kernel stays AVX2: with the 4-byte interleave a 512-bit register holds two chunks, so x must come expanded (two
values a half each); such a variant (x expanded once per call) measured no faster, one thread, hot weights, M=1:
1536x576 Q4_1 57 vs 55 µs, 576x1536 50 vs 53, 4096x576 Q8_0 147 vs 164 (its per-block work weighs more than in
the k-quants' 8x8 layout).

The k-quants (Q4_K, Q5_K, Q6_K; 256-weight super-blocks): their own 8-row layout and kernels, kernels/cpu_quant_k.py
(fp32 and int8 activations, AVX2 / AVX-512 / VNNI); ``INT8_FORMATS`` is every format.

Measured on this 2-vCPU machine (lscpu: an Intel Xeon with AVX-512/VNNI; the kernels use AVX2 only), 2 threads,
``python -m bench.kernels.quant_gemv --prefill`` (µs per call, weights cold; int8 / fp32 kernel / torch fp32 GEMM
on the dense weight):
  M=1:  576x576 Q4_1 12.3 / 16.6 / 27.5; 1536x576 18.5 / 31.1 / 122.8; 576x1536 21.5 / 32.0 / 79.6;
        49152x576 Q8_0 568 / 846 / 4067 (int8 16-53 GB/s of packed bytes, fp32 12-36 GB/s).
  M=16: 55 / 90 / 73; 111 / 230 / 281; 131 / 214 / 290; 4950 / 6883 / 9373.
  The fp32 kernel is bound by its vector ports, not memory: per 8 weights one shuffle, one int -> float
  conversion and one FMA per row of x (hot weights, 1 thread, 1536x576 Q4_1 M=1: 45 µs vs int8's 22); a
  variant masking the bytes in place (x prescaled by powers of 2) instead of the shuffle measured the same.
  Before the 8-row layout (one row at a time, commit 3e9d249) int8 at M=1 was 22 / 41 / 40 / 899 µs and fp32
  in registers 26 / 56 / 53 / 1474.
  GEMM_ROWS: int8 kernel vs tiles + GEMM, 1536x576 / 576x1536 Q4_1: M=64 405 vs 734 / 429 vs 500; M=128 754 vs
  763 / 817 vs 819; M=256 1511 vs 1496 / 1648 vs 1448; M=2048 15951 vs 10640 / 15830 vs 9714.
  GEMM_ROWS_FP32: fp32 kernel vs tiles + GEMM, same shapes: M=16 215 vs 228 / 216 vs 383; M=24 331 vs 269 /
  341 vs 348; M=32 437 vs 304 / 420 vs 418; M=64 842 vs 677 / 811 vs 581.
  SmolLM2-135M Q4_1 batch-1 (engine, kernels=cpu, 128 greedy tokens incl. prefill, best of 2): fp32 51-54 tok/s,
  int8 79-82, dense (quantized_weights="dense") 27.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kernels import cpu_quant_group, cpu_quant_k
from kernels.cpu_build import NativeKernelError
from kernels.cpu_graph import recording
from kernels.cpu_quant_isa import ISAS, PLANES_LEVEL, amx_bf16, in_huge_pages, isa_level, lib
from kernels.quant import GGUF_BLOCKS, QuantWeight, block_format
from kernels.quant_group import GROUP_FORMATS

ACTIVATIONS = "fp32"  # token-exact with the dense model; "int8": llama.cpp's scheme, faster, drifts
GEMM_ROWS = 128  # M at and above which linear dequantizes tiles for torch's GEMM (int8; measured: see above)
GEMM_ROWS_BF16 = 48  # the same for int8 activations where the tiles go to the bf16 GEMM (AMX; measured: see above)
GEMM_ROWS_FP32 = 24  # the same for the fp32 kernel (measured: see above)
# ... and for the 32-weight formats' digit-plane kernel (AVX512-VNNI): ms per call, 2 threads, planes GEMV / fp32 tiles
# + GEMM (/tmp script, bench lock held, 2026-11-28), SmolLM2 Q4_1 576x576 M=24 0.128 / 0.138, M=32 0.169 / 0.143;
# 1536x576 M=32 0.330 / 0.416, M=48 0.509 / 0.510; 576x1536 M=32 0.352 / 0.560, M=48 0.532 / 0.565; Q8_0 1536x576
# M=32 0.367 / 0.425, M=48 0.515 / 0.487: the wide projections cross at 40-48, the 576-square at ~28
GEMM_ROWS_PLANES = 40
# the k-quants' own (fp32): their weights are larger and the tiles dequantize 4-5x the bytes; measured with the
# weights from memory (64 copies of 8192x2048 Q4_K, 44 of 2048x8192 Q6_K: past the 480 MiB L3), 2 threads, ms per
# call GEMV / tiles + GEMM: Q4_K M=24 4.9 / 7.6, 32 6.4 / 8.1, 48 9.3 / 10.2, 64 13.1 / 13.2; Q6_K M=24 8.2 / 8.8,
# 32 11.1 / 9.3. Q5_K (not measured) goes with Q4_K: the same kernel with one more load per chunk
GEMM_ROWS_FP32_K = {"Q4_K": 64, "Q5_K": 64, "Q6_K": 32}
_TILE_BYTES = 64 << 20  # a dequantized tile's fp32 at most (one buffer, reused: _tile_buffer)
_scratch = threading.local()
INT8_FORMATS = frozenset(GGUF_BLOCKS)  # activations="int8" takes these: every format
GROUP_FORMAT_NAMES = frozenset(GROUP_FORMATS.values())  # kernels/cpu_quant_group.py's (linear hands them there)


@dataclass(frozen=True)
class PackedQuant:
    """A QuantWeight in the C kernels' layout: rows in groups of 8 (padded with zero rows), each array
    [groups, nb, ...] (see kernels/cpu/quant.c); a k-quant: ``qs`` [groups, nb, 8 * block_bytes], one group-block
    per group and super-block, the rest None (kernels/cpu_quant_k.py, kernels/cpu/quant_k.h)."""
    fmt: str
    rows: int
    cols: int
    qs: torch.Tensor  # uint8 [groups, nb, 8 * qb]: the 8 rows' quant bytes (qb 16, or 32 for Q8_0) in 4-byte chunks
    d: torch.Tensor | None  # float16 [groups, nb, 8] (None: a k-quant)
    m: torch.Tensor | None  # float16 [groups, nb, 8] (Q4_1, Q5_1)
    qh: torch.Tensor | None  # int32 [groups, nb, 8] (Q5_0, Q5_1): bit j is bit 4 of weight j

    def __post_init__(self) -> None:  # the C calls' leading arguments, once (a decode step makes ~120 calls)
        f = block_format(self.fmt)
        object.__setattr__(self, "_c_args", (f.ggml_type, self.qs.data_ptr(),
                                             self.qh.data_ptr() if self.qh is not None else None,
                                             self.d.data_ptr() if self.d is not None else None,
                                             self.m.data_ptr() if self.m is not None else None))

    @property
    def num_bytes(self) -> int:
        """Packed bytes: the file's, plus the padding rows of the last group."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m, self.qh) if t is not None)


def pack(w: QuantWeight) -> PackedQuant:
    """``w``'s blocks rearranged into the kernels' layout (once, at load; the quants of a large weight in huge
    pages: kernels/cpu_quant_isa.py ``in_huge_pages``)."""
    f = GGUF_BLOCKS[w.fmt]
    if f.k_quant:
        return PackedQuant(w.fmt, w.rows, w.cols, cpu_quant_k.pack(w), None, None, None)
    nb, groups = w.num_blocks, -(-w.rows // 8)
    blocks = w.data.reshape(w.rows, nb, f.block_bytes)
    if groups * 8 > w.rows:
        blocks = torch.cat([blocks, blocks.new_zeros(groups * 8 - w.rows, nb, f.block_bytes)])

    def per_row(lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:  # [groups, nb, 8]
        t = blocks[..., lo:hi].contiguous().view(dtype).reshape(groups, 8, nb)
        return t.permute(0, 2, 1).contiguous()

    qb = f.block_bytes - f.quant_start
    qs = blocks[..., f.quant_start:].reshape(groups, 8, nb, qb // 4, 4).permute(0, 2, 3, 1, 4)
    return PackedQuant(w.fmt, w.rows, w.cols, in_huge_pages(qs.contiguous().reshape(groups, nb, 8 * qb)),
                       per_row(0, 2, torch.float16), per_row(2, 4, torch.float16) if f.has_min else None,
                       per_row(2 + 2 * f.has_min, f.quant_start, torch.int32) if f.high_bits else None)


def unpack(p: PackedQuant) -> QuantWeight:
    """The GGUF bytes ``p`` was packed from, byte for byte."""
    if GGUF_BLOCKS[p.fmt].k_quant:
        return cpu_quant_k.unpack(p.fmt, p.rows, p.cols, p.qs)
    groups, nb = p.qs.shape[0], p.cols // GGUF_BLOCKS[p.fmt].block_size

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [groups, nb, 8] -> [rows, nb, bytes]
        return t.permute(0, 2, 1).contiguous().view(torch.uint8).reshape(groups * 8, nb, -1)[:p.rows]

    qs = p.qs.reshape(groups, nb, -1, 8, 4).permute(0, 3, 1, 2, 4).reshape(groups * 8, nb, -1)[:p.rows]
    parts = [per_row(t) for t in (p.d, p.m, p.qh) if t is not None] + [qs]
    return QuantWeight(p.fmt, p.rows, p.cols, torch.cat(parts, dim=-1).reshape(p.rows, -1))


def _dequantize_rows(p: PackedQuant, ids: torch.Tensor | None, row0: int, count: int, isa: str | None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(count, p.cols, dtype=torch.float32) if out is None else out
    if GGUF_BLOCKS[p.fmt].k_quant:
        cpu_quant_k.dequantize_rows_into(out, p._c_args[0], p.qs, ids, row0, isa_level(isa))
        return out
    if count:
        lib().duet_quant_dequantize(*p._c_args, p.cols, ids.data_ptr() if ids is not None else None, row0,
                                    count, out.data_ptr(), isa_level(isa), torch.get_num_threads())
    return out


def dequantize(p: PackedQuant, *, isa: str | None = None) -> torch.Tensor:
    """[rows, cols] float32: exactly ``dequantize_ref(unpack(p))``."""
    return _dequantize_rows(p, None, 0, p.rows, isa)


def rows(p: PackedQuant, ids: torch.Tensor, *, isa: str | None = None) -> torch.Tensor:
    """Rows ``ids`` dequantized (an embedding lookup) -> [len(ids), cols] float32."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if ids.numel() and not recording() and (int(ids.min()) < 0 or int(ids.max()) >= p.rows):
        raise ValueError(f"ids must be in [0, {p.rows})")
    return _dequantize_rows(p, ids, 0, ids.numel(), isa)


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
           activations: str | None = None, isa: str | None = None, tiles: bool = True,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, cols] @ Wᵀ (+ bias)`` -> [M, rows] float32, W the dequantized weight (see the module docstring).
    ``isa``: the instruction set (kernels/cpu_quant_isa.py; None: the default). ``tiles`` False: the GEMV kernel
    at every M (benchmarks), never the dequantized tiles + GEMM. GPTQ / AWQ / compressed-tensors weights go to
    kernels/cpu_quant_group.py (fp32 activations; ``isa`` "scalar" takes its scalar twin). ``out``: a float32
    [M, rows] view (rows contiguous, any row stride: columns of a wider output) the GEMV kernels write into;
    returned (the other paths copy into it)."""
    if out is not None and (out.dtype != torch.float32 or tuple(out.shape) != (x.shape[0], p.rows)
                            or (out.numel() and out.stride(1) != 1)):
        raise ValueError(f"out must be a float32 [{x.shape[0]}, {p.rows}] view with contiguous rows, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if p.fmt in GROUP_FORMAT_NAMES:
        y = cpu_quant_group.linear(x, p, bias, scalar=None if isa is None else isa == "scalar", tiles=tiles)
        return y if out is None else out.copy_(y)
    _check_x(x, p, bias)
    acts = activations or ACTIVATIONS
    if acts not in ("int8", "fp32"):
        raise ValueError(f"activations must be 'int8' or 'fp32', got {acts!r}")
    level = isa_level(isa)
    m = x.shape[0]
    if tiles and m >= gemm_rows(p.fmt, acts, isa):
        y = _linear_gemm_bf16(x, p, bias, isa) if bf16_prefill(acts, isa) else _linear_gemm(x, p, bias, isa)
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(m, p.rows, dtype=torch.float32)
    if m == 0 or p.rows == 0:
        return out
    if GGUF_BLOCKS[p.fmt].k_quant:
        cpu_quant_k.linear_into(out, x, p._c_args[0], p.qs, p.rows, bias, acts, level)
        return out
    if acts == "int8":
        fn = lib().duet_quant_linear
    else:  # AVX512-VNNI: x as 24-bit digits, three integer dots (kernels/cpu/quant_planes.c); else widened weights
        fn = lib().duet_quant_linear_planes if level >= PLANES_LEVEL else lib().duet_quant_linear_f32
    rc = fn(*p._c_args, p.rows, p.cols, x.data_ptr(), x.stride(0), m,
            bias.data_ptr() if bias is not None else None, out.data_ptr(), out.stride(0),
            level, torch.get_num_threads())
    if rc:
        raise NativeKernelError(f"{fn.__name__} failed (code {rc}: no scratch memory)")
    return out


def bf16_prefill(activations: str, isa: str | None = None) -> bool:
    """Tiles of int8 activations' prefill go to the bf16 GEMM: "int8", a CPU with AMX-BF16 and ``isa`` at AVX-512 or
    above (DUET_QUANT_ISA=avx2 plays an older CPU, fp32 tiles)."""
    return activations == "int8" and amx_bf16() and isa_level(isa) >= ISAS.index("avx512")


def gemm_rows(fmt: str, activations: str, isa: str | None = None) -> int:
    """M from which ``linear`` dequantizes tiles for torch's GEMM instead of running the GEMV (measured, above)."""
    if activations == "int8":
        return GEMM_ROWS_BF16 if bf16_prefill(activations, isa) else GEMM_ROWS
    if fmt in GEMM_ROWS_FP32_K:
        return GEMM_ROWS_FP32_K[fmt]
    return GEMM_ROWS_PLANES if isa_level(isa) >= PLANES_LEVEL else GEMM_ROWS_FP32


def _tile_buffer(numel: int) -> torch.Tensor:
    """``numel`` float32 of one buffer per thread, reused across calls: a fresh tile is fresh pages, and in this
    machine's VM a page fault costs ~4 us (a fresh 64 MB tensor filled: 60-80 ms, against 15 ms to dequantize
    8192x2048 Q4_K into it on one thread; /tmp measurement, see kernels/cpu_quant_k.py)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _scratch.buf = torch.empty(numel, dtype=torch.float32)
    return buf[:numel]


def _linear_gemm_bf16(x: torch.Tensor, p: PackedQuant, bias: torch.Tensor | None, isa: str | None) -> torch.Tensor:
    """Prefill of int8 activations on AMX-BF16: weight rows dequantized straight into bf16 (C: exactly gguf-py's
    weights, rounded to nearest even) a tile of at most ``_TILE_BYTES // 2`` at a time into a reused buffer, x
    rounded to bf16 once, each tile one bf16 GEMM (fp32 accumulation in the tiles, the output rounded to bf16 by
    torch, then widened). Error: see the module docstring."""
    tile_rows = max(8, min(p.rows, _TILE_BYTES // (2 * p.cols)))
    buf = _tile_buffer(tile_rows * p.cols // 2 + 1).view(torch.bfloat16)[:tile_rows * p.cols]
    xb = x.to(torch.bfloat16)
    out = torch.empty(x.shape[0], p.rows, dtype=torch.float32)
    for r0 in range(0, p.rows, tile_rows):
        n = min(tile_rows, p.rows - r0)
        tile = buf[:n * p.cols].view(n, p.cols)
        if GGUF_BLOCKS[p.fmt].k_quant:
            rc = lib().duet_quant_k_dequantize_bf16(p._c_args[0], p.qs.data_ptr(), p.cols, r0, n, tile.data_ptr(),
                                                    isa_level(isa), torch.get_num_threads())
        else:
            rc = lib().duet_quant_dequantize_bf16(*p._c_args, p.cols, r0, n, tile.data_ptr(), isa_level(isa),
                                                  torch.get_num_threads())
        if rc:
            raise NativeKernelError("duet_quant_dequantize_bf16 failed (no scratch memory)")
        out[:, r0:r0 + n] = torch.nn.functional.linear(xb, tile)
    return out + bias if bias is not None else out


def _linear_gemm(x: torch.Tensor, p: PackedQuant, bias: torch.Tensor | None, isa: str | None) -> torch.Tensor:
    """Prefill: weight rows dequantized a tile of at most ``_TILE_BYTES`` at a time (C) into a reused buffer, each
    tile one torch GEMM (a whole projection of the default model, or a 1.5B Llama's but its head, is one tile)."""
    tile_rows = max(8, min(p.rows, _TILE_BYTES // (4 * p.cols)))
    buf = _tile_buffer(tile_rows * p.cols)
    if tile_rows == p.rows:
        return torch.nn.functional.linear(x, _dequantize_rows(p, None, 0, p.rows, isa, buf.view(p.rows, p.cols)),
                                          bias)
    out = torch.empty(x.shape[0], p.rows, dtype=torch.float32)
    for r0 in range(0, p.rows, tile_rows):
        n = min(tile_rows, p.rows - r0)
        tile = _dequantize_rows(p, None, r0, n, isa, buf[:n * p.cols].view(n, p.cols))
        out[:, r0:r0 + n] = torch.nn.functional.linear(x, tile)
    return out + bias if bias is not None else out
