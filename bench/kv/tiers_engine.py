"""What the KV tiers cost when nothing is reused: engine throughput with a host tier vs without (issue 23,
must-show 4).

    python -m bench.kv.tiers_engine [--small] [--tiny] [--num-requests 192] [--repeats 3]   # in `make bench-tiers`

One engine in this process (bench/engine/throughput.py's ``bench_duet``: a fresh engine per run, all requests
at once, continuous batching, chunked prefill at 2,048 tokens a step, 1 GiB of paged KV, greedy, EOS
ignored, this process's torch threads), on the default model (SmolLM2-135M-Instruct, fp32, the ``cpu``
kernels) or ``--tiny`` (bench-engine's tiny Llama: far less compute per KV byte, so the harsher case for the
tiers' per-block bookkeeping). Workload: ``--num-requests`` prompts of distinct random token ids
(16–``--max-prompt`` tokens; no two share a block) with 8–32 output tokens, so the run is mostly prefill —
where write-through copies the most blocks per second of compute. Both sides cache prefixes (the tiers
build on the prefix cache, so only the tiers differ); tiers on adds a host tier of ``--host-gib`` (every
block the device caches is copied to it; nothing is ever loaded back). Runs alternate off, on, off, on, …
``--repeats`` times each, in one process. ``--small``: the tiny model, 256 requests.

Prints each run's wall and process CPU seconds (CPU: every thread, the mover's copies included), then each
side's tokens/s (prompt + output) as best and median with the spread, and last
``ratio: <tiers-on / tiers-off throughput>`` of the best runs (the noisy VM only ever slows a run down, so
each side's best is its least disturbed one; the medians' ratio is printed above it). Target >= 0.95.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from bench.engine.throughput import bench_duet, make_bench_tiny_model, workload
from engine.loading.checkpoint import load_model_config

TARGET_RATIO = 0.95


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF directory or GGUF file (default: SmolLM2-135M-Instruct's GGUF)")
    ap.add_argument("--tiny", action="store_true", help="the generated tiny random Llama of bench-engine --tiny")
    ap.add_argument("--small", action="store_true", help="a short run: the tiny model, 256 requests")
    ap.add_argument("--num-requests", type=int, default=192)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each side, alternating")
    ap.add_argument("--host-gib", type=float, default=2.0)
    args = ap.parse_args()
    if args.small:
        args.tiny, args.num_requests = True, 256
    if args.tiny:
        model = make_bench_tiny_model()
    else:
        from engine.loading.default_model import default_model_path

        model = args.model or str(default_model_path())

    reqs = workload(args.num_requests, load_model_config(model).vocab_size, seed=1,
                    max_prompt=args.max_prompt, out_range=(8, 32))
    n_tokens = sum(len(p) + o for p, o in reqs)
    print(f"model: {model}; torch threads {torch.get_num_threads()}")
    print(f"workload: {len(reqs)} requests, prompt tokens {sum(len(p) for p, _ in reqs)}, output tokens "
          f"{sum(o for _, o in reqs)}, no shared prefix; host tier (tiers on) {args.host_gib:g} GiB", flush=True)
    sides = {"tiers off": {"dtype": "float32", "enable_prefix_caching": True},
             "tiers on": {"dtype": "float32", "enable_prefix_caching": True,
                          "kv_host_bytes": int(args.host_gib * 2**30)}}
    rates: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(args.repeats):
        for name, config in sides.items():
            cpu_s: list[float] = []
            elapsed, _ = bench_duet(model, reqs, 16, cpu_s=cpu_s, **config)
            rates[name].append(n_tokens / elapsed)
            print(f"  run {i + 1} {name}: {elapsed:.2f} s wall, {cpu_s[0]:.2f} s CPU", flush=True)
    for name, r in rates.items():
        print(f"{name:>9}: {max(r):8.1f} tokens/s best, median {statistics.median(r):.1f} "
              f"(runs {', '.join(f'{x:.1f}' for x in r)})")
    best = max(rates["tiers on"]) / max(rates["tiers off"])
    print(f"median on / median off: {statistics.median(rates['tiers on']) / statistics.median(rates['tiers off']):.3f}")
    print(f"ratio: {best:.3f} (engine throughput with the host tier / without, no reuse, best of {args.repeats} "
          f"alternated runs each; target >= {TARGET_RATIO})")


if __name__ == "__main__":
    main()
