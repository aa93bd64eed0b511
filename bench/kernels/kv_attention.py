"""The CPU attention kernels over an fp32 KV cache and over an int8 one (kernels/cpu_native.py, kernels/cpu_kv_int8.py),
at the default model's shape: every layer of one decode step (or one prefill), K/V cold (``--layers`` distinct layers
of one cache, as in a real step), the same lengths and block tables for both.

    python -m bench.kernels.kv_attention [--batch 16 --context 4096 --layers 30 --q-heads 9 --kv-heads 3 --head-dim 64]

Prints milliseconds per step (all layers) of decode attention, of the int8 store of the step's rows, and of prefill
attention over ``--prefill`` new tokens of one sequence; the last line is ``ratio: <fp32 ms / int8 ms>`` of decode.

Measured (2-vCPU Xeon, 2 threads, defaults, 2026-11-28): decode fp32 176.2 ms (3.02 GB of K/V at 17.1 GB/s), int8
79.9 ms (0.80 GB at 10.0 GB/s): ratio 2.21; the int8 store of 16 rows 1.3 ms per step (all layers); prefill of 1,024
tokens fp32 322 ms, int8 307 ms.
"""
from __future__ import annotations

import argparse

import torch

from bench.engine.throughput import _timed
from kernels import cpu_kv_int8, cpu_native, kv_quant


def _best(fn, repeats: int) -> float:
    fn()
    return min(_timed(fn) for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=1024, help="new tokens of the prefill case (one sequence)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--q-heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    B, H, D, L = args.block_size, args.kv_heads, args.head_dim, args.layers
    per_seq = -(-args.context // B)
    num_blocks = args.batch * per_seq
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_blocks, generator=gen)[: args.batch * per_seq].view(args.batch, per_seq).int()
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    dense = torch.randn(num_blocks, L, 2, B, H, D, generator=gen)
    quant = kv_quant.allocate(num_blocks, L, B, H, D, torch.int8, "cpu")
    d_layers = kv_quant.layer_views(dense, B, H, D)
    q_layers = kv_quant.layer_views(quant, B, H, D)
    every_slot = torch.arange(num_blocks * B)
    for d, q in zip(d_layers, q_layers):  # the int8 cache holds the fp32 one's values, quantized
        cpu_kv_int8.store_kv(d.key.reshape(-1, H, D), d.value.reshape(-1, H, D), q.key, q.value, every_slot,
                             **q.scales)
    qs = torch.randn(args.batch, args.q_heads, D, generator=gen)
    scale = D ** -0.5
    kv_gb = {"fp32": dense.nbytes / 1e9, "int8": quant.nbytes / 1e9}

    def decode(layers, fn):
        return lambda: [fn(qs, lay.key, lay.value, tables, lens, scale, **lay.scales) for lay in layers]

    step = {"fp32": _best(decode(d_layers, cpu_native.paged_decode_attention), args.repeats),
            "int8": _best(decode(q_layers, cpu_kv_int8.paged_decode_attention), args.repeats)}
    print(f"decode attention, batch {args.batch} x {args.context} tokens, {L} layers, {args.q_heads}/{H} heads x {D}, "
          f"{torch.get_num_threads()} threads")
    for name, s in step.items():
        print(f"  {name}: {1e3 * s:8.2f} ms per step, K/V {kv_gb[name]:.2f} GB read at {kv_gb[name] / s:.1f} GB/s")
    new = torch.randn(args.batch, H, D, generator=gen)
    new_slots = tables[:, -1].long() * B + (args.context - 1) % B
    store = _best(lambda: [cpu_kv_int8.store_kv(new, new, lay.key, lay.value, new_slots, **lay.scales)
                           for lay in q_layers], args.repeats)
    print(f"  int8 store of the step's {args.batch} rows: {1e3 * store:.3f} ms per step (all layers)")
    n = min(args.prefill, args.context)
    pq = torch.randn(n, args.q_heads, D, generator=gen)
    cu, plen = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)

    def prefill(layers, fn):
        return lambda: [fn(pq, lay.key, lay.value, tables[:1], cu, plen, scale, **lay.scales) for lay in layers]

    pre = {"fp32": _best(prefill(d_layers, cpu_native.prefill_attention), max(2, args.repeats // 2)),
           "int8": _best(prefill(q_layers, cpu_kv_int8.prefill_attention), max(2, args.repeats // 2))}
    print(f"prefill attention, one sequence of {n} new tokens, {L} layers")
    for name, s in pre.items():
        print(f"  {name}: {1e3 * s:8.1f} ms")
    print(f"ratio: {step['fp32'] / step['int8']:.2f}")


if __name__ == "__main__":
    main()
