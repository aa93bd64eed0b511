"""KV tiers on a real cluster: prefill tokens computed and TTFT with a host tier vs without (issue 23, must-show 2).

    make bench-tiers [SMALL=1]     # python -m bench.kv.tiers_cluster [--small] [--tiny] [--repeats N] ...

Workload (shared prefixes revisited after the device tier has forgotten them): ``--prefixes`` long prompts
(system prompts / documents of ``--prefix-tokens``), each visited ``--visits`` times; every visit appends its
own ``--suffix-tokens`` question. Visits go in rounds: each round visits every prefix once, in a seeded
shuffled order, so between two visits of a prefix most other prefixes pass through the cache. Greedy, EOS
ignored, ``--max-tokens`` out, ``--concurrency`` in flight. Model: SmolLM2-135M-Instruct (its GGUF, fp32),
whose prefill costs enough for TTFT to show it; ``--tiny`` / ``--small``: the generated tiny Llama.

Cluster (bench/cluster_run.py: Ray actors, NIXL handoffs, the router's ClusterBackend, a fresh cluster per
run): 1 prefill + 1 decode worker, one torch thread each, every request disaggregated. The prefill worker's
device tier (its paged cache, ``prefill.num_blocks``) holds ``--device-fraction`` (1/4) of the prefixes'
blocks, and the workload is served twice: tiers off, then tiers on (``engine.kv_host_bytes`` sized for
every block of the workload, prefixes and questions, so nothing is evicted from the host); ``--repeats``
such pairs. The decode worker gets the same engine section (its own host tier in the tiers-on run); it
receives KV over NIXL and computes no prompt, so every figure here is read from the prefill worker's
``stats()``: ``num_computed_tokens`` (prompt tokens its steps computed), ``prefix_cache_hit_tokens`` (device
hits) and ``kv_tiers`` (blocks loaded back, bytes, failures).

Prints, per run: prompt tokens computed on the prefill worker, device-tier and lower-tier hits, TTFT p50 / p90
(from the backend call to the first output), wall time, and the kv_tiers figures; then the ideal (each prefix
computed once), the number of requests whose output token ids differ between runs (the benchmark fails if
any do), the TTFT p50s, and last ``ratio: <prefill tokens computed with tiers / without>`` (the highest over
the pairs; target <= 0.35).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
from dataclasses import dataclass

from bench.cluster_run import init_ray, prefill_stats, serve_workload
from bench.summary import percentile
from engine.loading.checkpoint import load_model_config

TARGET_RATIO = 0.35
BLOCK_SIZE = 16  # the engine's default


def build_workload(prefixes: int, visits: int, prefix_tokens: int, suffix_tokens: int, vocab: int,
                   seed: int) -> list[list[int]]:
    """``prefixes * visits`` prompts: rounds over the prefixes, each round in its own shuffled order."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, vocab) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    prompts = []
    for _ in range(visits):
        order = list(range(prefixes))
        rng.shuffle(order)
        prompts += [docs[i] + [rng.randrange(3, vocab) for _ in range(suffix_tokens)] for i in order]
    return prompts


@dataclass(frozen=True)
class Setup:
    """One comparison's cluster: the model, its block size in bytes, and the tiers' sizes in blocks."""

    model: str
    bytes_per_block: int
    working_set_blocks: int  # the prefixes' blocks
    device_blocks: int  # the prefill worker's paged cache
    host_blocks: int  # its host tier in the tiers-on run
    max_tokens: int = 4
    concurrency: int = 2
    decode_blocks: int = 512

    def overrides(self, tiers: bool) -> dict:
        return {"model": self.model, "engine.dtype": "float32", "engine.num_blocks": self.decode_blocks,
                "prefill.num_blocks": self.device_blocks,
                "engine.kv_host_bytes": self.host_blocks * self.bytes_per_block if tiers else 0,
                "prefill.num_workers": 1, "decode.num_workers": 1, "prefill.num_cpus": 1, "decode.num_cpus": 1,
                "prefill.torch_threads": 1, "decode.torch_threads": 1, "router.grpc_port": None,
                "router.local_prefill_max_tokens": 0}


def make_setup(model: str, prompts: list[list[int]], prefix_tokens: int, device_fraction: float = 0.25,
               **kw) -> Setup:
    """Size the tiers for ``prompts``: the prefill device tier holds ``device_fraction`` of the prefixes'
    blocks, the host tier every distinct block of the workload (prefixes and questions) and one request
    more, and at least the decode worker's device tier. The device tier must also hold the blocks of the requests in flight (at most ``concurrency`` hold
    prefill blocks: computing, or leased until the decode side has read them) and one more, or the prefill
    worker would only queue."""

    mc = load_model_config(model)
    bytes_per_block = mc.num_layers * 2 * BLOCK_SIZE * mc.num_kv_heads * mc.head_dim * 4  # float32
    working_set = len({tuple(p[:prefix_tokens]) for p in prompts}) * (prefix_tokens // BLOCK_SIZE)
    per_request = -(-max(len(p) for p in prompts) // BLOCK_SIZE)
    device = int(working_set * device_fraction)
    concurrency = kw.get("concurrency", Setup.concurrency)
    if device < (concurrency + 1) * per_request:
        raise ValueError(f"a device tier of {device} blocks cannot hold {concurrency} requests of {per_request} "
                         "blocks in flight and one more: more prefixes, or less concurrency")
    total = working_set + sum(-(-(len(p) - prefix_tokens) // BLOCK_SIZE) for p in prompts)
    # the decode worker gets the same host tier, and a host tier smaller than the device's is refused
    host = max(total + per_request, kw.get("decode_blocks", Setup.decode_blocks))
    return Setup(model, bytes_per_block, working_set, device, host, **kw)


def ideal_computed(prompts: list[list[int]], prefix_tokens: int) -> int:
    """Prompt tokens a prefill worker that never forgets a block computes: each prefix once, and of every
    prompt what follows its cached full blocks (at least its last token, whose logits are needed)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for p in prompts:
        key = tuple(p[:prefix_tokens])
        cached = min(prefix_tokens, len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE if key in seen else 0
        total += len(p) - cached
        seen.add(key)
    return total


async def run_once(setup: Setup, prompts: list[list[int]], tiers: bool) -> dict:
    """Serve ``prompts`` on a fresh cluster; the prefill side's figures (its only prefill worker: the decode
    worker computes no prompt)."""
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=setup.max_tokens, temperature=0, ignore_eos=True)
    run = await serve_workload(setup.overrides(tiers), prompts, params, setup.concurrency, "on" if tiers else "off")
    (p,) = prefill_stats(run.stats)
    t = p.get("kv_tiers")
    return {"outputs": run.outputs, "ttft_s": run.ttft_s, "elapsed_s": run.elapsed_s,
            "prompt_tokens": sum(len(x) for x in prompts), "computed": p["num_computed_tokens"],
            "device_hits": p["prefix_cache_hit_tokens"], "tier_hits": t["tier_hit_tokens"] if t else 0,
            "kv_tiers": t}


def run_pair(setup: Setup, prompts: list[list[int]], show=None) -> tuple[dict, dict, dict]:
    """Tiers off, then on, on the same workload (Ray must be up); ``(off, on, comparison)``."""
    base = asyncio.run(run_once(setup, prompts, tiers=False))
    if show:
        show("tiers off", base)
    tiered = asyncio.run(run_once(setup, prompts, tiers=True))
    if show:
        show("tiers on", tiered)
    mismatched = [i for i, (a, b) in enumerate(zip(base["outputs"], tiered["outputs"], strict=True)) if a != b]
    return base, tiered, {"mismatched": mismatched, "ratio": tiered["computed"] / base["computed"],
                          "ttft_p50_s": (percentile(base["ttft_s"], 50), percentile(tiered["ttft_s"], 50))}


def report(name: str, r: dict) -> None:
    ttft = r["ttft_s"]
    print(f"{name:>9}: prefill tokens computed {r['computed']:>6} of {r['prompt_tokens']} prompt tokens "
          f"(device-tier hits {r['device_hits']}, lower-tier hits {r['tier_hits']}); TTFT p50 "
          f"{percentile(ttft, 50) * 1e3:.0f} ms, p90 {percentile(ttft, 90) * 1e3:.0f} ms; {r['elapsed_s']:.1f} s",
          flush=True)
    t = r["kv_tiers"]
    if t:
        print(f"{'':>11}kv_tiers: host {t['usage']['host']['blocks_used']}/{t['usage']['host']['blocks_total']} "
              f"blocks used, {t['stores']['host']} stored, {t['loads']} loads of {t['loaded_blocks']['host']} "
              f"blocks ({t['bytes']['host_to_device'] / 2**20:.0f} MiB host->device in "
              f"{t['seconds']['host_to_device'] * 1e3:.0f} ms, {t['bytes']['device_to_host'] / 2**20:.0f} MiB "
              f"device->host in {t['seconds']['device_to_host'] * 1e3:.0f} ms), load failures {t['load_failures']}, "
              f"op failures {t['op_failures']}, stores skipped {t['stores_skipped']}, waits on another's load "
              f"{t['waits_on_load']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF directory or GGUF file (default: SmolLM2-135M-Instruct's GGUF)")
    ap.add_argument("--tiny", action="store_true", help="a generated tiny random Llama instead (prefill is cheap)")
    ap.add_argument("--small", action="store_true", help="a short run: the tiny model (the same workload)")
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--visits", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=256)
    ap.add_argument("--suffix-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--device-fraction", type=float, default=0.25,
                    help="the prefill worker's device tier, as a fraction of the prefixes' blocks")
    ap.add_argument("--decode-blocks", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="pairs of runs (off, on, off, on, ...)")
    args = ap.parse_args()
    args.tiny = args.tiny or args.small
    if args.tiny:
        from engine.loading.tiny import make_tiny_model

        model = str(make_tiny_model(tempfile.mkdtemp(prefix="duet-bench-tiers-"), arch="llama"))
    else:
        from engine.loading.default_model import default_model_path

        model = args.model or str(default_model_path())

    vocab = min(load_model_config(model).vocab_size, 32000)
    prompts = build_workload(args.prefixes, args.visits, args.prefix_tokens, args.suffix_tokens, vocab, args.seed)
    setup = make_setup(model, prompts, args.prefix_tokens, args.device_fraction, max_tokens=args.max_tokens,
                       concurrency=args.concurrency, decode_blocks=args.decode_blocks)
    print(f"model: {model}; {setup.bytes_per_block / 2**20:.2f} MiB per block of {BLOCK_SIZE} tokens")
    print(f"workload: {len(prompts)} requests = {args.prefixes} prefixes of {args.prefix_tokens} tokens x "
          f"{args.visits} visits (rounds, shuffled), +{args.suffix_tokens} tokens each, {args.max_tokens} out, "
          f"{args.concurrency} in flight; 1 prefill + 1 decode worker, 1 thread each")
    print(f"prefill device tier {setup.device_blocks} blocks = {setup.device_blocks / setup.working_set_blocks:.2f}"
          f" of the prefixes' {setup.working_set_blocks} blocks; host tier (second run) {setup.host_blocks} blocks "
          f"({setup.host_blocks * setup.bytes_per_block / 2**20:.0f} MiB)", flush=True)
    init_ray(2)
    pairs = []
    try:
        for i in range(args.repeats):
            print(f"pair {i + 1} of {args.repeats}:", flush=True)
            pairs.append(run_pair(setup, prompts, show=report))
    finally:
        import ray

        ray.shutdown()
    print(f"ideal (each prefix computed once): {ideal_computed(prompts, args.prefix_tokens)} prompt tokens")
    mismatched = sorted({i for _, _, c in pairs for i in c["mismatched"]})
    first = pairs[0][0]["outputs"]
    mismatched += [f"off run {k + 1}" for k, (base, _, _) in enumerate(pairs) if base["outputs"] != first]
    print(f"outputs: {len(prompts) - len(mismatched)}/{len(prompts)} requests equal in every run, "
          f"{len(mismatched)} mismatched")
    p50s = [c["ttft_p50_s"] for _, _, c in pairs]
    p50_off, p50_on = (statistics.median(p[k] for p in p50s) for k in (0, 1))
    print(f"TTFT p50: tiers off {p50_off * 1e3:.0f} ms, tiers on {p50_on * 1e3:.0f} ms ({p50_on / p50_off:.2f}x; "
          f"median over {len(pairs)} pairs: " + ", ".join(f"{a * 1e3:.0f} / {b * 1e3:.0f}" for a, b in p50s) + ")")
    if mismatched:
        raise SystemExit(f"outputs differ with tiers on for requests {mismatched[:20]}")
    ratios = [c["ratio"] for _, _, c in pairs]
    print(f"ratio: {max(ratios):.3f} (prefill tokens computed with tiers / without, the highest of {len(pairs)} "
          f"pairs; target <= {TARGET_RATIO})")


if __name__ == "__main__":
    main()
