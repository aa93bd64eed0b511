"""Prefix-aware routing on a real cluster: prefill tokens computed with `cache_aware` vs `round_robin`.

    make bench-routing          # python -m bench.routing.live [--prefill 2] [--users 12] [--systems 8]

Workload (the shape of the anchors' shared-prefix benchmarks): `--systems` long system prompts
(`--system-tokens` each), `--users` users per system prompt, each request = system prompt + a
user-specific question (`--user-tokens`), shuffled, sent `--concurrency` at a time. For each policy a
fresh cluster (same Ray, cold caches, `--prefill` prefill workers + 1 decode worker, tiny model) serves
the whole workload through the router's ClusterBackend (real actors, NIXL handoffs). We read back
from the workers how many prompt tokens each prefill worker actually computed (engine stats), and
how many requests each received. Each prefill worker's cache holds `--prefill-blocks` blocks, about
half the system prompts: the regime where placement matters (with room for every prompt everywhere,
round-robin only pays each prompt once per worker).

Prints per policy: computed prefill tokens, per-worker request counts, imbalance = max/mean requests
per prefill worker; then `ratio: <cache_aware/round_robin computed prefill tokens>` (target <= 1/3).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import tempfile


def build_workload(systems: int, users: int, system_tokens: int, user_tokens: int, vocab: int,
                   seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(system_tokens)] for _ in range(systems)]
    requests = [p + [rng.randrange(3, vocab) for _ in range(user_tokens)] for p in prompts for _ in range(users)]
    rng.shuffle(requests)
    return requests


async def run_policy(model: str, policy: str, workload: list[list[int]], args) -> dict:
    from bench.cluster_run import prefill_stats, serve_workload
    from engine.request import SamplingParams

    run = await serve_workload({
        "model": model, "engine.num_blocks": 1024, "prefill.num_blocks": args.prefill_blocks,
        "prefill.num_workers": args.prefill,
        "decode.num_workers": 1, "prefill.num_cpus": 0.5, "decode.num_cpus": 0.5, "router.grpc_port": None,
        "router.prefill_policy": policy, "router.local_prefill_max_tokens": 0},
        workload, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True), args.concurrency, policy)
    prefill = {s["worker_id"]: s for s in prefill_stats(run.stats)}
    requests = {w: s["num_handoffs"] + s["num_finished"] for w, s in prefill.items()}
    mean = sum(requests.values()) / len(requests)
    return {"policy": policy, "computed": sum(s["num_computed_tokens"] for s in prefill.values()),
            "prompt_tokens": sum(len(r) for r in workload), "requests": requests,
            "imbalance": max(requests.values()) / mean if mean else 0.0, "elapsed_s": run.elapsed_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--system-tokens", type=int, default=384)
    ap.add_argument("--user-tokens", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prefill-blocks", type=int, default=128,
                    help="KV blocks per prefill worker (128 x 16 tokens: ~4 system prompts stay cached)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from bench.cluster_run import init_ray  # first: it sets RAY_AUTH_MODE before ray is imported

    # isort: split
    import ray

    from engine.loading.tiny import make_tiny_model

    model = str(make_tiny_model(tempfile.mkdtemp(prefix="duet-bench-routing-"), arch="llama"))
    workload = build_workload(args.systems, args.users, args.system_tokens, args.user_tokens, 500, args.seed)
    init_ray(args.prefill + 1)
    print(f"workload: {len(workload)} requests = {args.systems} system prompts x {args.users} users, "
          f"{args.system_tokens}+{args.user_tokens} prompt tokens each; {args.prefill} prefill workers, 1 decode")
    results = {}
    try:
        for policy in ("round_robin", "cache_aware"):
            r = results[policy] = asyncio.run(run_policy(model, policy, workload, args))
            print(f"{policy:>12}: computed prefill tokens {r['computed']:>7} of {r['prompt_tokens']} prompt tokens; "
                  f"requests per prefill worker {sorted(r['requests'].values())}, imbalance (max/mean) "
                  f"{r['imbalance']:.2f}; {r['elapsed_s']:.1f} s")
    finally:
        ray.shutdown()
    ideal = args.systems * args.system_tokens + len(workload) * args.user_tokens
    print(f"ideal (each system prompt computed once): {ideal}")
    print(f"ratio: {results['cache_aware']['computed'] / results['round_robin']['computed']:.3f}")


if __name__ == "__main__":
    main()
