"""W4A16 and W8A16 GEMMs (kernels/quant_gemm.py, weights dequantized in registers) against bf16 cuBLAS, and the M
from which dequantize + cuBLAS beats them (``DEQUANT_GEMM_ROWS``).

    python -m bench.kernels.quant_gemm [--device cuda] [--m 1 4 16 64 256 1024] [--formats Q4_0 Q8_0 Q4_K]
    TRITON_INTERPRET=1 python -m bench.kernels.quant_gemm --smoke     # tiny shapes in the interpreter (tests)

Shapes of Llama-3.1-8B as [N, K]: 4096x4096 (o_proj), 14336x4096 (gate / up), 4096x14336 (down), 128256x4096 (LM
head). Weights are random blocks in each format (finite fp16 scales; the numbers do not depend on the values),
packed by kernels/quant_gpu.py; x and the cuBLAS weight are bf16. Per format, shape and M: the quantized kernel
(``pick_config``'s tiles, never the fallback), the fallback (the weight dequantized to bf16 by kernels/quant_rows.py,
then ``torch.nn.functional.linear``) and cuBLAS on a bf16 weight, all replayed from CUDA graphs
(``do_bench_cudagraph`` medians, as the engine replays decode steps); Q8_0 rows also time kernels/gemm.py's int8
``w8a16_gemm`` (groups of 32) on the same weights. Each kernel output is first checked against the fallback's
(max error / max |ref| <= 2e-2, else the run stops). Prints per line the microseconds, the speedup over cuBLAS and
the kernel's GB/s of packed weight; then per format the crossover: the smallest M from which the fallback is
at least as fast as the kernel on every shape (where ``DEQUANT_GEMM_ROWS`` should be); last line
``ratio: <W4A16 (the first 4-bit format) at M=1 over bf16 cuBLAS, geometric mean over the shapes>`` (issue 48's
goal: >= 2.5).
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from kernels import quant_gemm as qg
from kernels import quant_rows
from kernels.gemm import quantize_weight_int8, w8a16_gemm
from kernels.quant import GGUF_BLOCKS, QuantWeight
from kernels.quant_gpu import GpuQuant, pack_gpu

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
SMOKE_SHAPES = [(48, 256), (40, 512)]
_SCALES_AT = {"Q6_K": (208,)}  # fp16 scale offsets in a block (default: 0, and 2 for a min)


def random_weight(fmt: str, rows: int, cols: int, device: torch.device, seed: int = 0) -> GpuQuant:
    """Random blocks with fp16 scales ~ N(0, 0.02) (and mins), packed on ``device``."""
    f = GGUF_BLOCKS[fmt]
    gen = torch.Generator(device=device).manual_seed(seed)
    nb = cols // f.block_size
    blocks = torch.randint(0, 256, (rows, nb, f.block_bytes), dtype=torch.uint8, device=device, generator=gen)
    for at in _SCALES_AT.get(fmt, (0, 2) if f.has_min else (0,)):
        scale = (torch.randn(rows, nb, device=device, generator=gen) * 0.02).half()
        blocks[..., at:at + 2] = scale.view(torch.uint8).reshape(rows, nb, 2)
    return pack_gpu(QuantWeight(fmt, rows, cols, blocks.reshape(rows, -1)))


class Timer:
    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke

    def us(self, fn) -> float:
        if self.smoke:  # the interpreter: one call, to check that the script works
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        import triton.testing

        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()


def bench_shape(fmt: str, n: int, k: int, ms: list[int], timer: Timer, dtype: torch.dtype,
                device: torch.device) -> dict[int, tuple[float, float, float]]:
    """{M: (kernel us, fallback us, cuBLAS us)} for one format and shape; one line per M."""
    p = random_weight(fmt, n, k, device)
    dense = quant_rows.quant_rows(p, None, dtype)  # what cuBLAS multiplies: the same weights in x's dtype
    int8 = quantize_weight_int8(dense, 32) if fmt == "Q8_0" else None  # (int8 weight, fp32 scales)
    out: dict[int, tuple[float, float, float]] = {}
    for m in ms:
        x = (torch.randn(m, k, device=device) / k ** 0.5).to(dtype)
        cfg = qg.pick_config(m, n, k, dtype, qg.tu.num_sms(device))
        ref = torch.nn.functional.linear(x, dense)
        err = _rel_err(qg.quant_gemm(x, p, cfg=cfg), ref)
        if not err <= 2e-2:
            raise SystemExit(f"MISMATCH {fmt} {n}x{k} M={m}: max err {err:.2e} of max |ref|")
        t_kernel = timer.us(lambda: qg.quant_gemm(x, p, cfg=cfg))
        t_fallback = timer.us(lambda: qg._dequant_gemm(x, p, None))
        t_cublas = timer.us(lambda: torch.nn.functional.linear(x, dense))
        extra = ""
        if int8 is not None:
            t_int8 = timer.us(lambda: w8a16_gemm(x, *int8))
            extra = f"  w8a16_gemm {t_int8:9.1f} us x{t_cublas / t_int8:5.2f}"
        out[m] = (t_kernel, t_fallback, t_cublas)
        print(f"{fmt} {n:6d}x{k:<5d} M={m:<4d} kernel {t_kernel:9.1f} us x{t_cublas / t_kernel:5.2f} "
              f"{p.num_bytes / t_kernel / 1e3:7.1f} GB/s  dequant+cuBLAS {t_fallback:9.1f} us "
              f"x{t_cublas / t_fallback:5.2f}  cuBLAS {dtype_name(dtype)} {t_cublas:9.1f} us  "
              f"(tiles {cfg.block_m}x{cfg.block_n}x{cfg.block_k} split {cfg.split_k}){extra}", flush=True)
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def crossover(results: dict[tuple[int, int], dict[int, tuple[float, float, float]]], ms: list[int]) -> int | None:
    """The smallest M from which dequantize + cuBLAS is at least as fast as the kernel on every shape."""
    for i, m in enumerate(ms):
        if all(r[mm][1] <= r[mm][0] for r in results.values() for mm in ms[i:]):
            return m
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--formats", nargs="+", default=["Q4_0", "Q8_0", "Q4_K"])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one call each, on the CPU (interpreter)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or --smoke (the interpreter, TRITON_INTERPRET=1)")
    if not qg.tu.triton_available(device):
        raise SystemExit(f"Triton cannot run on {device}: --smoke needs TRITON_INTERPRET=1 in the environment")
    dtype = torch.float16 if args.smoke else torch.bfloat16  # the interpreter's bf16 arithmetic is wrong
    ms = [m for m in args.m if m < 32] if args.smoke else sorted(args.m)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    timer = Timer(args.smoke)
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; DEQUANT_GEMM_ROWS = "
              f"{qg.DEQUANT_GEMM_ROWS} (placeholder)")
    summary, speedup_m1 = [], {}
    for fmt in args.formats:
        results = {(n, k): bench_shape(fmt, n, k, ms, timer, dtype, device) for n, k in shapes}
        cross = crossover(results, ms)
        summary.append(f"crossover {fmt}: " + (f"M={cross} (dequantize + cuBLAS at least as fast from here on every "
                                                 f"shape)" if cross is not None else f"none up to M={ms[-1]}"))
        if ms[0] == 1:
            speedup_m1[fmt] = math.exp(sum(math.log(r[1][2] / r[1][0]) for r in results.values()) / len(results))
            summary.append(f"{fmt} at M=1 over cuBLAS: x{speedup_m1[fmt]:.2f} (geometric mean over the shapes)")
    print("\n".join(summary))
    four_bit = next((f for f in args.formats if f in speedup_m1 and f.startswith("Q4")), None)
    print(f"ratio: {speedup_m1[four_bit]:.2f}" if four_bit else "ratio: n/a (no 4-bit format at M=1)")


if __name__ == "__main__":
    main()
