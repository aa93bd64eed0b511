"""KV block transfer bandwidth: NIXL between two processes vs memcpy of the same bytes.

    python -m bench.kv.transfer [--mib 64] [--block-kib 256] [--iters 10]

Two processes (multiprocessing "spawn"): an owner holding a cache of 2x the payload, filled with a
pattern, and this process, the puller. For two placements of the same number of blocks —
  contiguous: blocks 0..n-1 -> 0..n-1 (one descriptor),
  scattered:  every other owner block -> a shuffled set of local blocks (~n descriptors),
we time, per iteration, the whole blocking call (validate, merge runs, post, poll to DONE):
  READ   the puller pulls with NixlTransport.read_blocks   (the protocol duet uses),
  WRITE  the owner pushes with NixlTransport.write_blocks  (the alternative),
  memcpy the same runs copied tensor-to-tensor in ONE process with torch (copy_ per run, 1 thread):
         the floor any host-memory transport is measured against.
Reported: median GB/s (1e9 B/s) over --iters after 2 warm-ups; bytes are checked after each READ.
The last line is `ratio: <READ scattered / memcpy scattered>`, the realistic case (a request's blocks
are spread over the owner's pool).

What limits it (2 vCPUs shared with other jobs; runs vary 2x): on one host UCX moves the bytes with
cma, i.e. process_vm_readv/writev: one thread, the kernel pins the other process's pages a few at a
time and copies them, which lands at 0.3-0.66 of an in-process memcpy (1.3-5.2 vs 4-7.8 GB/s). With
256 KiB blocks the descriptor count does not matter (1 vs 256 descriptors: same GB/s); with
`--block-kib 32` (2048 descriptors) scattered READ drops to a third to a half of contiguous (the
memcpy loop drops too: one torch call per run costs ~10 us). With nixl's own
progress-thread default (spinning) both processes burn a core each and every number here halves;
NixlTransport sets a poll delay instead (see nixl_transport._create_agent). Over `UCX_TLS=tcp` READ
falls to 0.5-0.9 GB/s (UCX emulates get over TCP with request/reply).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import time

import torch

from kvtransfer import BLOCK_MAJOR, KVCompat, NixlTransport, merge_block_runs

WARMUP_ITERS = 2


def bench_compat(block_kib: int) -> KVCompat:
    # 16 tokens x 8 kv heads x 64 head_dim x bf16 x K,V = 32 KiB per layer; layers make up the rest.
    num_layers = max(1, block_kib // 32)
    return KVCompat("bench/kv", "bfloat16", BLOCK_MAJOR, 16, num_layers, 8, 64)


def make_cache(compat: KVCompat, num_blocks: int, fill: bool) -> torch.Tensor:
    shape = (num_blocks, compat.num_layers, 2, compat.block_size, compat.num_kv_heads, compat.head_dim)
    if not fill:
        return torch.zeros(shape, dtype=torch.bfloat16)
    # distinct int16 pattern per element, cheap to build and to check
    return torch.arange(torch.Size(shape).numel(), dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(shape)


def owner_main(conn, compat: KVCompat, num_blocks: int) -> None:
    torch.set_num_threads(1)
    kv = make_cache(compat, num_blocks, fill=True)
    with NixlTransport(kv, compat, agent_name="bench-owner") as transport:
        conn.send(transport.peer_info())
        while True:
            command, arg = conn.recv()
            if command == "exit":
                return
            if command == "push":  # WRITE our blocks into the puller's cache, timed here
                puller_info, local_ids, remote_ids = arg
                if not transport.has_peer(puller_info.agent_name):
                    transport.add_peer(puller_info)
                conn.send(transport.write_blocks(puller_info.agent_name, local_ids, remote_ids).elapsed_s)


def check(kv: torch.Tensor, reference: torch.Tensor, remote_ids, local_ids) -> None:
    if not torch.equal(kv[local_ids].view(torch.int16), reference[remote_ids].view(torch.int16)):
        raise AssertionError("transferred blocks differ from the owner's")


def timed_memcpy(dst: torch.Tensor, src: torch.Tensor, remote_ids, local_ids) -> float:
    start_s = time.perf_counter()
    for run in merge_block_runs(remote_ids, local_ids):
        dst[run.local_start : run.local_start + run.num_blocks].copy_(
            src[run.remote_start : run.remote_start + run.num_blocks]
        )
    return time.perf_counter() - start_s


def median_gbps(num_bytes: int, times_s: list[float]) -> float:
    return num_bytes / statistics.median(times_s[WARMUP_ITERS:]) / 1e9


def run(mib: int, block_kib: int, iters: int) -> None:
    torch.set_num_threads(1)
    compat = bench_compat(block_kib)
    probe = make_cache(compat, 1, fill=False)
    bytes_per_block = probe.numel() * probe.element_size()
    num_blocks = (mib << 20) // bytes_per_block
    payload_bytes = num_blocks * bytes_per_block
    owner_blocks = 2 * num_blocks

    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    owner = ctx.Process(target=owner_main, args=(child_conn, compat, owner_blocks), daemon=True)
    owner.start()
    try:
        owner_info = conn.recv()
        reference = make_cache(compat, owner_blocks, fill=True)  # same bytes as the owner's, for checks
        kv = make_cache(compat, owner_blocks, fill=False)
        rng = random.Random(0)
        scenarios = {
            "contiguous": (list(range(num_blocks)), list(range(num_blocks))),
            "scattered": (list(range(0, owner_blocks, 2)), rng.sample(range(owner_blocks), num_blocks)),
        }
        print(f"kvtransfer bench: {payload_bytes / 2**20:.1f} MiB = {num_blocks} blocks x {bytes_per_block >> 10} KiB,"
              f" 2 processes, {os.environ.get('UCX_TLS', 'UCX_TLS unset (UCX default: all)')},"
              f" median of {iters} after {WARMUP_ITERS} warm-ups, GB = 1e9 B")
        results = {}
        with NixlTransport(kv, compat, agent_name="bench-puller") as transport:
            transport.add_peer(owner_info)
            for name, (remote_ids, local_ids) in scenarios.items():
                num_descs = len(merge_block_runs(remote_ids, local_ids))
                reads, writes, copies = [], [], []
                for _ in range(WARMUP_ITERS + iters):  # interleaved, so load on the host hits all three alike
                    kv.zero_()
                    reads.append(transport.read_blocks(owner_info.agent_name, remote_ids, local_ids).elapsed_s)
                    check(kv, reference, remote_ids, local_ids)
                    kv.zero_()
                    conn.send(("push", (transport.peer_info(), remote_ids, local_ids)))
                    writes.append(conn.recv())
                    check(kv, reference, remote_ids, local_ids)
                    copies.append(timed_memcpy(kv, reference, remote_ids, local_ids))
                results[name] = {
                    "READ": median_gbps(payload_bytes, reads),
                    "WRITE": median_gbps(payload_bytes, writes),
                    "memcpy": median_gbps(payload_bytes, copies),
                }
                cols = "  ".join(f"{k} {v:6.2f} GB/s" for k, v in results[name].items())
                print(f"{name:>10} ({num_descs:4d} descriptors): {cols}")
        scattered = results["scattered"]
        print(f"read/write (scattered): {scattered['READ'] / scattered['WRITE']:.2f}")
        print(f"ratio: {scattered['READ'] / scattered['memcpy']:.3f}")
    finally:
        conn.send(("exit", None))
        owner.join(10)
        if owner.is_alive():
            owner.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="payload per transfer (MiB)")
    parser.add_argument("--block-kib", type=int, default=256, help="bytes per KV block (KiB, multiple of 32)")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    run(args.mib, args.block_kib, args.iters)


if __name__ == "__main__":
    main()
