"""Serve a token-id workload on a fresh real cluster and read back what the workers did: the shared part of
the real-cluster benchmarks (bench/routing/live.py, bench/kv/tiers_cluster.py) and their tests.

    init_ray(num_workers)                      # one local Ray for the whole benchmark (or let Cluster start one)
    run = asyncio.run(serve_workload(overrides, prompts, params, concurrency=8, tag="rr"))
    run.outputs[i], run.ttft_s[i], run.elapsed_s, prefill_stats(run.stats)

A run starts a `cluster.launcher.Cluster` from `ClusterConfig.load(None, overrides)` (real Ray actors,
NIXL handoffs, the router's ClusterBackend), sends every prompt through `ClusterBackend.generate` with at
most `concurrency` in flight, in list order, records each request's output token ids and its time to first
output (TTFT: from the call to the first yielded output), reads every worker's `stats()` once the last
request has finished, and stops the cluster. A request that ends with an error fails the run.
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@dataclass
class ServedRun:
    outputs: list[list[int]]  # output token ids per prompt, in the workload's order
    ttft_s: list[float]  # per prompt: from the generate call to its first output
    elapsed_s: float  # first send to last completion
    stats: list[dict]  # every worker's stats() after the run


def init_ray(num_workers: int) -> None:
    """A local Ray with room for ``num_workers`` CPU workers (each asks for one unit of ``duet_worker``)."""
    import ray

    from cluster.spawn import WORKER_RESOURCE

    # address="local": a Ray of its own even when another one runs on this machine (``None`` would join that one,
    # whose resources it cannot declare)
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 4), resources={WORKER_RESOURCE: num_workers},
             include_dashboard=False, log_to_driver=False)


async def serve_workload(overrides: dict, prompts: list[list[int]], params, concurrency: int,
                         tag: str) -> ServedRun:
    """Serve ``prompts`` (token ids; ``params`` one SamplingParams or one per prompt) on a fresh cluster."""
    from cluster.config import ClusterConfig
    from cluster.launcher import Cluster

    params_list = params if isinstance(params, list) else [params] * len(prompts)
    cluster = await Cluster.start(ClusterConfig.load(None, overrides))
    try:
        sem = asyncio.Semaphore(concurrency)
        outputs: list[list[int]] = [[] for _ in prompts]
        ttft_s = [0.0] * len(prompts)

        async def one(i: int) -> None:
            async with sem:
                t0 = time.perf_counter()
                async for out in cluster.backend.generate(f"{tag}-{i}", prompts[i], params_list[i]):
                    if out.error:
                        raise RuntimeError(f"request {tag}-{i} failed: {out.error}")
                    if not outputs[i] and not ttft_s[i]:
                        ttft_s[i] = time.perf_counter() - t0
                    outputs[i] += out.new_token_ids

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        elapsed = time.perf_counter() - t0
        stats = await cluster.stats()
    finally:
        await cluster.stop()
    return ServedRun(outputs, ttft_s, elapsed, stats)


def prefill_stats(stats: list[dict]) -> list[dict]:
    return [s for s in stats if s["role"] == "prefill"]
