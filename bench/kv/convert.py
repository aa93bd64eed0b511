"""Mixed precision across pools: where to convert a prefill worker's fp32 KV blocks into a decode worker's int8 ones.

    python -m bench.kv.convert [--blocks 64] [--iters 10] [--threads 1]

Two processes (multiprocessing "spawn"): an owner holding an fp32 cache and an int8 cache of SmolLM2-135M's geometry
(30 layers, 3 KV heads x 64, 16-token blocks: 720 KiB vs 191.25 KiB per block), both registered with NIXL, and this
process, the puller. Per iteration, for the same ``--blocks`` scattered blocks (a prompt of blocks x 16 tokens):
  read fp32   NixlTransport.read_blocks of the owner's fp32 blocks (into a staging tensor)
  read int8   the same blocks of the owner's int8 cache (what converting on the prefill side would ship)
  quantize    kernels/kv_quant.store_blocks through the C int8 store (kernels/cpu_kv_int8.py) of the staged fp32
              blocks into an int8 cache: the conversion, which costs the same whichever side runs it
Reported: the median of each (ms) over --iters after 2 warm-ups, and the two totals:
  convert on the pull (duet):   read fp32 + quantize   (on the decode worker's transfer thread)
  convert before sending:       quantize + read int8   (on the prefill worker, before the handoff is published)
The bytes on the wire are the fp32 / int8 block sizes times the blocks.
"""
from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import time

import torch

from kernels import cpu_kv_int8, kv_quant
from kvtransfer import BLOCK_MAJOR, KVCompat, NixlTransport
from kvtransfer.layout import PAGE_SCALES

WARMUP_ITERS = 2
FP32 = KVCompat("bench/smollm2-135m", "float32", BLOCK_MAJOR, 16, 30, 3, 64)
INT8 = KVCompat("bench/smollm2-135m", "int8", BLOCK_MAJOR, 16, 30, 3, 64, scale_layout=PAGE_SCALES)


def fp32_cache(num_blocks: int, fill: bool) -> torch.Tensor:
    c = FP32
    shape = (num_blocks, c.num_layers, 2, c.block_size, c.num_kv_heads, c.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)) if fill else torch.zeros(shape)


def int8_cache(num_blocks: int) -> torch.Tensor:
    c = INT8
    return kv_quant.allocate(num_blocks, c.num_layers, c.block_size, c.num_kv_heads, c.head_dim, torch.int8, "cpu")


def quantize(src: torch.Tensor, dst: torch.Tensor, block_ids) -> None:
    layers = kv_quant.layer_views(dst, INT8.block_size, INT8.num_kv_heads, INT8.head_dim)
    kv_quant.store_blocks(cpu_kv_int8.store_kv, layers, src, block_ids, torch.float32)


def owner_main(conn, num_blocks: int, threads: int) -> None:
    torch.set_num_threads(threads)
    dense = fp32_cache(num_blocks, fill=True)
    quant = int8_cache(num_blocks)
    quantize(dense, quant, list(range(num_blocks)))
    with NixlTransport(dense, FP32, agent_name="convert-owner-fp32") as a, \
            NixlTransport(quant, INT8, agent_name="convert-owner-int8") as b:
        conn.send((a.peer_info(), b.peer_info()))
        conn.recv()  # exit


def ms(times_s: list[float]) -> float:
    return 1e3 * statistics.median(times_s[WARMUP_ITERS:])


def run(num_blocks: int, iters: int, threads: int) -> None:
    torch.set_num_threads(threads)
    owner_blocks = 2 * num_blocks
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    owner = ctx.Process(target=owner_main, args=(child_conn, owner_blocks, threads), daemon=True)
    owner.start()
    try:
        dense_info, quant_info = conn.recv()
        rng = random.Random(0)
        remote = list(range(0, owner_blocks, 2))
        local = rng.sample(range(owner_blocks), num_blocks)
        staging, dst = fp32_cache(num_blocks, fill=False), int8_cache(owner_blocks)
        wire = {"fp32": num_blocks * dense_info.layout.bytes_per_block,
                "int8": num_blocks * quant_info.layout.bytes_per_block}
        times: dict[str, list[float]] = {"read fp32": [], "read int8": [], "quantize": []}
        with NixlTransport(staging, FP32, agent_name="convert-puller-fp32") as a, \
                NixlTransport(int8_cache(owner_blocks), INT8, agent_name="convert-puller-int8") as b:
            a.add_peer(dense_info)
            b.add_peer(quant_info)
            for _ in range(WARMUP_ITERS + iters):  # interleaved, so load on the host hits all three alike
                times["read fp32"].append(a.read_blocks(dense_info.agent_name, remote, list(range(num_blocks))).elapsed_s)
                times["read int8"].append(b.read_blocks(quant_info.agent_name, remote, local).elapsed_s)
                t0 = time.perf_counter()
                quantize(staging, dst, local)
                times["quantize"].append(time.perf_counter() - t0)
        med = {k: ms(v) for k, v in times.items()}
        print(f"convert bench: {num_blocks} blocks x 16 tokens of SmolLM2-135M's KV (30 layers, 3 KV heads x 64), "
              f"2 processes, {threads} thread(s), median of {iters} after {WARMUP_ITERS} warm-ups")
        print(f"  wire bytes: fp32 {wire['fp32'] / 2**20:.2f} MiB, int8 {wire['int8'] / 2**20:.2f} MiB "
              f"({wire['fp32'] / wire['int8']:.2f}x)")
        for k, v in med.items():
            print(f"  {k:>10}: {v:7.2f} ms")
        print(f"  convert on the pull (read fp32 + quantize): {med['read fp32'] + med['quantize']:7.2f} ms")
        print(f"  convert before sending (quantize + read int8): {med['quantize'] + med['read int8']:7.2f} ms")
    finally:
        conn.send("exit")
        owner.join(10)
        if owner.is_alive():
            owner.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64, help="blocks per handoff (16 tokens each)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads per process")
    args = parser.parse_args()
    run(args.blocks, args.iters, args.threads)


if __name__ == "__main__":
    main()
