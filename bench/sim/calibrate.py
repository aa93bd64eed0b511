"""Calibrate the simulator's CPU step-time model on the real duet engine (SmolLM2-135M-Instruct by default).

    python -m bench.sim.calibrate [--out bench/sim/calibration/cpu-smollm2.json] [--threads 1,2] [--repeats 1]

Measures whole ``Engine.step()`` calls (schedule + forward + sample + stop checks: what a worker's engine
thread does per step, less the publishing of events) of three kinds, each with its ``StepShape``:

- prompt steps: one prompt of ``new`` uncached tokens after ``cached`` tokens found in the prefix cache
  (the prefix is computed once beforehand; every suffix is fresh random ids, so nothing else hits);
- decode steps: ``batch`` sequences of context ~``ctx`` (they share one cached prompt, so setting a batch
  up costs one token each; the attention still reads each sequence's whole context);
- mixed steps: a decode batch plus one prompt chunk in the same step (held out of the fit: they test
  that the parts add up as the model says, which is what colocated serving depends on).

Threads: a Ray CPU worker runs with ``torch_threads`` = its pool's ``num_cpus`` rounded up (cluster/launcher.py;
``PoolConfig.num_cpus`` defaults to 1): 1 thread. ``duet serve --colocated`` runs one engine in the router
process with torch's default (the core count: 2 here). Both are calibrated (``--threads 1,2``), each its
own fit. Before measuring, the script waits (up to ``--max-wait-s``) for the 1-minute load average to fall
below ``--max-load``, because other benchmarks share this machine; it records the load at the start and
before/after each thread count. The fit is
bench.sim.step_model.fit (non-negative least squares on relative error) of each grid point's fastest pass;
the JSON holds machine, date, the raw measurements, the coefficients and the fit's error per kind. An
existing JSON keeps the fits of thread counts not measured in this run (``--threads 2`` redoes one fit).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

from bench.sim.step_model import FittedStepModel, StepShape, feature_names, fit, step_shape

DEFAULT_OUT = Path(__file__).resolve().parent / "calibration" / "cpu-smollm2.json"
PROMPT_GRID = {"cached": (0, 1024), "new": (16, 64, 256, 512, 1024)}
LONG_PROMPT = 2048
DECODE_GRID = {"ctx": (64, 512, 1536), "batch": (1, 2, 4, 8, 16, 32, 64)}
MIXED = ((4, 256), (16, 256), (16, 1024), (32, 512), (8, 64))  # (decode batch, prompt tokens), ctx 512
DECODE_STEPS = 3  # timed decode steps per (ctx, batch)
# the KV cache the simulator gives each worker: the engine's fixed default before it sized the cache from the
# free memory (engine/kv/sizing.py); docs/simulator.md's figures were simulated with it
SIM_WORKER_KV_CACHE_BYTES = 256 << 20


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def wait_for_quiet(max_load: float, max_wait_s: float, poll_s: float = 5.0) -> tuple[float, float]:
    """Wait until the 1-minute load average is below ``max_load``; returns (load, seconds waited)."""
    t0 = time.monotonic()
    while True:
        load = loadavg()
        waited = time.monotonic() - t0
        if load < max_load or waited >= max_wait_s:
            return load, waited
        print(f"load average {load:.2f} >= {max_load}: waiting ({waited:.0f} s)", flush=True)
        time.sleep(poll_s)


def cpu_model_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


class Probe:
    """An engine whose steps are timed together with the shape the scheduler gave them."""

    def __init__(self, model: str, seed: int = 0) -> None:
        from engine.config import EngineConfig
        from engine.engine import Engine
        from engine.request import SamplingParams

        self.Params = SamplingParams
        self.engine = Engine(EngineConfig(model=model, kv_cache_bytes=1 << 30, max_num_batched_tokens=LONG_PROMPT,
                                          max_num_seqs=64))
        self.vocab = self.engine.model_config.vocab_size
        self.rng = random.Random(seed)
        self._shapes: list[StepShape] = []
        schedule = self.engine.scheduler.schedule

        def schedule_and_record():
            out = schedule()
            self._shapes.append(step_shape(out))
            return out

        self.engine.scheduler.schedule = schedule_and_record  # instance attribute: this probe only

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(256, self.vocab) for _ in range(n)]

    def add(self, ids: list[int], max_tokens: int) -> None:
        self.engine.add_request(prompt_token_ids=ids, params=self.Params(max_tokens=max_tokens, ignore_eos=True))

    def step(self) -> tuple[StepShape, float]:
        self._shapes.clear()
        t0 = time.perf_counter()
        self.engine.step()
        dt = time.perf_counter() - t0
        return self._shapes[-1], dt

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def measure_prompts(p: Probe, out: list[dict]) -> None:
    prefixes = {c: p.tokens(c) for c in PROMPT_GRID["cached"] if c}
    for ids in prefixes.values():  # compute each prefix once: its full blocks stay in the prefix cache
        p.add(ids + p.tokens(1), 1)
        p.drain()
    cases = [(c, n) for c in PROMPT_GRID["cached"] for n in PROMPT_GRID["new"]] + [(0, LONG_PROMPT)]
    for c, n in cases:
        p.add(prefixes.get(c, []) + p.tokens(n), 1)
        shape, dt = p.step()
        assert shape.num_tokens == n, (c, n, shape)  # the prefix hit exactly, the prompt ran in one step
        out.append({"kind": "prompt", "cached": c, "new": n, "shape": shape.__dict__, "time_s": dt})
        p.drain()


def measure_decodes(p: Probe, out: list[dict]) -> None:
    for ctx in DECODE_GRID["ctx"]:
        prefix = p.tokens(ctx)
        p.add(prefix + p.tokens(1), 1)
        p.drain()
        for b in DECODE_GRID["batch"]:
            for _ in range(b):
                p.add(prefix + p.tokens(1), DECODE_STEPS + 2)
            p.step()  # each computes its one uncached token
            for k in range(DECODE_STEPS):
                shape, dt = p.step()
                assert shape.num_decode_seqs == b and shape.num_prefill_seqs == 0, shape
                out.append({"kind": "decode", "ctx": ctx, "batch": b, "step": k, "shape": shape.__dict__,
                            "time_s": dt})
            p.drain()


def measure_mixed(p: Probe, out: list[dict], ctx: int = 512) -> None:
    prefix = p.tokens(ctx)
    p.add(prefix + p.tokens(1), 1)
    p.drain()
    for b, n in MIXED:
        for _ in range(b):
            p.add(prefix + p.tokens(1), 4)
        p.step()
        p.step()  # now b sequences decode
        p.add(p.tokens(n), 1)
        shape, dt = p.step()
        assert shape.num_decode_seqs == b and shape.num_prefill_seqs == 1, shape
        out.append({"kind": "mixed", "batch": b, "new": n, "ctx": ctx, "shape": shape.__dict__, "time_s": dt})
        p.drain()


def best_of(samples: list[dict]) -> list[dict]:
    """The fastest of the repeated measurements of each grid point (contention only ever slows a step)."""
    best: dict[tuple, dict] = {}
    for s in samples:
        key = tuple(s.get(k) for k in ("kind", "cached", "new", "ctx", "batch", "step"))
        if key not in best or s["time_s"] < best[key]["time_s"]:
            best[key] = s
    return list(best.values())


def fit_samples(samples: list[dict]) -> dict[str, float]:
    """The fit bench/sim/step_model.py uses: prompt and decode steps (best of the repeats); mixed ones held out."""
    train = [s for s in best_of(samples) if s["kind"] != "mixed"]
    return fit([StepShape(**s["shape"]) for s in train], [s["time_s"] for s in train])


def fit_report(samples: list[dict], coefficients: dict[str, float]) -> dict[str, dict]:
    """Per kind: mean and max |relative error| of the fitted model on the measurements."""
    model = FittedStepModel(coefficients)
    report = {}
    for kind in sorted({s["kind"] for s in samples}):
        errs = [abs(model.step_time_s(StepShape(**s["shape"])) / s["time_s"] - 1) for s in samples if s["kind"] == kind]
        report[kind] = {"n": len(errs), "mean_abs_rel_err": statistics.fmean(errs), "max_abs_rel_err": max(errs)}
    return report


def measure(probe: Probe, threads: int, repeats: int) -> dict:
    """One thread count: measure ``repeats`` passes, fit."""
    import torch

    torch.set_num_threads(threads)
    load_before = loadavg()
    t0 = time.perf_counter()
    probe.add(probe.tokens(32), 4)
    probe.drain()  # warm-up at this thread count
    samples: list[dict] = []
    for r in range(repeats):
        measure_prompts(probe, samples)
        measure_decodes(probe, samples)
        measure_mixed(probe, samples)
        print(f"{threads} thread(s), pass {r + 1}: {len(samples)} steps, {time.perf_counter() - t0:.0f} s", flush=True)
    coefficients = fit_samples(samples)
    return {"torch_threads": torch.get_num_threads(), "date": _now(), "passes": repeats,
            "coefficients": coefficients, "trained_on": ["prompt", "decode"],
            "error": fit_report(best_of(samples), coefficients), "loadavg_1m_before": load_before,
            "loadavg_1m_after": loadavg(), "wall_s": time.perf_counter() - t0,
            "measurements": samples}


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF directory or GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--threads", default="1,2", help="torch thread counts to calibrate (a Ray CPU worker: 1; "
                    "`duet serve --colocated`, one in-process engine: torch's default, the core count)")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the grid per thread count; the fit takes "
                    "each point's fastest (default 1: both thread counts in ~3 minutes)")
    ap.add_argument("--max-load", type=float, default=1.0)
    ap.add_argument("--max-wait-s", type=float, default=600.0)
    args = ap.parse_args(argv)

    import torch

    from engine.config import EngineConfig
    from engine.loading.default_model import default_model_path

    model = args.model or str(default_model_path())
    default_threads = torch.get_num_threads()
    load, waited = wait_for_quiet(args.max_load, args.max_wait_s)  # once: our own load would count later
    t0 = time.perf_counter()
    probe = Probe(model)
    fits = {}
    if args.out.exists():  # a fit for a thread count not measured now is kept
        fits = json.loads(args.out.read_text()).get("fits", {})
    for threads in (int(t) for t in args.threads.split(",")):
        fits[str(threads)] = dict(measure(probe, threads, args.repeats), loadavg_1m_at_start=load,
                                  waited_for_quiet_s=waited)
    runner = probe.engine.runner
    default_cfg = EngineConfig(model=model)
    result = {
        "name": "cpu-smollm2",
        "date": _now(),
        "machine": {"node": platform.node(), "nproc": os.cpu_count(), "cpu_model": cpu_model_name(),
                    "torch": torch.__version__, "torch_default_threads": default_threads},
        "model": {"path": model, "id": probe.engine.model_config.model_id, "dtype": str(runner.dtype),
                  "num_layers": probe.engine.model_config.num_layers},
        "engine": {"block_size": probe.engine.config.block_size, "bytes_per_block": runner.bytes_per_block,
                   "max_num_batched_tokens": default_cfg.max_num_batched_tokens, "max_num_seqs": default_cfg.max_num_seqs,
                   "worker_num_blocks": max(2, SIM_WORKER_KV_CACHE_BYTES // runner.bytes_per_block),
                   "worker_kv_cache_bytes": SIM_WORKER_KV_CACHE_BYTES},
        "features": feature_names(),
        "fits": fits,
        "wall_s": time.perf_counter() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for threads, f in fits.items():
        print(f"{threads} thread(s): " + json.dumps({"coefficients": f["coefficients"], "error": f["error"]}, indent=1))
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
