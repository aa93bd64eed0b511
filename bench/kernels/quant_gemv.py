"""GGUF-quantized GEMVs (kernels/cpu_quant.py) against torch's fp32 GEMM on the dequantized weight, same run.

    python -m bench.kernels.quant_gemv [--model smollm|1.5b] [--fmt Q4_1 --head-fmt Q8_0] [--m 1 16]
                                       [--threads 1 2] [--no-dense] [--prefill]

``--model smollm`` (the default): shapes of SmolLM2-135M (the default model), 576x576 (q, o), 1536x576 (gate,
up), 576x1536 (down) in ``--fmt`` and the 49152x576 LM head (the tied Q8_0 embedding) in ``--head-fmt``, weights
quantized by gguf-py. ``--model 1.5b``: a 1.5B Llama's (hidden 2048, intermediate 8192, kv 512, vocab 49152) as a
Q4_K_M file holds them: Q4_K q/o, k/v, gate/up, down; Q6_K the v and down of some layers and the head; random
super-blocks with sane scales (gguf-py cannot quantize the k-quants; the kernels' speed does not depend on the
values). Each shape cycles through enough copies of its weight that they do not stay in cache (a decode step
reads every layer's weights once); ``--no-dense`` skips torch's fp32 GEMM (the 1.5B head is 400 MB of fp32).
Prints per shape, M and thread count: microseconds per call of ``linear``'s two activation paths (``int8``: x
quantized per block, integer dots; ``fp32``: token-exact: with AVX512-VNNI x as three int8 digit planes, exact integer dots, and beside it the
AVX2 kernel that widens the quants to fp32 in registers; below VNNI that one), GB/s of packed
bytes of each, and torch's fp32 GEMM on the dense weight; ``--prefill`` adds the M sweep that chose
``GEMM_ROWS`` (both kernels against tiles dequantized + torch's GEMM). The kernels' instruction set is
``cpu_quant_isa.default_isa()`` (DUET_QUANT_ISA forces one). The last line is ``ratio: <quant / fp32 speed at M=1,
geometric mean over the shapes>`` (``linear``'s default path, ``cpu_quant.ACTIVATIONS``), or with
``--no-dense`` ``gbps: <packed GB/s of the default path at M=1, geometric mean>``.
Run it alone: on a small machine any other CPU-heavy process skews every number.
"""
from __future__ import annotations

import argparse
import math
import time

import gguf
import numpy as np
import torch

from kernels import cpu_quant, cpu_quant_isa
from kernels.quant import GGUF_BLOCKS, QuantWeight

SMOLLM = [("q,o", 576, 576), ("gate,up", 1536, 576), ("down", 576, 1536), ("head", 49152, 576)]
LLAMA_1_5B = [("q,o", "Q4_K", 2048, 2048), ("k,v", "Q4_K", 512, 2048), ("gate,up", "Q4_K", 8192, 2048),
              ("down", "Q4_K", 2048, 8192), ("v", "Q6_K", 512, 2048), ("down", "Q6_K", 2048, 8192),
              ("head", "Q6_K", 49152, 2048)]
_COLD_DENSE_BYTES = 96 << 20  # fp32 copies per shape: at least this much
_COLD_PACKED_BYTES = 512 << 20  # packed copies per shape: at least this much (past any cache of this machine)
_SCALES_AT = {"Q6_K": (208,)}  # a k-quant block's fp16 scales: d at 0 and dmin at 2, Q6_K's d at 208


def _weight(fmt: str, rows: int, cols: int, seed: int) -> QuantWeight:
    gen = torch.Generator().manual_seed(seed)
    f = GGUF_BLOCKS[fmt]
    if f.k_quant:  # random super-blocks, scales small and finite
        nb = cols // f.block_size
        blocks = torch.randint(0, 256, (rows, nb, f.block_bytes), dtype=torch.uint8, generator=gen)
        for lo in _SCALES_AT.get(fmt, (0, 2)):
            scale = (torch.rand(rows, nb, generator=gen) * 1e-3).half()
            blocks[..., lo:lo + 2] = scale.view(torch.uint8).reshape(rows, nb, 2)
        return QuantWeight(fmt, rows, cols, blocks.reshape(rows, -1))
    w = torch.randn(rows, cols, generator=gen).numpy() * 0.05
    data = np.ascontiguousarray(gguf.quantize(w, gguf.GGMLQuantizationType[fmt]))
    return QuantWeight(fmt, rows, cols, torch.from_numpy(data))


def _best_us(fn, copies: int, repeats: int = 5) -> float:
    """Best of ``repeats`` passes over the copies, microseconds per call."""
    for i in range(copies):
        fn(i)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(copies):
            fn(i)
        best = min(best, (time.perf_counter() - t0) / copies)
    return best * 1e6


def _shape(name: str, fmt: str, rows: int, cols: int, ms: list[int], threads: list[int], dense_too: bool) -> float:
    """Prints a line per M and thread count; returns the default path's M=1 figure (speed-up over the dense
    GEMM, or packed GB/s without it) at the last thread count."""
    w0 = _weight(fmt, rows, cols, 0)
    nbytes = cpu_quant.pack(w0).num_bytes
    copies = max(1, min(128, _COLD_PACKED_BYTES // nbytes))
    packed = [cpu_quant.pack(w0 if i == 0 else _weight(fmt, rows, cols, i)) for i in range(copies)]
    dense_copies = max(1, min(32, _COLD_DENSE_BYTES // (rows * cols * 4))) if dense_too else 0
    dense = [cpu_quant.dequantize(packed[i]) for i in range(dense_copies)]
    figure = 1.0
    int8_ok = fmt in cpu_quant.INT8_FORMATS
    for n in threads:
        torch.set_num_threads(n)
        for m in ms:
            x = torch.randn(m, cols)
            t_int8 = _best_us(lambda i: cpu_quant.linear(x, packed[i], activations="int8", tiles=False), copies) \
                if int8_ok else math.nan
            t_f32 = _best_us(lambda i: cpu_quant.linear(x, packed[i], activations="fp32", tiles=False), copies)
            t_dense = _best_us(lambda i: torch.nn.functional.linear(x, dense[i]), dense_copies) \
                if dense_too else math.nan
            wide = cpu_quant_isa.default_isa() == "vnni" and not GGUF_BLOCKS[fmt].k_quant  # fp32: the digit planes
            t_wide = _best_us(lambda i: cpu_quant.linear(x, packed[i], activations="fp32", tiles=False, isa="avx2"),
                              copies) if wide else math.nan
            print(f"{fmt} {name:8s} {rows:6d}x{cols:<5d} M={m:3d} threads {n}  int8 {t_int8:8.1f} us "
                  f"{nbytes / t_int8 / 1e3:6.1f} GB/s  fp32 {t_f32:8.1f} us {nbytes / t_f32 / 1e3:6.1f} GB/s"
                  + (f" (widened weights, AVX2: {t_wide:8.1f} us)" if wide else "")
                  + (f"  torch dense {t_dense:8.1f} us  x{t_dense / t_int8:.2f} / x{t_dense / t_f32:.2f}"
                     if dense_too else ""), flush=True)
            if m == 1:
                t = t_f32 if cpu_quant.ACTIVATIONS == "fp32" or not int8_ok else t_int8
                figure = t_dense / t if dense_too else nbytes / t / 1e3
    return figure


def _prefill(fmt: str, rows: int, cols: int) -> None:
    w = cpu_quant.pack(_weight(fmt, rows, cols, 0))
    dense = cpu_quant.dequantize(w)
    for m in (4, 8, 16, 24, 32, 48, 64, 128, 512):
        x = torch.randn(m, cols)
        kern = _best_us(lambda i: cpu_quant.linear(x, w, activations="int8", tiles=False), 1, 3) \
            if fmt in cpu_quant.INT8_FORMATS else math.nan
        f32 = _best_us(lambda i: cpu_quant.linear(x, w, activations="fp32", tiles=False), 1, 3)
        tiles = _best_us(lambda i: cpu_quant._linear_gemm(x, w, None, None), 1, 3)
        dense_us = _best_us(lambda i: torch.nn.functional.linear(x, dense), 1, 3)
        print(f"prefill {fmt} {rows}x{cols} M={m:4d}: int8 kernel {kern:9.1f} us  fp32 kernel {f32:9.1f} us  "
              f"tiles+GEMM {tiles:9.1f} us  (dense fp32 GEMM {dense_us:9.1f} us)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("smollm", "1.5b"), default="smollm")
    ap.add_argument("--fmt", default="Q4_1", help="smollm: the layers' format")
    ap.add_argument("--head-fmt", default="Q8_0", help="smollm: the head's format")
    ap.add_argument("--m", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--threads", type=int, nargs="*", default=[torch.get_num_threads()])
    ap.add_argument("--no-dense", action="store_true", help="skip torch's fp32 GEMM on the dequantized weight")
    ap.add_argument("--prefill", action="store_true")
    args = ap.parse_args()
    shapes = LLAMA_1_5B if args.model == "1.5b" else [
        (name, args.head_fmt if name == "head" else args.fmt, rows, cols) for name, rows, cols in SMOLLM]
    print(f"threads {args.threads}; kernels' ISA: {cpu_quant_isa.default_isa()}; "
          f"default activations {cpu_quant.ACTIVATIONS}")
    figures = [_shape(*s, args.m, args.threads, not args.no_dense) for s in shapes]
    if args.prefill:
        for _, fmt, rows, cols in shapes[1:3]:
            _prefill(fmt, rows, cols)
    mean = math.exp(sum(map(math.log, figures)) / len(figures))
    print(f"gbps: {mean:.1f}" if args.no_dense else f"ratio: {mean:.3f}")


if __name__ == "__main__":
    main()
