"""Group-quantized GEMVs (GPTQ / AWQ / compressed-tensors weights, kernels/cpu_quant_group.py) against the GGUF
block kernels of the same width (kernels/cpu_quant.py, fp32 activations) and torch's fp32 GEMM on the dense
weight, same run.

    python -m bench.kernels.quant_group_gemv [--group-size 128 --m 1 4 16]

Shapes (rows x cols): SmolLM2-135M's at group sizes that divide 576 (32, 64), Qwen2.5-1.5B's at 128 and above. Per shape and M: microseconds per call of the
G4 kernel (4 bits, one scale and zero per ``--group-size`` weights) and Q4_1 (4 bits, scale and min per 32), G8
and Q8_0 (scale per 32), and torch's GEMM on the fp32 weight; each cycles through enough copies of its weight that
they do not stay in cache. Run it alone (the lock: /tmp/duet-bench.lock).
"""
from __future__ import annotations

import argparse
import math
import time

import gguf
import numpy as np
import torch

from kernels import cpu_quant, cpu_quant_group
from kernels.quant import QuantWeight
from kernels.quant_group import GroupQuantWeight

SHAPES = {64: [(576, 576), (1536, 576), (576, 1536)],  # SmolLM2-135M (576 = 9 x 64: no group of 128 fits)
          128: [(1536, 1536), (8960, 1536), (1536, 8960)]}  # Qwen2.5-1.5B
_COLD_BYTES = 96 << 20


def _best_us(fn, copies: int, repeats: int = 7) -> float:
    for i in range(copies):
        fn(i)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(copies):
            fn(i)
        best = min(best, (time.perf_counter() - t0) / copies)
    return best * 1e6


def _group(bits: int, rows: int, cols: int, group_size: int, seed: int) -> GroupQuantWeight:
    gen = torch.Generator().manual_seed(seed)
    ng = cols // group_size
    return GroupQuantWeight(bits, group_size, torch.randint(0, 2 ** bits, (rows, cols), dtype=torch.uint8,
                                                            generator=gen),
                            (torch.rand(rows, ng, generator=gen) * 0.01).half(),
                            torch.full((rows, ng), 2 ** (bits - 1), dtype=torch.int16))


def _gguf(fmt: str, rows: int, cols: int, seed: int) -> QuantWeight:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).numpy() * 0.05
    return QuantWeight(fmt, rows, cols, torch.from_numpy(np.ascontiguousarray(
        gguf.quantize(w, gguf.GGMLQuantizationType[fmt]))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prefill", action="store_true", help="the M sweep that chose GEMM_ROWS: GEMV vs tiles + GEMM")
    args = ap.parse_args()
    if args.prefill:
        return _prefill(args.group_size)
    print(f"threads {torch.get_num_threads()}, group size {args.group_size}; us per call (weights cold)")
    for rows, cols in SHAPES[64 if args.group_size < 128 else 128]:
        copies = max(1, min(32, _COLD_BYTES // (rows * cols * 4)))
        kinds = {
            "G4": [cpu_quant_group.pack(_group(4, rows, cols, args.group_size, s)) for s in range(copies)],
            "Q4_1": [cpu_quant.pack(_gguf("Q4_1", rows, cols, s)) for s in range(copies)],
            "G8": [cpu_quant_group.pack(_group(8, rows, cols, args.group_size, s)) for s in range(copies)],
            "Q8_0": [cpu_quant.pack(_gguf("Q8_0", rows, cols, s)) for s in range(copies)],
        }
        dense = [torch.randn(rows, cols) for _ in range(copies)]
        for m in args.m:
            x = torch.randn(m, cols)
            cells = []
            for name, ws in kinds.items():
                mod = cpu_quant_group if name.startswith("G") else cpu_quant
                extra = {} if name.startswith("G") else {"activations": "fp32"}
                us = _best_us(lambda i, ws=ws, mod=mod, extra=extra: mod.linear(x, ws[i], tiles=False, **extra),
                              copies)
                cells.append(f"{name} {us:7.1f}")
            us = _best_us(lambda i: torch.nn.functional.linear(x, dense[i]), copies)
            print(f"{rows:5d}x{cols:<5d} M={m:3d}: " + "  ".join(cells) + f"  fp32 GEMM {us:7.1f}")


def _prefill(group_size: int) -> None:
    print(f"threads {torch.get_num_threads()}, group size {group_size}; us per call: GEMV kernel / tiles + GEMM")
    for rows, cols in SHAPES[64 if group_size < 128 else 128]:
        copies = max(1, min(16, _COLD_BYTES // (rows * cols * 4)))
        for bits in (4, 8):
            ws = [cpu_quant_group.pack(_group(bits, rows, cols, group_size, s)) for s in range(copies)]
            cells = []
            for m in (8, 16, 24, 32, 48):
                x = torch.randn(m, cols)
                gemv = _best_us(lambda i: cpu_quant_group.linear(x, ws[i], tiles=False), copies, 3)
                tiles = _best_us(lambda i: cpu_quant_group._linear_gemm(x, ws[i], None, None), copies, 3)
                cells.append(f"M={m} {gemv:.0f}/{tiles:.0f}")
            print(f"{rows:5d}x{cols:<5d} G{bits}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
