"""The CPU LoRA kernel (kernels/cpu_lora.py) where the engine runs it: after each projection's base GEMM, over a
decode step's 120 projections of SmolLM2-135M's shapes (30 layers of q/k/v 576 -> 576+192+192, o 576 -> 576,
gate/up 576 -> 2x1536, down 1536 -> 576), batch 16, 8 adapters of rank 16 (2 tokens each).

    python -m bench.kernels.lora_cpu [--lora-dtype float32|bfloat16|float16] [--threads 2] [--isa avx512]

Random weights: the base's packed for oneDNN (kernels/cpu_native.py, as the engine packs an fp32 model), the
adapters' in the slots' layout (engine/lora/pool.py: 157 MB fp32, 78 MB in 16 bits). One step = each projection's
GEMM then its ``PackedLoraSlots.add_``; the base GEMMs stream ~425 MB, so every step reads the adapters' weights from
memory,
as in the engine. Reported: the best of 8 steps of the GEMMs alone and with the LoRA calls, and their difference
(what LoRA adds to a decode step, the Python per call included), after two warm-up steps each.
"""
from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(576, (576, 192, 192)), (576, (576,)), (576, (1536, 1536)), (1536, (576,))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lora-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", default=None, help="kernels/cpu_quant_isa.py level (default: the best this CPU has)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    from kernels import cpu_lora, cpu_native

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype, t, n_slots, r = getattr(torch, args.lora_dtype), args.tokens, args.adapters, args.rank
    projections = []
    for _ in range(30):
        for k, shards in SHAPES:
            # the engine's layout (engine/lora/pool.py)
            store = cpu_lora.PackedLoraSlots(n_slots, k, list(shards), r, dtype)
            for slot in range(n_slots):
                store.write(slot, [(torch.randn(r, k) * 0.02, torch.randn(n, r) * 0.02) for n in shards])
            projections.append((torch.randn(t, k), cpu_native.pack_linear(torch.randn(sum(shards), k) * 0.02), store))
    scaling = torch.full((n_slots,), 2.0)
    slots = torch.arange(t) % n_slots

    def step(lora: bool) -> None:
        for x, w, store in projections:
            out = cpu_native.linear_packed(x, w)
            if lora:
                store.add_(out, x, scaling, slots, isa=args.isa)

    best = {}
    for lora in (False, True, False, True):
        for _ in range(2):
            step(lora)
        for _ in range(8):
            t0 = time.perf_counter()
            step(lora)
            best[lora] = min(best.get(lora, 1e9), time.perf_counter() - t0)
    lora_bytes = sum(store.w.numel() * store.w.element_size() for _, _, store in projections)
    print(f"{t} tokens, {n_slots} adapters of rank {r}, weights {args.lora_dtype} ({lora_bytes / 1e6:.0f} MB read "
          f"per step), {args.threads} threads, isa {args.isa or 'default'}")
    print(f"base GEMMs: {best[False] * 1e3:.2f} ms per step; with LoRA: {best[True] * 1e3:.2f} ms; "
          f"LoRA adds {(best[True] - best[False]) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
