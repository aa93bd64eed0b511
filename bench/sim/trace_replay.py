"""Routing study: replay the Mooncake conversation trace against the real PrefixIndex, policies, LoadTracker
and one real engine BlockPool per worker — no model.

    python -m bench.sim.trace_replay [--limit N] [--workers W] [--capacity-blocks C] [--alphas 0.5,1,2]

Scaling. Each trace ``hash_id`` (a 512-token prefix block) becomes one block of B=16 synthetic token ids,
``hash_id * B + j + 1`` (deterministic, distinct per id); block hashes are the real chained hashes of
engine.kv.hashing.BlockHasher, so the index and pools see exactly the trace's sharing structure. A trace
block that is partial (the prompt's last) is treated as a full block for caching; timing uses the
request's real ``input_length``.

Service model (a pool of prefill workers, as in disaggregated serving). Requests arrive at the trace's
timestamps. Each worker runs its queue FIFO, one prefill at a time. When a request starts, the worker's
BlockPool does ``match_prefix`` (hits counted here, against the pool's real state at that moment) +
``touch`` + ``allocate``; the prefill takes ``max(1, input_length - 512 * hit_blocks) / R`` seconds
(R = ``--prefill-tokens-per-s`` in the trace's full-size tokens); at its end the new blocks are
``cache_full_blocks``-ed (so the BlockStored events appear when the KV exists) and all of the request's
blocks are freed tail-first (the KV has been handed to a decode worker; it stays cached until evicted).
Pool events flow into the index before every routing decision. The router's LoadTracker counts the
predicted uncached prefill tokens dispatched to each worker until the prefill ends.

Reported per policy: block-hit rate (cached prompt blocks / prompt blocks), load imbalance (max / mean
per-worker prompt tokens assigned, and of uncached tokens actually computed), and the simulated
prefill-only time to first token (queueing + compute). References: ``oracle`` = one infinite cache shared
by all (a block hits if any earlier request had it); ``pooled_lru`` = one LRU BlockPool of W*C blocks
shared by all (what perfect placement could do with the same total memory, no timing).
The last line is ``ratio: <cache_aware hit rate / round_robin hit rate>``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from bench.workloads import TRACE, TRACE_BLOCK_TOKENS
from engine.kv.block_pool import Block, BlockPool
from engine.kv.hashing import BlockHasher
from router.routing.index import PrefixIndex
from router.routing.load import LoadTracker
from router.routing.policy import DEFAULT_ALPHA, NO_PEER_FETCH, POLICIES, CacheAwarePolicy, Role, RoutingPolicy, route


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int  # full-size trace tokens
    hash_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]  # chained hashes of the synthetic blocks


def load_trace(path: Path = TRACE, limit: int | None = None, block_size: int = 16) -> list[TraceRequest]:
    hasher = BlockHasher(block_size)
    out = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            rec = json.loads(line)
            ids = tuple(rec["hash_ids"])
            out.append(TraceRequest(rec["timestamp"] / 1000.0, rec["input_length"], ids,
                                    tuple(hasher(synthetic_tokens(ids, block_size)))))
    return out


def synthetic_tokens(hash_ids: tuple[int, ...], block_size: int) -> list[int]:
    return [h * block_size + j + 1 for h in hash_ids for j in range(block_size)]


def acquire(pool: BlockPool, block_hashes, tokens: list[int], block_size: int) -> tuple[list[Block], list[Block]]:
    """Start of a prefill: take the cached prefix (``hits``) and fresh blocks for the rest (``new``)."""
    hits = pool.match_prefix(block_hashes, tokens, block_size)
    pool.touch(hits)
    return hits, pool.allocate(len(block_hashes) - len(hits))


def release(pool: BlockPool, hits: list[Block], new: list[Block], block_hashes, tokens: list[int],
            block_size: int) -> None:
    """End of a prefill: register the computed blocks for reuse, then free everything tail-first."""
    n_hit = len(hits)
    parent = block_hashes[n_hit - 1] if n_hit else None
    pool.cache_full_blocks(new, block_hashes[n_hit:], tokens, block_size, n_hit, parent)
    pool.free_blocks(reversed(hits + new))


@dataclass
class _Running:
    rid: int
    req: TraceRequest
    tokens: list[int]
    hits: list[Block]
    new: list[Block]
    finish_s: float


@dataclass
class SimWorker:
    name: str
    pool: BlockPool
    block_size: int
    tokens_per_s: float
    queue: deque = field(default_factory=deque)
    current: _Running | None = None
    clock_s: float = 0.0
    prompt_tokens: int = 0  # assigned, full-size
    computed_tokens: int = 0  # uncached, full-size

    def advance(self, now_s: float, on_start, on_finish) -> None:
        """Run the queue up to ``now_s``: finish what ends by then, start what can start by then."""
        while True:
            if self.current is not None:
                if self.current.finish_s > now_s:
                    return
                self._finish(on_finish)
            if not self.queue:
                return
            self._start(*self.queue.popleft(), on_start)

    def _start(self, rid: int, req: TraceRequest, on_start) -> None:
        tokens = synthetic_tokens(req.hash_ids, self.block_size)
        hits, new = acquire(self.pool, req.block_hashes, tokens, self.block_size)
        uncached = max(1, req.input_length - TRACE_BLOCK_TOKENS * len(hits))
        start_s = max(self.clock_s, req.arrival_s)
        self.current = _Running(rid, req, tokens, hits, new, start_s + uncached / self.tokens_per_s)
        self.prompt_tokens += req.input_length
        self.computed_tokens += uncached
        on_start(rid, len(hits))

    def _finish(self, on_finish) -> None:
        run, self.current = self.current, None
        release(self.pool, run.hits, run.new, run.req.block_hashes, run.tokens, self.block_size)
        self.clock_s = run.finish_s
        on_finish(run.rid, self.name, run.finish_s - run.req.arrival_s)


@dataclass
class SimResult:
    policy: str
    hit_blocks: int
    total_blocks: int
    worker_prompt_tokens: list[int]
    worker_computed_tokens: list[int]
    ttft_s: list[float]
    wall_s: float
    pools: list[BlockPool]

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks

    @staticmethod
    def _imbalance(xs: list[int]) -> float:
        mean = sum(xs) / len(xs)
        return max(xs) / mean if mean else 1.0

    @property
    def imbalance_prompt(self) -> float:
        return self._imbalance(self.worker_prompt_tokens)

    @property
    def imbalance_computed(self) -> float:
        return self._imbalance(self.worker_computed_tokens)


def simulate(reqs: list[TraceRequest], policy: RoutingPolicy, num_workers: int, capacity_blocks: int,
             block_size: int = 16, prefill_tokens_per_s: float = 8000.0) -> SimResult:
    t0 = time.perf_counter()
    names = [f"w{i}" for i in range(num_workers)]
    workers = [SimWorker(n, BlockPool(capacity_blocks, worker_id=n), block_size, prefill_tokens_per_s)
               for n in names]
    by_name = {w.name: w for w in workers}
    index, tracker = PrefixIndex(), LoadTracker()
    for n in names:
        index.add_worker(n)
        tracker.add_worker(n)
    hit_blocks = 0
    ttft: list[float] = []

    def on_start(rid: int, n_hit: int) -> None:
        nonlocal hit_blocks
        hit_blocks += n_hit

    def on_finish(rid: int, worker: str, ttft_s: float) -> None:
        tracker.finish(str(rid), worker)
        ttft.append(ttft_s)

    def advance(now_s: float) -> None:
        for w in workers:
            w.advance(now_s, on_start, on_finish)
            index.apply_all(w.pool.take_events())

    for rid, req in enumerate(reqs):
        if len(req.block_hashes) > capacity_blocks:
            raise ValueError(f"request {rid} needs {len(req.block_hashes)} blocks > capacity {capacity_blocks}")
        advance(req.arrival_s)
        num_tokens = len(req.block_hashes) * block_size
        decision = route(policy, index, tracker, Role.PREFILL, names, req.block_hashes, num_tokens)
        tracker.dispatch(str(rid), decision.worker, num_prefill_tokens=decision.uncached_prefill_tokens,
                         num_kv_blocks=len(req.block_hashes))
        by_name[decision.worker].queue.append((rid, req))
    advance(float("inf"))
    return SimResult(policy.name, hit_blocks, sum(len(r.block_hashes) for r in reqs),
                     [w.prompt_tokens for w in workers], [w.computed_tokens for w in workers], ttft,
                     time.perf_counter() - t0, [w.pool for w in workers])


def oracle_hit_blocks(reqs: list[TraceRequest]) -> int:
    """Infinite cache shared by everyone: a block hits if any earlier request had it (chained hashes make
    the hits a leading run)."""
    seen: set[int] = set()
    hits = 0
    for r in reqs:
        hits += sum(1 for h in r.block_hashes if h in seen)
        seen.update(r.block_hashes)
    return hits


def pooled_lru_hit_blocks(reqs: list[TraceRequest], capacity_blocks: int, block_size: int = 16) -> int:
    """One LRU BlockPool of ``capacity_blocks`` serving every request in arrival order."""
    pool = BlockPool(capacity_blocks)
    hits = 0
    for r in reqs:
        tokens = synthetic_tokens(r.hash_ids, block_size)
        hit, new = acquire(pool, r.block_hashes, tokens, block_size)
        release(pool, hit, new, r.block_hashes, tokens, block_size)
        hits += len(hit)
    return hits


def _row(name: str, hit_rate: float, oracle_rate: float, res: SimResult | None) -> str:
    if res is None:
        return f"| {name:<22} | {hit_rate:6.3f} | {hit_rate / oracle_rate:5.2f} |     - |     - |      - |      - |"
    ttft = sorted(res.ttft_s)
    p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
    return (f"| {name:<22} | {hit_rate:6.3f} | {hit_rate / oracle_rate:5.2f} | {res.imbalance_prompt:5.2f} "
            f"| {res.imbalance_computed:5.2f} | {statistics.fmean(ttft):6.2f} | {p99:6.2f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--capacity-blocks", type=int, default=4096, help="per worker, in (trace) blocks")
    ap.add_argument("--block-size", type=int, default=16, help="synthetic tokens per trace block")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=8000.0, help="per worker, full-size tokens")
    ap.add_argument("--alpha", type=float, default=DEFAULT_ALPHA)
    ap.add_argument("--alphas", default="", help="comma-separated alphas for an extra cache_aware sweep")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    reqs = load_trace(args.trace, args.limit, args.block_size)
    total = sum(len(r.block_hashes) for r in reqs)
    span_s = reqs[-1].arrival_s - reqs[0].arrival_s
    offered = sum(r.input_length for r in reqs) / max(span_s, 1e-9) / (args.workers * args.prefill_tokens_per_s)
    print(f"trace: {len(reqs)} requests, {total} prompt blocks, {len(set(h for r in reqs for h in r.hash_ids))} "
          f"distinct; span {span_s:.0f} s; load {time.perf_counter() - t0:.1f} s")
    print(f"workers W={args.workers}, capacity C={args.capacity_blocks} blocks/worker "
          f"(W*C={args.workers * args.capacity_blocks}), R={args.prefill_tokens_per_s:.0f} tok/s/worker, "
          f"offered prefill load with no cache hits = {offered:.2f} of capacity")
    oracle = oracle_hit_blocks(reqs) / total
    pooled = pooled_lru_hit_blocks(reqs, args.workers * args.capacity_blocks, args.block_size) / total
    print("| policy                 | hit    | /orac | imb_p | imb_c | ttft_s | p99_s  |")
    print("|------------------------|--------|-------|-------|-------|--------|--------|")
    print(_row("oracle (infinite)", oracle, oracle, None))
    print(_row("pooled_lru (W*C)", pooled, oracle, None))
    results: dict[str, SimResult] = {}
    # the simulated workers have one tier and compute what they lack (no peer fetch): NO_PEER_FETCH
    runs = [(f"cache_aware a={args.alpha:g}", CacheAwarePolicy(args.block_size, args.alpha, NO_PEER_FETCH))]
    runs += [(n, POLICIES[n](args.block_size)) for n in ("least_loaded", "round_robin")]
    runs += [(f"cache_aware a={float(a):g}", CacheAwarePolicy(args.block_size, float(a), NO_PEER_FETCH))
             for a in args.alphas.split(",") if a and float(a) != args.alpha]
    for label, policy in runs:
        res = simulate(reqs, policy, args.workers, args.capacity_blocks, args.block_size, args.prefill_tokens_per_s)
        results[label] = res
        print(_row(label, res.hit_rate, oracle, res), f"({res.wall_s:.1f} s)")
    ca = results[runs[0][0]].hit_rate
    rr = results["round_robin"].hit_rate
    print(f"cache_aware/oracle: {ca / oracle:.3f}  total {time.perf_counter() - t0:.1f} s")
    print(f"ratio: {ca / rr:.2f}")


if __name__ == "__main__":
    main()
