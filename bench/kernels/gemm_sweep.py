"""Tile configs of our Triton GEMM at decode shapes on a GPU, bf16 and int8 weight-only, against cuBLAS bf16.

    python -m bench.kernels.gemm_sweep [--m 1 16] [--nk 4096]

Each config's output is checked against the torch reference first (a config that disagrees is reported, not
timed); times are ``triton.testing.do_bench_cudagraph`` medians, so the Python launch is out of them (the engine
replays decode steps from CUDA graphs too). Prints one line per (M, weights, config) and, last, the best config
per case with its time against cuBLAS's. What it is for: ``kernels.gemm._pick_config`` was chosen without a GPU;
this is the measurement to choose it by (a first reading on an H200 is in docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.testing

from kernels.gemm import _GemmConfig, _launch_gemm, gemm_ref, quantize_weight_int8, w8a16_gemm_ref


def time_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--nk", type=int, default=4096)
    args = ap.parse_args()
    n = k = args.nk
    torch.manual_seed(0)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    qw, scales = quantize_weight_int8(w)
    configs = [_GemmConfig(16, bn, bk, nw, st, sk) for bn, bk, nw, st, sk in
               itertools.product((64, 128), (128, 256), (4,), (3, 4), (1, 2, 4))]
    best = {}
    for m in args.m:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        cublas = time_us(lambda: gemm_ref(x, w))
        for quant in (False, True):
            ref = w8a16_gemm_ref(x, qw, scales) if quant else gemm_ref(x, w)
            for cfg in configs:
                args_ = (x, qw, scales, None, k) if quant else (x, w, None, None, None)
                try:
                    out = _launch_gemm(*args_, cfg=cfg)
                    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    if not err < 2e-2:
                        print(f"M={m} {'int8' if quant else 'bf16'} {cfg}: WRONG (rel err {err:.2e})")
                        continue
                    us = time_us(lambda: _launch_gemm(*args_, cfg=cfg))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is a row, not an end
                    print(f"M={m} {'int8' if quant else 'bf16'} {cfg}: failed {type(e).__name__}: {e}"[:200])
                    continue
                print(f"M={m} {'int8' if quant else 'bf16'} {cfg}: {us:7.1f} us (cuBLAS bf16 {cublas:.1f})", flush=True)
                key = (m, quant)
                if key not in best or us < best[key][0]:
                    best[key] = (us, cfg, cublas)
    print(f"best configs, {n}x{k} weights, {torch.cuda.get_device_name()}:")
    for (m, quant), (us, cfg, cublas) in sorted(best.items()):
        print(f"  M={m:<3} {'int8' if quant else 'bf16'}: {us:6.1f} us vs cuBLAS bf16 {cublas:5.1f} us "
              f"({cublas / us:.2f}x) with {cfg}")


if __name__ == "__main__":
    main()
