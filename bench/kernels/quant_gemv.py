"""GGUF-quantized GEMVs (kernels/cpu_quant.py) against torch's fp32 GEMM on the dequantized weight, same run.

    python -m bench.kernels.quant_gemv [--fmt Q4_1 --head-fmt Q8_0 --m 1 16 --prefill]

Shapes of SmolLM2-135M (the default model): 576x576 (q, o), 1536x576 (gate, up), 576x1536 (down) in ``--fmt``
and the 49152x576 LM head (the tied Q8_0 embedding) in ``--head-fmt``. Each shape cycles through enough copies
of its weight that the fp32 ones do not stay in cache (a decode step reads 30 layers' weights once each).
Prints per shape and M: microseconds per call of ``linear``'s two activation paths (``int8``: x quantized per
block, integer dots; ``fp32``: quants widened to fp32 in registers, token-exact), GB/s of packed bytes of each,
and of torch's fp32 GEMM on the dense weight; ``--prefill`` adds the M sweep that chose ``GEMM_ROWS`` (both
kernels against tiles dequantized + torch's GEMM). The last line is
``ratio: <quant / fp32 speed at M=1, geometric mean over the shapes>`` (``linear``'s default path,
``cpu_quant.ACTIVATIONS``).
Run it alone: on a small machine any other CPU-heavy process skews every number.
"""
from __future__ import annotations

import argparse
import math
import time

import gguf
import numpy as np
import torch

from kernels import cpu_quant
from kernels.quant import QuantWeight, dequantize_ref

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]
_COLD_BYTES = 96 << 20  # fp32 copies per shape: at least this much (above this machine's caches)


def _weight(fmt: str, rows: int, cols: int, seed: int) -> QuantWeight:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).numpy() * 0.05
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


def _shape(fmt: str, rows: int, cols: int, ms: list[int]) -> float:
    copies = max(1, min(32, _COLD_BYTES // (rows * cols * 4)))
    ws = [_weight(fmt, rows, cols, seed) for seed in range(copies)]
    packed = [cpu_quant.pack(w) for w in ws]
    dense = [dequantize_ref(w) for w in ws]
    nbytes = packed[0].num_bytes
    speedup_m1 = 1.0
    for m in ms:
        x = torch.randn(m, cols)
        t_fp32 = _best_us(lambda i: torch.nn.functional.linear(x, dense[i]), copies)
        t_int8 = _best_us(lambda i: cpu_quant.linear(x, packed[i], activations="int8"), copies)
        t_f32 = _best_us(lambda i: cpu_quant.linear(x, packed[i], activations="fp32"), copies)
        print(f"{fmt} {rows:6d}x{cols:<5d} M={m:3d}  int8 {t_int8:8.1f} us {nbytes / t_int8 / 1e3:6.1f} GB/s"
              f"  fp32 {t_f32:8.1f} us {nbytes / t_f32 / 1e3:6.1f} GB/s  torch dense {t_fp32:8.1f} us"
              f"  x{t_fp32 / t_int8:.2f} / x{t_fp32 / t_f32:.2f}")
        if m == 1:
            speedup_m1 = t_fp32 / (t_f32 if cpu_quant.ACTIVATIONS == "fp32" else t_int8)
    return speedup_m1


def _prefill(fmt: str, rows: int, cols: int) -> None:
    w = cpu_quant.pack(_weight(fmt, rows, cols, 0))
    dense = cpu_quant.dequantize(w)
    for m in (4, 8, 16, 24, 32, 48, 64, 128, 512):
        x = torch.randn(m, cols)
        kern = _best_us(lambda i: cpu_quant.linear(x, w, activations="int8", tiles=False), 1, 3)
        f32 = (_best_us(lambda i: cpu_quant.linear(x, w, activations="fp32"), 1, 3) if m < cpu_quant.GEMM_ROWS_FP32
               else math.nan)  # from GEMM_ROWS_FP32 on, fp32 is the tiles
        tiles = _best_us(lambda i: cpu_quant._linear_gemm(x, w, None, None), 1, 3)
        dense_us = _best_us(lambda i: torch.nn.functional.linear(x, dense), 1, 3)
        print(f"prefill {fmt} {rows}x{cols} M={m:4d}: int8 kernel {kern:9.1f} us  fp32 kernel {f32:9.1f} us  "
              f"tiles+GEMM {tiles:9.1f} us  (dense fp32 GEMM {dense_us:9.1f} us)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="Q4_1")
    ap.add_argument("--head-fmt", default="Q8_0")
    ap.add_argument("--m", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--prefill", action="store_true")
    args = ap.parse_args()
    print(f"threads {torch.get_num_threads()}; AVX2 path: {cpu_quant.simd_available()}; "
          f"default activations {cpu_quant.ACTIVATIONS}")
    speedups = [_shape(args.head_fmt if rows == 49152 else args.fmt, rows, cols, args.m) for rows, cols in SHAPES]
    if args.prefill:
        for rows, cols in SHAPES[1:3]:
            _prefill(args.fmt, rows, cols)
    print(f"ratio: {math.exp(sum(map(math.log, speedups)) / len(speedups)):.3f}")


if __name__ == "__main__":
    main()
