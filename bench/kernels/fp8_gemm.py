"""FP8 checkpoints' W8A8 linears (kernels/fp8_gemm.py: torch._scaled_mm) against bf16 cuBLAS on the dequantized
weight, on a Llama-8B-shaped layer set (issue 49's goal: prefill GEMMs >= 1.5x bf16).

    python -m bench.kernels.fp8_gemm [--device cuda] [--m 1 16 256 2048]
    python -m bench.kernels.fp8_gemm --smoke      # tiny shapes, one call each, on the CPU (oneDNN's _scaled_mm)

Shapes of Llama-3.1-8B as [N, K]: 6144x4096 (q/k/v fused), 4096x4096 (o_proj), 28672x4096 (gate/up fused),
4096x14336 (down). Two weight layouts: per-row scales with per-token activations (compressed-tensors FP8_DYNAMIC,
FBGEMM) and 128x128 blocks with 1x128 activation groups (DeepSeek-V3, FP8_BLOCK; one _scaled_mm per 128 columns of
K). Each call includes the activations' quantization, as the engine runs it; every output is first checked against
``linear_ref`` (max error / max |ref| <= 2e-2, else the run stops). Times: CUDA-graph replays
(``triton.testing.do_bench_cudagraph`` medians, as the engine replays decode steps). Per line the microseconds of
both and the speedup; last line ``ratio: <per-row FP8 over bf16 at the largest M, geometric mean over the shapes>``.
Not yet run on a GPU (no session had one since it was written): ``bash bench/gpu_check.sh fp8``.
"""
from __future__ import annotations

import argparse
import math

import torch

from engine.loading.hf_fp8 import Fp8Weight
from kernels import fp8_gemm

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
SMOKE_SHAPES = [(48, 256), (40, 384)]


def weight(n: int, k: int, block: bool, device: torch.device) -> fp8_gemm.Fp8Packed:
    gen = torch.Generator(device=device).manual_seed(n + k)
    q = (torch.randn(n, k, device=device, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    shape = (-(-n // 128), -(-k // 128)) if block else (n, 1)
    scale = torch.rand(shape, device=device, generator=gen) * 1e-3 + 1e-4
    w = Fp8Weight(q, scale, (128, 128) if block else None)
    return fp8_gemm.pack(w, "dynamic-group" if block else "dynamic-token", 128 if block else 0, device=device)


def timer(smoke: bool):
    if smoke:
        return lambda fn: (fn(), 0.0)[1]
    import triton.testing

    return lambda fn: 1e3 * triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 256, 2048])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one call each, on the CPU")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or --smoke")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise SystemExit(f"{torch.cuda.get_device_name(device)}: FP8 GEMMs need compute capability >= 8.9")
    us = timer(args.smoke)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    ratios = []
    for n, k in SMOKE_SHAPES if args.smoke else SHAPES:
        for block in (False, True):
            p = weight(n, k, block, device)
            dense = fp8_gemm.dequantize(p).to(dtype)
            for m in args.m:
                x = torch.randn(m, k, device=device, dtype=dtype)
                out, ref = fp8_gemm.linear(x, p), fp8_gemm.linear_ref(x, p)
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                if not err <= 2e-2:
                    raise SystemExit(f"MISMATCH {n}x{k} block={block} M={m}: max error {err:.3g} of max |ref|")
                t8 = us(lambda x=x, p=p: fp8_gemm.linear(x, p))
                t16 = us(lambda x=x, dense=dense: torch.nn.functional.linear(x, dense))
                speed = t16 / t8 if t8 else float("nan")
                print(f"{n:>6}x{k:<6} {'128x128 block' if block else 'per-row':>13} M={m:<5} fp8 {t8:9.1f} us  "
                      f"bf16 {t16:9.1f} us  x{speed:.2f}", flush=True)
                if not block and m == max(args.m):
                    ratios.append(speed)
    ratio = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if not args.smoke else float("nan")
    print(f"ratio: {ratio:.2f}")
    return ratio


if __name__ == "__main__":
    main()
