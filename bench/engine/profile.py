"""Where duet's engine spends its time on make bench-engine's workload (issue 15: profile first).

    python -m bench.engine.profile [--num-requests 64] [--model PATH]

One run under ``torch.profiler`` (operators by self CPU time, GEMMs vs everything else) and the same run's
wall time split into the engine step's parts: schedule, the model forward, sampling, and the bookkeeping
after it; then the forward's time by kernel-backend op (``KernelOps``: GEMMs, attention, the fused per-token
ops — the C kernels of the CPU path are invisible to torch.profiler), for steps with prefill tokens and
decode-only steps apart. Same model and workload as bench/engine/throughput.py (SmolLM2 fp32 by default).
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from bench.engine.throughput import workload
from engine.loading.checkpoint import load_model_config

_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn::_linear_pointwise"}


def time_kernel_ops(engine, parts: dict[str, float], kind: list[str]) -> None:
    """Route every module's KernelOps calls through timers: parts[f"{kind[0]} {op}"] += seconds."""
    import dataclasses

    ops = engine.runner.ops

    def timed(name, fn):
        if fn is None:
            return None

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                parts[f"{kind[0]} {name}"] += time.perf_counter() - t0
        return wrapper

    names = ("store_kv", "prefill_attention", "decode_attention", "linear", "w8a16_linear", "rms_norm", "rotary_",
             "silu_mul", "linear_packed")
    timed_ops = dataclasses.replace(ops, **{n: timed(n, getattr(ops, n)) for n in names})
    for module in engine.runner.model.modules():
        if getattr(module, "ops", None) is ops:
            module.ops = timed_ops
        if getattr(module, "fused", None) is not None:  # RMSNorm
            module.fused = timed_ops.rms_norm
        if getattr(module, "silu_mul", None) is not None:  # MLP
            module.silu_mul = timed_ops.silu_mul


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--num-requests", type=int, default=64)
    args = ap.parse_args()
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.loading.default_model import default_model_path
    from engine.request import SamplingParams

    model = args.model or str(default_model_path())
    reqs = workload(args.num_requests, load_model_config(model).vocab_size)
    engine = Engine(EngineConfig(model=model, dtype="float32", max_num_seqs=64, max_num_batched_tokens=2048,
                                 kv_cache_bytes=1 << 30, enable_prefix_caching=False))
    engine.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0))
    parts: dict[str, float] = defaultdict(float)
    import engine.engine as engine_module

    runner_execute, sample_fn = engine.runner.execute, engine_module.sample

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                parts[name] += time.perf_counter() - t0
        return wrapper

    kind = ["prefill"]
    op_parts: dict[str, float] = defaultdict(float)
    time_kernel_ops(engine, op_parts, kind)

    def execute(out):
        kind[0] = "prefill" if any(s.num_new_tokens > 1 for s in out.scheduled) else "decode"
        t0 = time.perf_counter()
        try:
            return runner_execute(out)
        finally:
            op_parts[f"{kind[0]} (whole forward)"] += time.perf_counter() - t0

    engine.runner.execute = timed("forward (runner.execute)", execute)
    engine_module.sample = timed("sampling", sample_fn)
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    for p, o in reqs:
        engine.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=o, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        total = time.perf_counter() - t0  # before the profiler stops (it then spends seconds on its events)
    engine_module.sample = sample_fn
    print(f"{len(reqs)} requests, {steps} steps, {total:.1f} s wall (profiler on)")
    for name, t in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<28} {t:7.2f} s  {t / total:6.1%}")
    rest = total - sum(parts.values())
    print(f"  {'step bookkeeping (rest)':<28} {rest:7.2f} s  {rest / total:6.1%}")
    print(f"the forward by kernel op (backend {engine.runner.backend}), seconds:")
    for k in ("prefill", "decode"):
        whole = op_parts.get(f"{k} (whole forward)", 0.0)
        mine = {n.split(" ", 1)[1]: t for n, t in op_parts.items() if n.startswith(k + " ") and "whole" not in n}
        print(f"  {k} steps: {whole:.2f} s; " + ", ".join(f"{n} {t:.2f}" for n, t in
                                                         sorted(mine.items(), key=lambda kv: -kv[1]))
              + f", rest {whole - sum(mine.values()):.2f}")
    events = prof.key_averages()
    cpu_total = sum(e.self_cpu_time_total for e in events)
    gemm = sum(e.self_cpu_time_total for e in events if e.key in _GEMM_OPS)
    print(f"operators: GEMM {gemm / cpu_total:.1%} of self CPU time; top 15 by self time:")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]:
        print(f"  {e.key:<40} {e.self_cpu_time_total / 1e6:7.2f} s  {e.self_cpu_time_total / cpu_total:6.1%}"
              f"  calls {e.count}")


if __name__ == "__main__":
    main()
