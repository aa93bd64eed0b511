"""Router decision cost with KV tiers at cluster scale: 64 workers x 3 tiers, ~10M indexed (worker, tier,
block) entries, built through the router's real event path. Target: ``route()`` p99 < 1 ms on one core.

    python -m bench.routing.decision_cost_tiers [--workers W] [--entries N] [--iters I] [--no-baseline]

What a worker holds. Documents are chains of 128-1,024 blocks (one of 8 shared 32-block system prompts,
then blocks of their own); each worker serves documents drawn by popularity (Zipf, s = 1) until its
disk tier is full. Tiers are written through and LRU: the disk holds the most recent ``disk`` blocks of
the documents it served, the host the most recent ``host``, the device the most recent ``device``
(capacities in the ratio --tier-ratio, device:host:disk, of entries / workers). Block hashes are random
64-bit ints (a chained hash names its prefix; nothing here needs the tokens), one per (document, block).

Phases, each timed on its own:
  1. build: per worker, one encoded ``EventBatch`` per document (its BlockStored events for the tiers it
     sits on, plus the worker's load report with ``TierUsage``), applied through
     ``IndexFeed.apply_batch`` (decode + seq checks + tier checks + index); encoding is the workers' work
     and is not timed. Reported per second of thread CPU time (what a router with a core of its own would
     see): (worker, tier, block) entries/s, batches/s and events/s.
  2. churn (after the decisions): steady-state batches on the full index (a worker stores a new
     conversation on every tier and evicts its oldest document from each), events/s and blocks/s.
  3. memory: RSS growth while the index was built (each configuration lives in a forked process of its
     own, so the figures are not each other's leftovers), and the index's containers alone (its dict and
     per-worker sets, ``sys.getsizeof``, without the int objects they hold), per entry; and what the index
     adds to a full ``gc.collect()`` (the per-worker sets are containers the collector traverses).
  4. decisions: ``route()`` (index.match + loads + CacheAwarePolicy over all workers) on prompts of 2k-16k
     tokens (B = 16): a prefix of a served document (popular ones more often) then new blocks; a share are
     complete misses. Thread CPU time per decision: p50 / p99 / max, also per part, and wall p50 / p99.
     Hashing the prompt (BlockHasher) is the front door's, measured apart.
  5. baseline (unless --no-baseline): the same number of entries all on the device tier, the same
     prompts. Both indexes stay built (two processes) and their decision passes alternate (--passes);
     each side's best pass is reported, and ``ratio:`` = tiered p99 / device-only p99 (what tiers cost a
     decision at equal entries), as docs/benchmarks.md compares noisy runs.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import multiprocessing
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from engine.kv.events import TIERS, BlockRemoved, BlockStored, Tier, TierUsage, WorkerLoad
from engine.kv.hashing import BlockHasher
from proto.kv_codec import encode_batch
from router.routing.feed import IndexFeed
from router.routing.index import PrefixIndex
from router.routing.load import LoadTracker
from router.routing.policy import CacheAwarePolicy, Role, route

TARGET_P99_US = 1000.0
SYSTEM_PROMPTS, SYSTEM_BLOCKS = 8, 32


@dataclass
class Placement:
    """One worker's documents, oldest first, and how many leading blocks of each sit on each tier."""
    docs: list[int]
    blocks: dict[Tier, list[int]]  # tier -> per doc (aligned with docs), leading blocks on that tier


def make_docs(rng: random.Random, num_docs: int) -> list[list[int]]:
    systems = [[rng.getrandbits(64) for _ in range(SYSTEM_BLOCKS)] for _ in range(SYSTEM_PROMPTS)]
    return [systems[d % SYSTEM_PROMPTS] + [rng.getrandbits(64) for _ in range(rng.randint(128, 1024) - SYSTEM_BLOCKS)]
            for d in range(num_docs)]


def zipf_cum_weights(n: int) -> list[float]:
    return list(itertools.accumulate(1.0 / (d + 1) for d in range(n)))


def place(rng: random.Random, docs: list[list[int]], capacity: dict[Tier, int]) -> Placement:
    """Serve documents by popularity until the largest tier is full; each tier keeps the most recent."""
    cum = zipf_cum_weights(len(docs))
    largest = max(capacity.values())
    served, seen, total = [], set(), 0
    while total < largest:
        for d in rng.choices(range(len(docs)), cum_weights=cum, k=64):
            if d not in seen and total < largest:
                seen.add(d)
                served.append(d)
                total += len(docs[d])
    blocks = {}
    for tier, cap in capacity.items():
        left, per_doc = cap, [0] * len(served)
        for j in range(len(served) - 1, -1, -1):  # the most recent first
            per_doc[j] = min(left, len(docs[served[j]]))
            left -= per_doc[j]
        blocks[tier] = per_doc
    return Placement(served, blocks)


def worker_batches(worker: str, p: Placement, docs: list[list[int]], capacity: dict[Tier, int]) -> list[bytes]:
    tiers = tuple(TierUsage(t, capacity[t], capacity[t]) for t in TIERS if t != Tier.DEVICE and t in capacity)
    load = WorkerLoad(worker, "prefill", 0, 0, capacity.get(Tier.DEVICE, 0), capacity.get(Tier.DEVICE, 0), 0, tiers)
    out = []
    for j, d in enumerate(p.docs):
        events = [BlockStored(worker, tuple(docs[d][:p.blocks[t][j]]), None, t) for t in TIERS
                  if t in p.blocks and p.blocks[t][j]]
        out.append(encode_batch(worker, len(out) + 1, events, load, 0.0))
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def container_bytes(index: PrefixIndex) -> int:
    """The index's hash tables alone: its dict and the per-worker sets (not the int objects in them)."""
    return sys.getsizeof(index._mask_by_hash) + sum(map(sys.getsizeof, index._hashes_by_worker.values()))


def gc_pass_s() -> float:
    t0 = time.thread_time()
    gc.collect()
    return time.thread_time() - t0


def build(workers: list[str], docs, placements, capacity) -> tuple[IndexFeed, dict]:
    feed = IndexFeed(PrefixIndex(), LoadTracker())
    gc_before_s = gc_pass_s()
    rss0, apply_s, num_batches = rss_bytes(), 0.0, 0
    for w in workers:
        batches = worker_batches(w, placements[w], docs, capacity)
        t0 = time.thread_time()
        for data in batches:
            feed.apply_batch(data)
        apply_s += time.thread_time() - t0
        num_batches += len(batches)
    del batches
    gc_after_s = gc_pass_s()
    entries = feed.index.num_entries
    stats = {"apply_s": apply_s, "batches": num_batches, "events": feed.counters.events, "entries": entries,
             "rss_bytes": rss_bytes() - rss0, "distinct": feed.index.num_indexed_hashes,
             "gc_s": (gc_before_s, gc_after_s),
             "per_tier": {t: sum(feed.index.num_blocks(w, t) for w in workers) for t in TIERS}}
    assert feed.counters.unreported_tiers == 0 and feed.counters.gaps == 0
    return feed, stats


def churn(feed: IndexFeed, workers, docs, placements, capacity, rng: random.Random,
          num_batches: int) -> tuple[float, float]:
    """Steady state: a worker serves a new 256-block conversation (a shared system prompt, then blocks of its
    own), stores it on every tier and evicts its oldest document from each (that document's own blocks:
    the system prompt stays); returns (events/s, blocks in events/s) through apply_batch. Mutates docs and
    placements."""
    batches, num_events, num_blocks, seqs = [], 0, 0, {w: feed.last_seq(w) or 0 for w in workers}
    for _ in range(num_batches):
        w = rng.choice(workers)
        p = placements[w]
        new = docs[rng.randrange(SYSTEM_PROMPTS)][:SYSTEM_BLOCKS] + [rng.getrandbits(64) for _ in range(224)]
        docs.append(new)
        events = [BlockStored(w, tuple(new), None, t) for t in capacity]
        for t in capacity:
            j = next(j for j, n in enumerate(p.blocks[t]) if n)
            events.append(BlockRemoved(w, tuple(docs[p.docs[j]][SYSTEM_BLOCKS:p.blocks[t][j]]), t))
            p.blocks[t][j] = 0
        p.docs.append(len(docs) - 1)
        for t in capacity:
            p.blocks[t].append(len(new))
        seqs[w] += 1
        batches.append(encode_batch(w, seqs[w], events, None, 0.0))
        num_events += len(events)
        num_blocks += sum(len(e.block_hashes) for e in events)
    t0 = time.thread_time()
    for data in batches:
        feed.apply_batch(data)
    elapsed = time.thread_time() - t0
    assert feed.counters.gaps == 0
    return num_events / elapsed, num_blocks / elapsed


def make_prompts(rng: random.Random, docs, n: int) -> list[list[int]]:
    cum = zipf_cum_weights(len(docs))
    prompts = []
    for _ in range(n):
        num_blocks = rng.randint(128, 1024)  # 2k-16k tokens at B = 16
        if rng.random() < 0.1:  # a complete miss
            prompts.append([rng.getrandbits(64) for _ in range(num_blocks)])
            continue
        doc = docs[rng.choices(range(len(docs)), cum_weights=cum)[0]]
        held = min(num_blocks, len(doc), rng.randint(SYSTEM_BLOCKS, len(doc)))
        prompts.append(doc[:held] + [rng.getrandbits(64) for _ in range(num_blocks - held)])
    return prompts


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def setup_decisions(feed: IndexFeed, workers, rng: random.Random) -> None:
    """Some in-flight work on every worker, so that load terms differ."""
    for i, w in enumerate(workers):
        feed.tracker.dispatch(f"r{i}", w, num_prefill_tokens=rng.randrange(0, 20000),
                              num_kv_blocks=rng.randrange(0, 2000))


def decisions(feed: IndexFeed, workers, prompts, block_size: int) -> dict[str, Any]:
    """One pass over the prompts, timing route()'s three steps (index.match, loads.estimates, policy.choose:
    its whole body) per prompt; percentiles per part, in us of thread CPU time (wall apart)."""
    loads, index = feed.tracker, feed.index
    policy = CacheAwarePolicy(block_size)
    times: dict[str, list[float]] = {k: [] for k in ("route", "match", "loads", "choose", "wall")}
    hits, peers = [], 0
    clock, wall = time.thread_time, time.perf_counter
    for hashes in prompts:
        w0, a = wall(), clock()
        matches = index.match(hashes)
        b = clock()
        estimates = loads.estimates(workers)
        c = clock()
        d = policy.choose(Role.PREFILL, workers, len(hashes) * block_size, matches, estimates)
        e = clock()
        times["wall"].append((wall() - w0) * 1e6)
        for k, v in (("route", e - a), ("match", b - a), ("loads", c - b), ("choose", e - c)):
            times[k].append(v * 1e6)
        hits.append(max((c.overlap_blocks for c in d.costs), default=0))
        peers += d.peer is not None
    assert d == route(policy, index, loads, Role.PREFILL, workers, hashes, len(hashes) * block_size)
    out: dict[str, Any] = {k: (pct(v, 0.5), pct(v, 0.99), statistics.fmean(v), max(v)) for k, v in times.items()}
    out.update(hit_mean=statistics.fmean(hits), misses=sum(1 for h in hits if h == 0), peers=peers, n=len(prompts))
    return out


def report_build(label: str, stats: dict, num_workers: int) -> None:
    e = stats["entries"]
    print(f"[{label}] {num_workers} workers, {e:,} (worker, tier, block) entries, {stats['distinct']:,} distinct "
          f"blocks; per tier: " + ", ".join(f"{t.value} {n:,}" for t, n in stats["per_tier"].items()))
    print(f"[{label}] build: {stats['batches']:,} batches, {stats['events']:,} events in {stats['apply_s']:.1f} s CPU: "
          f"{e / stats['apply_s']:,.0f} entries/s ({stats['batches'] / stats['apply_s']:,.0f} batches/s, "
          f"{stats['events'] / stats['apply_s']:,.0f} events/s of {e / stats['events']:,.0f} blocks)")
    print(f"[{label}] memory: RSS +{stats['rss_bytes'] / 2**30:.2f} GiB ({stats['rss_bytes'] / e:.0f} B/entry); "
          f"of it hash tables {stats['table_bytes'] / 2**30:.2f} GiB ({stats['table_bytes'] / e:.0f} B/entry), "
          f"the rest int objects; a full GC pass: {stats['gc_s'][0] * 1e3:.0f} ms before the build, "
          f"{stats['gc_s'][1] * 1e3:.0f} ms after", flush=True)


def report_pass(label: str, r: dict[str, Any], num_workers: int, note: str = "") -> None:
    print(f"[{label}] {r['n']} decisions over {num_workers} candidates{note}; best match mean {r['hit_mean']:.0f} "
          f"blocks, {r['misses']} misses, {r['peers']} with a peer named")
    for k in ("route", "match", "loads", "choose", "wall"):
        p50, p99, mean, top = r[k]
        print(f"[{label}] {k:>6} us: p50 {p50:7.1f}  p99 {p99:7.1f}  mean {mean:7.1f}  max {top:8.1f}"
              + ("   (wall: includes the OS's other processes)" if k == "wall" else ""))


def serve(conn, label: str, args, docs, capacity: dict[Tier, int], prompts, seed: int) -> None:
    """One configuration, in a forked process of its own (a fresh heap for its memory figures): builds its
    index, then answers "pass" (a timed decision pass) and "churn" until "exit"."""
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(args.workers)]
    placements = {w: place(rng, docs, capacity) for w in workers}
    feed, stats = build(workers, docs, placements, capacity)
    stats["table_bytes"] = container_bytes(feed.index)
    report_build(label, stats, len(workers))
    setup_decisions(feed, workers, rng)
    conn.send("ready")
    while (cmd := conn.recv()) != "exit":
        if cmd == "pass":
            conn.send(decisions(feed, workers, prompts, args.block_size))
        elif cmd == "churn":
            conn.send(churn(feed, workers, docs, placements, capacity, rng, args.churn_batches))


class Server:
    def __init__(self, label: str, args, docs, capacity: dict[Tier, int], prompts, seed: int) -> None:
        ctx = multiprocessing.get_context("fork")
        self.label, self.conn = label, None
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, label, args, docs, capacity, prompts, seed), daemon=True)
        self.proc.start()
        if self.ask(None) != "ready":
            raise RuntimeError(f"the {label} configuration did not start")

    def ask(self, cmd: str | None):
        if cmd is not None:
            self.conn.send(cmd)
        if not self.conn.poll(3600):
            raise RuntimeError(f"{self.label}: no answer to {cmd!r}")
        try:
            return self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the {self.label} process died (exit code {self.proc.exitcode})") from None

    def close(self) -> None:
        self.conn.send("exit")
        self.proc.join(30)


def compare(servers: list[Server], passes: int, num_workers: int) -> dict[str, float]:
    """Alternate decision passes between the configurations; report and return each one's best p99."""
    results: dict[str, list[dict]] = {s.label: [] for s in servers}
    for _ in range(passes):
        for s in servers:
            results[s.label].append(s.ask("pass"))
    best = {}
    for s in servers:
        runs = results[s.label]
        print(f"[{s.label}] route() p99 per pass (us): " + ", ".join(f"{r['route'][1]:.0f}" for r in runs))
        top = min(runs, key=lambda r: r["route"][1])
        report_pass(s.label, top, num_workers, note=" (its best of the passes)")
        best[s.label] = top["route"][1]
    for s in servers:
        events_s, blocks_s = s.ask("churn")
        print(f"[{s.label}] churn on the full index, per CPU second: {events_s:,.0f} events, {blocks_s:,.0f} blocks "
              f"(stores and removals of 224-1,024 blocks)")
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--entries", type=int, default=10_000_000, help="(worker, tier, block) entries to index")
    ap.add_argument("--tier-ratio", default="1:2:7", help="device:host:disk capacity")
    ap.add_argument("--docs", type=int, default=6000)
    ap.add_argument("--iters", type=int, default=2000, help="decisions per pass")
    ap.add_argument("--passes", type=int, default=3, help="decision passes per configuration, alternated")
    ap.add_argument("--churn-batches", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    docs = make_docs(rng, args.docs)
    prompts = make_prompts(rng, docs, args.iters)
    ratio = [float(x) for x in args.tier_ratio.split(":")]
    per_worker = args.entries / args.workers
    capacity = {t: int(per_worker * r / sum(ratio)) for t, r in zip(TIERS, ratio)}
    print(f"{args.workers} workers; per worker " + ", ".join(f"{t.value} {n:,}" for t, n in capacity.items())
          + f" blocks; {len(docs):,} documents of {sum(map(len, docs)):,} blocks "
          f"({time.perf_counter() - t0:.1f} s to generate)")
    hasher = BlockHasher(args.block_size)
    tokens = [rng.randrange(32000) for _ in range(16384)]
    hash_us = []
    for _ in range(50):
        a = time.thread_time()
        hasher(tokens)
        hash_us.append((time.thread_time() - a) * 1e6)
    print(f"front door, BlockHasher on a 16,384-token prompt: p50 {pct(hash_us, 0.5):.0f} us (not part of route())")
    sys.stdout.flush()  # before forking: the children inherit the buffer
    configs = [("tiers", capacity)] + ([] if args.no_baseline else [("device-only", {Tier.DEVICE: sum(capacity.values())})])
    servers = []
    try:
        for label, cap in configs:  # built one after the other: each build has the CPU to itself
            servers.append(Server(label, args, docs, cap, prompts, args.seed + 1))
        best = compare(servers, args.passes, args.workers)
    finally:
        for s in servers:
            s.close()
    tiers_p99 = best["tiers"]
    if args.no_baseline:
        print(f"ratio: {tiers_p99 / TARGET_P99_US:.2f} (route() p99 / the {TARGET_P99_US:.0f} us target)")
        return
    print(f"route() p99: tiers {tiers_p99:.0f} us, device-only {best['device-only']:.0f} us; target "
          f"{TARGET_P99_US:.0f} us ({tiers_p99 / TARGET_P99_US:.2f} of it)")
    print(f"ratio: {tiers_p99 / best['device-only']:.2f} (route() p99, tiers / device-only at equal entries)")


if __name__ == "__main__":
    main()
