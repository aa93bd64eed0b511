"""MKL's sgemm on dense weights vs oneDNN on weights packed once (what the CPU path uses), at the shapes of the
default model: the four projections of every layer, weights cold (30 distinct layers, as in a real step).

    python -m bench.kernels.gemm_backends [--hidden 576 --inter 1536 --q 576 --kv 192 --vocab 49152 --layers 30]

Prints milliseconds per step (all layers) for each M (tokens in the step) and the LM head at decode sizes; the
last line is ``ratio: <MKL / oneDNN>`` at M = 8 (a typical decode batch on this workload's tail).
"""
from __future__ import annotations

import argparse

import torch

from bench.engine.throughput import _timed
from kernels import cpu_native


def _best(fn, repeats: int = 4) -> float:
    fn()  # warm-up: oneDNN creates its primitive for the shape
    return min(_timed(fn) for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--inter", type=int, default=1536)
    ap.add_argument("--q", type=int, default=576)
    ap.add_argument("--kv", type=int, default=192)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--m", type=int, nargs="*", default=[1, 4, 8, 16, 32, 64, 128, 2048])
    args = ap.parse_args()
    if not cpu_native.onednn_available():
        raise SystemExit("this torch build has no oneDNN (mkldnn) ops")
    h = args.hidden
    shapes = [(args.q + 2 * args.kv, h), (h, args.q), (2 * args.inter, h), (h, args.inter)]
    dense = [[torch.randn(n, k) for n, k in shapes] for _ in range(args.layers)]
    packed = [[cpu_native.pack_linear(w) for w in layer] for layer in dense]
    head = torch.randn(args.vocab, h)
    head_packed = cpu_native.pack_linear(head)
    print(f"threads {torch.get_num_threads()}; ms per step over {args.layers} layers (weights cold)")
    at8 = None
    for m in args.m:
        xs = [torch.randn(m, k) for _, k in shapes]

        def run_dense():
            for layer in dense:
                for x, w in zip(xs, layer):
                    torch.nn.functional.linear(x, w)

        def run_packed():
            for layer in packed:
                for x, w in zip(xs, layer):
                    cpu_native.linear_packed(x, w)

        a, b = _best(run_dense), _best(run_packed)
        line = f"M={m:5d}  layers: MKL dense {a * 1e3:8.1f}  oneDNN packed {b * 1e3:8.1f}"
        if m <= 128:
            x = torch.randn(m, h)
            ha = _best(lambda: torch.nn.functional.linear(x, head))
            hb = _best(lambda: cpu_native.linear_packed(x, head_packed))
            line += f"  | LM head: {ha * 1e3:6.1f} / {hb * 1e3:6.1f}"
        print(line, flush=True)
        if m == 8:
            at8 = a / b
    if at8 is not None:
        print(f"ratio: {at8:.2f}")


if __name__ == "__main__":
    main()
