"""f. A quantized KV cache on the Mooncake trace (issue 49, must-show 1): what int8 / fp8 KV blocks buy a cluster.

    python -m bench.sim kv-dtype --hardware gpu [--configs colocated-4,2P+2D]

GPU scenario (Llama-3.1-8B on H100s, the roofline): the same workers, routing and request rates, the KV cache in
bf16 ("auto") against 1-byte values with an fp32 scale per token and KV head (int8, and fp8 alike: the same bytes;
engine/kv/cache_dtype.py's page layout): (128 + 4) / 256 of the bytes per token. What changes is what the bytes
change, in the model (``ModelSpec.kv_cache_dtype``): the blocks one GPU holds, the KV bytes a step reads and writes
(the roofline's memory term), and the bytes each handoff ships. Not modelled: the dequantization's cost in the
attention kernels (the roofline has no such term; measured on a CPU it pays for itself, int8 KV decode 1.77x fp32
at 4K context, docs/benchmarks.md) and the accuracy (the KL test in tests/engine/test_kv_cache_dtype.py).

Per run: goodput, TTFT / TPOT p90, the prefix hit rate, and the reference hit rate of one global LRU of the
cluster's device blocks over the same prompts (bench/sim/tiers.py ``global_lru_hit_rate``). Then, for the CPU
scenario's trace (SmolLM2, this machine's engine): tokens per GiB of fp32 against int8 KV from the engine's own
sizing, and the LRU hit rate of one worker's KV memory in each. Prints the tables and ``ratio: <goodput int8 /
bf16 of the first config at the top rate>``; writes build/bench/sim/gpu-kv-dtype.json.
"""
from __future__ import annotations

import dataclasses
import sys

from bench.sim.scenarios import Scenario, gpu_hardware
from bench.sim.tiers_study import lru_reference, num_workers

GIB = 2**30
ARMS = ("auto", "int8")


def with_kv_dtype(sc: Scenario, kv_cache_dtype: str, link: str) -> Scenario:
    """``sc`` (the GPU scenario) with its model's KV cache in ``kv_cache_dtype`` (a distinct name: the runs' cache
    keys on it)."""
    if kv_cache_dtype == "auto":
        return sc
    model = dataclasses.replace(sc.hardware.step_model.model, kv_cache_dtype=kv_cache_dtype)
    hw = gpu_hardware(link, sc.hardware.step_model.gpu, model)
    return dataclasses.replace(sc, name=f"{sc.name}-{kv_cache_dtype}kv", hardware=hw)


def study_kv_dtype(sc: Scenario, out_dir, configs: tuple[str, ...] = ("colocated-4", "2P+2D"),
                   link: str = "rdma") -> dict:
    from bench.sim.runs import parse_config, row, run_at, save, table

    if sc.name != "gpu":
        raise SystemExit("kv-dtype runs on the gpu scenario (--hardware gpu); the CPU figures are printed with it")
    wl = tuple(sorted(sc.workload.items()))
    rows = []
    for arm in ARMS:
        s = with_kv_dtype(sc, arm, link)
        model = s.hardware.step_model.model
        for name in configs:
            dep = parse_config(name, s.local_prefill_max_tokens)
            n = num_workers(dep)
            lru = lru_reference(wl, s.hardware.block_size, n * s.hardware.num_blocks)
            for rate in tuple(r * n / 4 for r in s.rates):
                doc = run_at(s, dep, rate)
                print(f"  {arm} {name} {rate:g} req/s: goodput {doc['summary']['goodput']:.3f}, hit "
                      f"{doc['sim']['prefix_hit_rate']:.1%} (LRU {lru:.1%})", file=sys.stderr, flush=True)
                rows.append(row(doc, s, kv=("bf16" if arm == "auto" else "int8 / fp8"), blocks=s.hardware.num_blocks,
                                tokens_per_gib=GIB / model.kv_bytes_per_token, lru=lru,
                                block_mib=s.hardware.transfer.bytes_per_block / 2**20))
    base = {(r["config"], r["rate"]): r for r in rows if r["kv"] == "bf16"}
    for r in rows:
        b = base[(r["config"], r["rate"])]
        r["vs_bf16"] = r["goodput"] / b["goodput"] if b["goodput"] else None
    cols = [("kv", "KV", ""), ("config", "config", ""), ("rate", "req/s", "g"), ("blocks", "blocks / GPU", "d"),
            ("tokens_per_gib", "tokens / GiB", ",.0f"), ("block_mib", "MiB / block", ".1f"),
            ("goodput", "goodput", ".3f"), ("vs_bf16", "x bf16", ".2f"), ("good_fraction", "met SLO", ".0%"),
            ("ttft_p90", "TTFT p90 s", ".2f"), ("tpot_p90", "TPOT p90 s", ".3f"), ("hit_rate", "hit", ".1%"),
            ("lru", "global LRU", ".1%")]
    text = table(rows, cols)
    cpu = cpu_capacity()
    first, top = configs[0], max(r["rate"] for r in rows if r["config"] == configs[0])
    ratio = next(r["vs_bf16"] for r in rows if r["config"] == first and r["rate"] == top and r["kv"] != "bf16")
    print(f"\n## f. KV cache dtype ({sc.name})\n{text}\n\n{cpu['text']}\nratio: {ratio:.2f}")
    save(f"{sc.name}-kv-dtype", {"study": "kv-dtype", "scenario": sc.describe(), "rows": rows, "table": text,
                                 "cpu": cpu, "ratio": ratio}, out_dir)
    return {"rows": rows, "table": text, "cpu": cpu, "ratio": ratio}


def cpu_capacity(kv_gib: float = 1.0) -> dict:
    """The CPU scenario's model (SmolLM2-135M: 30 layers, 3 KV heads of 64) and trace: tokens per GiB of KV in fp32
    and int8 by the engine's own sizing (engine/kv/cache_dtype.py), and the LRU hit rate of ``kv_gib`` of each."""
    from bench.sim.scenarios import cpu_scenario
    from engine.kv.cache_dtype import resolve_kv_cache_dtype

    sc = cpu_scenario()
    wl, block = tuple(sorted(sc.workload.items())), sc.hardware.block_size
    out = {}
    for name, dtype in (("fp32", resolve_kv_cache_dtype("auto", "float32")),
                        ("int8", resolve_kv_cache_dtype("int8", "float32"))):
        per_block = dtype.bytes_per_block(30, block, 3, 64)
        blocks = int(kv_gib * GIB // per_block)
        out[name] = {"tokens_per_gib": GIB * block / per_block, "blocks": blocks,
                     "hit_rate": lru_reference(wl, block, blocks)}
    f, i = out["fp32"], out["int8"]
    out["text"] = (f"CPU scenario (SmolLM2-135M, its trace): {kv_gib:g} GiB of KV holds {f['tokens_per_gib']:,.0f} "
                   f"tokens in fp32, {i['tokens_per_gib']:,.0f} in int8 ({i['tokens_per_gib'] / f['tokens_per_gib']:.2f}x);"
                   f" one LRU of it hits {f['hit_rate']:.1%} vs {i['hit_rate']:.1%} of prompt tokens")
    return out
