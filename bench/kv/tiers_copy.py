"""KV tier copies: the TierMover's host↔device block copies against memcpy of the same bytes (issue 23, must-show 5).

    python -m bench.kv.tiers_copy [--total-mib 1024] [--repeats 7]      # part of `make bench-tiers`

What is timed is the mover's own path (engine/kv/mover.py): one ``Job`` of whole-block ``store`` ops (device
cache → host tier) and one of ``load`` ops (host tier → device cache) submitted to a real ``TierMover`` and
timed from submission to its completion, so the thread hand-off and the per-op bookkeeping count. Blocks go
to shuffled slots, as they do once a cache has churned. Two block sizes: SmolLM2-135M's (fp32, 30 layers ×
2 × 16 tokens × 3 KV heads × 64 = 0.70 MiB) and Llama-3.1-8B's (bf16, 32 × 2 × 16 × 8 × 128 = 2 MiB), and
``--total-mib`` of blocks per cache (1 GiB: far beyond the 32 MiB L3, so every copy reads and writes DRAM).

Baseline, measured in the same run, alternating with the mover: ``memcpy`` (``ctypes.memmove``) of the same
blocks between the same buffers, block by block in the same order, on one thread. Also printed, for
reference: one memcpy of the whole range (glibc streams copies this large with non-temporal stores, which
no per-block copy of ≤ 2 MiB gets). Each figure is the median of ``--repeats`` runs, with its spread.

On CUDA (``torch.cuda.is_available()``) the same jobs run with the cache on the GPU and the host tier pinned
(the mover's side stream), and host→device GB/s is printed against the ≥ 40 GB/s target, with a single
pinned ``copy_`` of the whole range as the reference. Without a GPU that part says it is skipped.

Last line: ``ratio: <mover GB/s / memcpy GB/s>``, the lowest over block sizes and directions (target ≥ 0.8).
"""
from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import time
from dataclasses import dataclass

import torch

from engine.kv.mover import TierMover
from engine.kv.tiers import Job, Op


@dataclass(frozen=True)
class BlockShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16

    @property
    def dims(self) -> tuple[int, ...]:  # one block of the block-major cache (engine/model_runner.py)
        return self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.dims:
            n *= d
        return n


CHUNK_BYTES = 64 << 20  # one timed job's blocks: twice the L3, so no chunk finds the last one's bytes in cache
SHAPES = (BlockShape("SmolLM2-135M fp32", 30, 3, 64, torch.float32),
          BlockShape("Llama-3.1-8B bf16", 32, 8, 128, torch.bfloat16))


def run_job(mover: TierMover, ops: list[Op], job_id: int) -> float:
    """Seconds from submitting one job of ``ops`` to its completion (the mover's thread did the copies)."""
    t0 = time.perf_counter()
    mover.submit(Job(job_id, ops))
    deadline = t0 + 60.0
    while not (done := mover.completions(wait_s=1.0)):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"copy job {job_id} did not complete in 60 s")
    elapsed = time.perf_counter() - t0
    assert [c.job_id for c in done] == [job_id] and not done[0].failed, done
    return elapsed


def memcpy_blocks(dst: torch.Tensor, src: torch.Tensor, pairs: list[tuple[int, int]], nbytes: int) -> float:
    """Seconds to memcpy block ``s`` of ``src`` to block ``d`` of ``dst`` for each ``(d, s)``, one thread."""
    dp, sp = dst.data_ptr(), src.data_ptr()
    t0 = time.perf_counter()
    for d, s in pairs:
        ctypes.memmove(dp + d * nbytes, sp + s * nbytes, nbytes)
    return time.perf_counter() - t0


def memcpy_whole(dst: torch.Tensor, src: torch.Tensor) -> float:
    t0 = time.perf_counter()
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    return time.perf_counter() - t0


def block_ops(num_blocks: int, seed: int) -> tuple[list[Op], list[Op]]:
    """A store of every device block to a shuffled host slot, and the load of each back to its block."""
    slots = list(range(num_blocks))
    random.Random(seed).shuffle(slots)
    stores = [Op("store", b, (), host_slot=s, device_block=b) for b, s in enumerate(slots)]
    loads = [Op("load", b, (), host_slot=s, device_block=b) for b, s in enumerate(slots)]
    return stores, loads


def median_spread(rates: list[float]) -> str:
    return f"{statistics.median(rates):6.2f} GB/s (min {min(rates):.2f}, max {max(rates):.2f})"


def bench_cpu(shape: BlockShape, total_bytes: int, repeats: int) -> dict[str, float]:
    """Median GB/s of the mover's stores and loads and of memcpy of the same blocks; prints each.

    The two sides interleave at a fine grain, so that a noisy neighbour hits both alike: each pass walks the
    cache in chunks of ``CHUNK_BYTES`` (twice the L3), the mover copying chunk i as one job while memcpy copies
    chunk i + half (a region neither touched recently), until each side has copied every block once."""
    n = max(2, total_bytes // shape.nbytes)
    kv = torch.randn((n, *shape.dims)).to(shape.dtype)
    mover = TierMover(kv, n, None, "bench-copy")
    mover.host.copy_(kv)  # touch every host page before timing
    stores, loads = block_ops(n, seed=0)
    per_chunk = max(1, CHUNK_BYTES // shape.nbytes)
    chunks = [range(i, min(i + per_chunk, n)) for i in range(0, n, per_chunk)]
    sides = {"store": ([[stores[b] for b in c] for c in chunks], mover.host, kv),
             "load": ([[loads[b] for b in c] for c in chunks], kv, mover.host)}
    gb = n * shape.nbytes / 1e9
    rates: dict[str, list[float]] = {k: [] for k in ("mover store", "memcpy store", "mover load", "memcpy load",
                                                      "memcpy whole")}
    job_id = 0
    try:
        for _ in range(repeats):
            rates["memcpy whole"].append(gb / memcpy_whole(mover.host, kv))
            for direction, (jobs, dst, src) in sides.items():
                mover_s = memcpy_s = 0.0
                for i, ops in enumerate(jobs):
                    mover_s += run_job(mover, ops, job_id := job_id + 1)
                    other = jobs[(i + len(jobs) // 2) % len(jobs)]
                    pairs = [(op.host_slot, op.device_block) if direction == "store" else (op.device_block, op.host_slot)
                             for op in other]
                    memcpy_s += memcpy_blocks(dst, src, pairs, shape.nbytes)
                rates[f"mover {direction}"].append(gb / mover_s)
                rates[f"memcpy {direction}"].append(gb / memcpy_s)
        assert torch.equal(mover.host[stores[0].host_slot], kv[0])  # the copies copied
    finally:
        mover.close()
    print(f"{shape.name}: {n} blocks of {shape.nbytes / 2**20:.2f} MiB ({gb:.2f} GB) per pass in jobs of "
          f"{per_chunk} blocks, {repeats} passes")
    for k, v in rates.items():
        print(f"  {k:<13} {median_spread(v)}")
    med = {k: statistics.median(v) for k, v in rates.items()}
    out = {"store": med["mover store"] / med["memcpy store"], "load": med["mover load"] / med["memcpy load"]}
    print(f"  mover / memcpy: store {out['store']:.2f}, load {out['load']:.2f}; "
          f"per-block memcpy / one whole memcpy {med['memcpy store'] / med['memcpy whole']:.2f}")
    return out


def bench_cuda(shape: BlockShape, total_bytes: int, repeats: int) -> float:
    """Host→device GB/s of the mover's loads with the cache on the GPU and the host tier pinned."""
    n = max(2, total_bytes // shape.nbytes)
    kv = torch.randn((n, *shape.dims), device="cuda").to(shape.dtype)
    mover = TierMover(kv, n, None, "bench-copy-cuda")
    stores, loads = block_ops(n, seed=0)
    gb = n * shape.nbytes / 1e9
    whole_dst = torch.empty_like(kv)
    loads_gbs, whole_gbs = [], []
    try:
        run_job(mover, stores, 0)  # fill the pinned host tier
        for i in range(repeats):
            loads_gbs.append(gb / run_job(mover, loads, i + 1))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            whole_dst.view(-1).copy_(mover.host.view(-1), non_blocking=True)
            torch.cuda.synchronize()
            whole_gbs.append(gb / (time.perf_counter() - t0))
        # host slot stores[b].host_slot holds device block b (shuffled): every block came back, byte for byte
        slot_of_block = torch.tensor([op.host_slot for op in stores], device="cuda")
        assert torch.equal(whole_dst.index_select(0, slot_of_block), kv), "a block's bytes differ after the round trip"
    finally:
        mover.close()
    print(f"CUDA {shape.name}: mover loads (host→device, pinned, per block) {median_spread(loads_gbs)}; "
          f"one pinned copy of the whole range {median_spread(whole_gbs)} (target >= 40 GB/s)")
    return statistics.median(loads_gbs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=1024, help="bytes of blocks per cache (device and host each)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    total = args.total_mib << 20
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads")
    worst = min(r for shape in SHAPES for r in bench_cpu(shape, total, args.repeats).values())
    if torch.cuda.is_available():
        for shape in SHAPES:
            gbs = bench_cuda(shape, total, args.repeats)
            print(f"CUDA host->device {shape.name}: {gbs:.1f} GB/s ({'meets' if gbs >= 40 else 'BELOW'} 40 GB/s)")
    else:
        print("CUDA host->device: skipped, no GPU here (torch.cuda.is_available() is False)")
    print(f"ratio: {worst:.2f} (mover copy GB/s / memcpy GB/s of the same blocks, lowest of store/load x block sizes;"
          f" target >= 0.8)")


if __name__ == "__main__":
    main()
