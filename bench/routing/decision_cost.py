"""Router decision cost: hash an 8k-token prompt (BlockHasher), match it in a PrefixIndex of 16 workers and
~100k indexed blocks, and score the 16 workers with CacheAwarePolicy. Target: p99 < 1 ms on one core.

    python -m bench.routing.decision_cost [--iters N] [--prompt-tokens T] [--workers W] [--blocks K]

The index holds ``K`` distinct blocks: chains of 512 blocks ("documents"), each stored on 1-3 random workers
up to a random prefix length, through real BlockStored events. The prompt is the first T tokens of one
document, held whole by one worker and as shorter prefixes by the others, so ``match`` walks all its
blocks (the worst case for the walk). Reported: p50 / p99 / max of the whole decision and of each part, in
thread CPU time (what a quiet core would see) and the total in wall time.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.kv.events import BlockStored
from engine.kv.hashing import BlockHasher
from router.routing.index import PrefixIndex
from router.routing.load import LoadTracker
from router.routing.policy import CacheAwarePolicy, Role


def build(num_workers: int, num_blocks: int, prompt_tokens: int, block_size: int, seed: int = 0):
    rng = random.Random(seed)
    hasher = BlockHasher(block_size)
    workers = [f"w{i}" for i in range(num_workers)]
    index = PrefixIndex()
    doc_blocks = 512
    docs = []
    while index.num_indexed_hashes < num_blocks:
        tokens = [rng.randrange(32000) for _ in range(doc_blocks * block_size)]
        hashes = hasher(tokens)
        docs.append(tokens)
        for w in rng.sample(workers, rng.randint(1, 3)):
            n = rng.randint(1, doc_blocks)
            index.apply(BlockStored(w, tuple(hashes[:n]), None))
    prompt = docs[0][:prompt_tokens]
    full = hasher(prompt)
    for i, w in enumerate(workers):  # w0 holds the whole prompt, the others ever shorter prefixes
        index.apply(BlockStored(w, tuple(full[: len(full) * (num_workers - i) // num_workers]), None))
    loads = LoadTracker()
    for i, w in enumerate(workers):
        loads.dispatch(f"r{i}", w, num_prefill_tokens=rng.randrange(0, 20000), num_kv_blocks=rng.randrange(0, 2000))
    return hasher, index, loads, workers, prompt


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    hasher, index, loads, workers, prompt = build(args.workers, args.blocks, args.prompt_tokens, args.block_size)
    policy = CacheAwarePolicy(args.block_size)
    print(f"index: {len(index.workers)} workers, {index.num_indexed_hashes} distinct blocks, "
          f"{sum(index.num_blocks(w) for w in workers)} (worker, block) entries; "
          f"built in {time.perf_counter() - t0:.1f} s")
    parts: dict[str, list[float]] = {"hash": [], "match": [], "cost": [], "total": []}
    wall_us: list[float] = []
    clock, wall = time.thread_time, time.perf_counter
    for _ in range(args.iters):
        w0 = wall()
        a = clock()
        hashes = hasher(prompt)
        b = clock()
        overlap = index.match(hashes)
        c = clock()
        decision = policy.choose(Role.PREFILL, workers, len(prompt), overlap, loads.estimates(workers))
        d = clock()
        wall_us.append((wall() - w0) * 1e6)
        for k, v in (("hash", b - a), ("match", c - b), ("cost", d - c), ("total", d - a)):
            parts[k].append(v * 1e6)
    assert overlap[workers[0]].total == len(hashes), "the prompt must be fully matched on w0"
    print(f"prompt {len(prompt)} tokens = {len(hashes)} blocks; chose {decision.worker} "
          f"(overlap {decision.overlap_blocks} blocks); {args.iters} iterations")
    print("thread CPU time (excludes time the OS ran other processes):")
    for k, v in parts.items():
        print(f"{k:>6}: p50 {pct(v, 0.5):8.1f} us   p99 {pct(v, 0.99):8.1f} us   "
              f"mean {statistics.fmean(v):8.1f} us   max {max(v):8.1f} us")
    print(f"wall time, total: p50 {pct(wall_us, 0.5):.1f} us   p99 {pct(wall_us, 0.99):.1f} us   "
          f"(on a shared machine the wall p99 is the OS scheduler's)")
    print(f"p99_us: cpu {pct(parts['total'], 0.99):.1f}  wall {pct(wall_us, 0.99):.1f}")


if __name__ == "__main__":
    main()
