"""Role flip vs cold start (issue 24): how long a worker takes to join the other pool in place, against a new one.

    python -m bench.cluster.role_flip [--tiny] [--repeats 3]      (make bench-flip)

Starts a real cluster (Ray actors, NIXL; SmolLM2-135M by default, `--tiny`: the tiny random Llama) with 2 prefill
+ 1 decode workers, serves a few requests so the workers are warm, then alternates, ``--repeats`` times:
- a cold start: the decode target +1 through the admin path (a new actor: spawn, model load, NIXL
  registration, handshake, ready), then −1 (a drain);
- two flips, as the autoscaler's rebalancing asks for them (prefill −1 and decode +1 in one tick, then back):
  a prefill worker drained, flipped to decode in place and made ready there, then one flipped back.
Each cold start is timed by the pool manager from the spawn to ready (``cold_start_s``); each flip from the
worker idle to ready in its new role (``flip_s``; the drain wait before it, ``drain_s``, is printed apart:
it depends on the requests the worker holds, here none). Medians are printed; the last line is
``ratio: <flip_s / cold_start_s>`` (the baseline: starting a new worker).
"""
from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time

from bench.cluster_run import init_ray

MACHINE = f"{platform.node()} {platform.processor() or platform.machine()}"


async def wait_until(predicate, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the pools did not settle")
        await asyncio.sleep(0.05)


def settled(cluster, n_prefill: int, n_decode: int) -> bool:
    from router.routing.policy import Role
    from router.workers.registry import WorkerState

    reg = cluster.registry
    return (len(reg.ready(Role.PREFILL)) == n_prefill and len(reg.ready(Role.DECODE)) == n_decode
            and not reg.records(states=(WorkerState.DRAINING, WorkerState.STARTING)))


async def warm(cluster, n: int = 6) -> None:
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i in range(n):
        stream = cluster.backend.generate(f"warm-{time.monotonic_ns()}-{i}", list(range(10, 60 + i)), params)
        outputs = [out async for out in stream]  # the warm-up request must finish normally
        last = outputs[-1] if outputs else None
        if last is None or last.finish_reason != "length":
            raise RuntimeError(f"warm-up request {i} did not finish: {last}")


async def run(model: str, repeats: int) -> dict:
    from cluster.config import ClusterConfig
    from cluster.launcher import Cluster
    from router.routing.policy import Role

    config = ClusterConfig.load(None, {
        "model": model, "prefill.num_workers": 2, "decode.num_workers": 1, "router.grpc_port": None,
        "router.local_prefill_max_tokens": 0, "prefill.num_cpus": 0.5, "decode.num_cpus": 0.5,
        "prefill.torch_threads": 1, "decode.torch_threads": 1, "engine.num_blocks": 512})
    cluster = await Cluster.start(config)
    pools = cluster.pools
    try:
        await warm(cluster)
        for _ in range(repeats):
            pools.set_target(Role.DECODE, 2)  # cold start
            await wait_until(lambda: settled(cluster, 2, 2))
            pools.set_target(Role.DECODE, 1)
            await wait_until(lambda: settled(cluster, 2, 1))
            await warm(cluster, 2)
            for p, d in ((1, 2), (2, 1)):  # flip prefill -> decode, then back, as the autoscaler asks
                pools.targets[Role.PREFILL], pools.targets[Role.DECODE] = p, d
                pools.reconcile()
                await wait_until(lambda: settled(cluster, p, d))
                await warm(cluster, 2)
        view = pools.autoscaler_view()
    finally:
        await cluster.stop()
    if view["counters"].get("flip_fallbacks") or view["counters"].get("flip_failures"):
        raise RuntimeError(f"a flip did not happen: {view['counters']}")
    return view


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny random Llama instead of SmolLM2-135M")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.tiny:
        from bench.engine.throughput import make_bench_tiny_model

        model = make_bench_tiny_model()
    else:
        from engine.loading.default_model import default_model_path

        model = str(default_model_path())
    init_ray(4)
    view = asyncio.run(run(model, args.repeats))
    print(f"machine: {MACHINE}; model: {model}")
    print("\n".join(report(view["role_flip"])))


def report(view: dict) -> list[str]:
    """The printed lines from the pool manager's ``role_flip`` view; the last is the ratio."""
    cold = [c["cold_start_s"] for c in view["cold_starts"]]
    flips = view["flips"]
    lines = [f"cold start (spawn -> ready): median {statistics.median(cold):.2f} s of {len(cold)}: "
             + ", ".join(f"{s:.2f}" for s in cold)]
    for src, dst in (("prefill", "decode"), ("decode", "prefill")):
        these = [f["flip_s"] for f in flips if f["from"] == src and f["to"] == dst]
        lines.append(f"flip {src} -> {dst} (idle -> ready): median {statistics.median(these):.3f} s of {len(these)}: "
                     + ", ".join(f"{s:.3f}" for s in these))
    lines.append(f"drain wait before a flip (no requests held): median "
                 f"{statistics.median(f['drain_s'] for f in flips):.2f} s")
    lines.append(f"ratio: {statistics.median(f['flip_s'] for f in flips) / statistics.median(cold):.3f} "
                 "(flip idle -> ready / cold start of a new worker spawn -> ready, medians)")
    return lines

if __name__ == "__main__":
    main()
