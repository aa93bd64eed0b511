"""The simulator's two scenarios (this CPU, calibrated; an H100 from a roofline) and one simulated run → the
benchmark JSON document that ``duet bench`` writes (bench/client.py), plus a ``sim`` section.

CPU (``cpu_scenario``): SmolLM2-135M-Instruct fp32, step times fitted by bench/sim/calibrate.py (1 torch
thread = a Ray CPU worker's default), KV blocks per worker as the engine's fixed default sized them
before it measured the free memory (256 MiB), the Mooncake trace scaled by bench.workloads.scaled_trace with its
defaults (16-token blocks, outputs /16, at most 64 out and 2,048 in). KV transfer: 4.28 GB/s (NIXL READ of scattered
blocks on this machine, docs/benchmarks.md) + 2 ms per handoff (assumed: Ray call, notification, commit).

GPU (``gpu_scenario``): Llama-3.1-8B bf16 on H100 SXM 80GB workers (bench.sim.step_model.RooflineStepModel:
50 % MFU of 989 TFLOP/s, 70 % of 3.35 TB/s), KV blocks = what 90 % of 80 GB leaves after weights and a 4 GB
reserve; block size 512 = the trace's own blocks at full length (outputs unscaled, up to 2,048).
KV transfer over RDMA, 50 GB/s (one 400 Gb/s NIC) + 1 ms, or NVLink 450 GB/s (``link="nvlink"``).

SLOs (DistServe's goodput needs both): CPU TTFT 4 s / TPOT 0.25 s; GPU TTFT 2 s / TPOT 50 ms. Why: see
docs/simulator.md (the CPU TTFT target is about twice an idle worker's prefill of a mean scaled prompt;
the GPU pair is the usual interactive-chat target).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import workloads
from bench.sim.cluster import ClusterSim, Deployment, Hardware
from bench.sim.step_model import FittedStepModel, GpuSpec, ModelSpec, RooflineStepModel, TransferModel
from bench.summary import summarize, tpot_of
from cluster.autoscaler import AutoscalerConfig

CALIBRATION = Path(__file__).resolve().parent / "calibration" / "cpu-smollm2.json"
SMOLLM2_VOCAB = 49152
CPU_BYTES_PER_BLOCK = 737_280  # SmolLM2 fp32: 30 layers x 2 x 16 tokens x 3 KV heads x 64 x 4 bytes
CPU_WORKER_BLOCKS = 364  # 256 MiB of KV cache (EngineConfig's fixed default until issue 23) / CPU_BYTES_PER_BLOCK


@dataclass(frozen=True)
class Scenario:
    name: str
    hardware: Hardware
    workload: dict  # scaled_trace keyword arguments (vocab, window, scaling), without time_scale
    slo: dict
    slo_strict: dict  # the same TTFT with a tighter TPOT: goodput is recomputed from the same runs
    local_prefill_max_tokens: int
    rates: tuple[float, ...]  # the request-rate sweep, req/s
    autoscale_rates: tuple[float, ...]
    autoscaler: AutoscalerConfig
    budget: int  # workers in the disagg/colocated and autoscaler comparisons
    notes: tuple[str, ...] = field(default=())

    def describe(self) -> dict:
        return {"name": self.name, "hardware": self.hardware.describe(), "workload": self.workload, "slo": self.slo,
                "slo_strict": self.slo_strict, "local_prefill_max_tokens": self.local_prefill_max_tokens,
                "rates": self.rates, "autoscale_rates": self.autoscale_rates,
                "budget": self.budget, "autoscaler": dataclasses.asdict(self.autoscaler), "notes": self.notes}


def cpu_hardware(calibration: Path = CALIBRATION, threads: int = 1) -> Hardware:
    import json

    data = json.loads(Path(calibration).read_text())
    eng = data["engine"]
    return Hardware(
        name=f"CPU {data['machine']['cpu_model']} ({threads} torch thread(s) per worker)",
        step_model=FittedStepModel.load(calibration, threads),
        transfer=TransferModel(eng["bytes_per_block"], 4.28e9, 2e-3, "NIXL READ over UCX cma, measured"),
        block_size=eng["block_size"], num_blocks=eng["worker_num_blocks"], max_num_seqs=eng["max_num_seqs"],
        max_num_batched_tokens=eng["max_num_batched_tokens"], net_s=5e-4, startup_s=15.0)


def gpu_hardware(link: str = "rdma", gpu: GpuSpec = GpuSpec(), model: ModelSpec = ModelSpec()) -> Hardware:
    step = RooflineStepModel(gpu, model)
    block = 512
    bw, label = {"rdma": (50e9, "RDMA, 400 Gb/s NIC (assumed 50 GB/s)"),
                 "nvlink": (450e9, "NVLink 4, ~450 GB/s per direction")}[link]
    return Hardware(
        name=f"{gpu.name}, {model.name}", step_model=step,
        transfer=TransferModel(model.kv_bytes_per_token * block, bw, 1e-3, label),
        block_size=block, num_blocks=step.kv_blocks(block), max_num_seqs=256, max_num_batched_tokens=8192,
        net_s=2.5e-4, startup_s=30.0)


def cpu_scenario(calibration: Path = CALIBRATION, limit: int = 1000, threads: int = 1) -> Scenario:
    slo = {"ttft_s": 4.0, "tpot_s": 0.25}
    return Scenario(
        "cpu", cpu_hardware(calibration, threads),
        {"vocab": SMOLLM2_VOCAB, "limit": limit, "start": 0, "block_tokens": 16, "output_scale": 1 / 16,
         "max_output": 64, "max_input": 2048, "seed": 0},
        slo, {"ttft_s": slo["ttft_s"], "tpot_s": 0.125}, local_prefill_max_tokens=64,
        rates=(0.25, 0.5, 0.75, 1.0, 1.5), autoscale_rates=(0.75, 1.5),
        autoscaler=AutoscalerConfig(enabled=True, interval_s=10.0, min_prefill=1, max_prefill=3, min_decode=1,
                                    max_decode=3, max_total_workers=4, ttft_slo_s=slo["ttft_s"],
                                    itl_slo_s=slo["tpot_s"], warmup_s=10.0, scale_down_intervals=12),
        budget=4, notes=("every worker has its own core (1 torch thread); the real 2-vCPU box shares 2 cores",))


def gpu_scenario(limit: int = 1000, link: str = "rdma") -> Scenario:
    slo = {"ttft_s": 2.0, "tpot_s": 0.05}
    return Scenario(
        "gpu", gpu_hardware(link),
        {"vocab": 128256, "limit": limit, "start": 0, "block_tokens": 512, "output_scale": 1.0,
         "max_output": 2048, "max_input": 131072 - 2048, "seed": 0},
        slo, {"ttft_s": slo["ttft_s"], "tpot_s": 0.025}, local_prefill_max_tokens=1000,
        rates=(1.0, 2.0, 3.0, 4.0), autoscale_rates=(2.0, 4.0),
        autoscaler=AutoscalerConfig(enabled=True, interval_s=10.0, min_prefill=1, max_prefill=3, min_decode=1,
                                    max_decode=3, max_total_workers=4, ttft_slo_s=slo["ttft_s"],
                                    itl_slo_s=slo["tpot_s"], prefill_queued_tokens_high=32768,
                                    decode_running_high=64, warmup_s=10.0, scale_down_intervals=12),
        budget=4, notes=("Dynamo's default max_local_prefill_length (1000) as the conditional-disagg threshold",))


# ---- workloads ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def _trace(items: tuple) -> tuple:
    return tuple(workloads.scaled_trace(**dict(items)))


def trace(params: dict) -> list:
    """bench.workloads.scaled_trace(**params) at time_scale 1 (cached: the GPU window takes seconds)."""
    return list(_trace(tuple(sorted(params.items()))))


def native_rate(reqs: list) -> float:
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    return (len(reqs) - 1) / span if span > 0 else float("inf")


def at_rate(reqs: list, rate: float) -> tuple[list, float]:
    """The same window with its arrival times stretched to ``rate`` req/s on average: exactly what
    ``scaled_trace(time_scale=...)`` gives, as arrivals scale linearly. Returns (requests, time_scale)."""
    scale = native_rate(reqs) / rate
    return [dataclasses.replace(r, arrival_s=r.arrival_s * scale) for r in reqs], scale


# ---- one run ------------------------------------------------------------------------------------------

def simulate_run(dep: Deployment, hw: Hardware, reqs: list, workload_desc: dict, slo: dict,
                 autoscaler: AutoscalerConfig | None = None) -> dict:
    """Simulate ``reqs`` on ``dep`` and return the benchmark JSON document (+ ``sim``)."""
    t0 = time.perf_counter()
    res = ClusterSim(dep, hw, reqs, autoscaler).run()
    first = min(f.arrival_s for f in res.flights)
    records = []
    for f in res.flights:
        ok = f.done_s is not None
        ttft = f.first_s - f.arrival_s if f.first_s is not None else None
        e2e = f.done_s - f.arrival_s if ok else None
        records.append({"index": f.index, "arrival_s": f.arrival_s - first, "prompt_tokens": len(f.prompt),
                        "output_tokens": f.output_len if ok else 0, "ttft_s": ttft,
                        "tpot_s": tpot_of(e2e, ttft, f.output_len) if ok else None, "e2e_s": e2e, "ok": ok,
                        "error": f.error})
    last = max((f.done_s for f in res.flights if f.done_s is not None), default=first)
    duration = last - first
    summary = summarize(records, duration, slo, itl_s=res.itl_s)
    summary["good_fraction"] = summary["goodput"] * duration / len(records) if records else 0.0
    return {
        "config": {**dep.to_json(), "hardware": hw.name},
        "workload": workload_desc,
        "slo": dict(slo),
        "duration_s": duration,
        "summary": summary,
        "requests": records,
        "sim": {"hardware": hw.describe(), "prefix_hit_rate": res.prefix_hit_rate(), "hit_sources": res.hit_sources(),
                "counters": res.counters,
                "autoscaler": res.autoscaling.summary() if res.autoscaling is not None else None,
                "wall_s": time.perf_counter() - t0},
    }


def workload_desc(params: dict, time_scale: float, num: int) -> dict:
    return {"name": "mooncake-conversation", **{k: v for k, v in params.items() if k != "vocab"},
            "vocab": params["vocab"], "time_scale": time_scale, "num_requests": num}
