"""What every simulator study shares: a deployment from its name, a run at a rate (each simulated once per
process), its row and goodput, and the tables and JSON files the studies write. ``python -m bench.sim`` (the
studies' command line, bench/sim/__main__.py) and the studies themselves import it."""
from __future__ import annotations

import json
import re
from pathlib import Path

from bench.sim.cluster import Deployment
from bench.sim.scenarios import Scenario, at_rate, simulate_run, trace, workload_desc
from bench.summary import meets_slo

OUT = Path(__file__).resolve().parents[2] / "build" / "bench" / "sim"
POLICY_NAMES = ("cache_aware", "least_loaded", "round_robin")


def parse_config(name: str, local_prefill_max_tokens: int, policy: str = "cache_aware") -> Deployment:
    """``colocated-4`` (4 workers that prefill and decode) or ``2P+2D``."""
    m = re.fullmatch(r"colocated-(\d+)", name)
    if m:
        return Deployment(name, 0, int(m[1]), policy, policy, local_prefill_max_tokens)
    m = re.fullmatch(r"(\d+)[pP]\+?(\d+)[dD]", name)
    if m and int(m[2]) >= 1:
        return Deployment(f"{m[1]}P+{m[2]}D", int(m[1]), int(m[2]), policy, policy, local_prefill_max_tokens)
    raise ValueError(f"config {name!r}: use colocated-N or NP+MD (M >= 1)")


def split_name(p: int, d: int) -> str:
    return f"colocated-{d}" if p == 0 else f"{p}P+{d}D"


_RUNS: dict[tuple, dict] = {}  # studies share runs (same scenario, deployment, rate): simulate each once


def run_at(sc: Scenario, dep: Deployment, rate: float, autoscaler=None) -> dict:
    key = (sc.name, tuple(sorted(sc.workload.items())), sc.hardware.num_blocks, sc.hardware.tiers, dep, rate,
           autoscaler)
    if key not in _RUNS:
        reqs, scale = at_rate(trace(sc.workload), rate)
        doc = simulate_run(dep, sc.hardware, reqs, workload_desc(sc.workload, scale, len(reqs)), sc.slo, autoscaler)
        doc["rate"] = rate
        _RUNS[key] = doc
    return _RUNS[key]


def goodput_at(doc: dict, slo: dict) -> float:
    """The run's goodput under other SLOs (from its per-request records)."""
    good = sum(1 for r in doc["requests"] if meets_slo(r, slo))
    return good / doc["duration_s"] if doc["duration_s"] > 0 else 0.0


def row(doc: dict, sc: Scenario, **extra) -> dict:
    s = doc["summary"]
    return {**extra, "config": doc["config"]["name"], "rate": doc.get("rate"), "goodput": s["goodput"],
            "goodput_strict": goodput_at(doc, sc.slo_strict), "good_fraction": s["good_fraction"],
            "ttft_mean": s["ttft_s"]["mean"], "ttft_p50": s["ttft_s"]["p50"], "ttft_p90": s["ttft_s"]["p90"],
            "tpot_p50": s["tpot_s"]["p50"], "tpot_p90": s["tpot_s"]["p90"], "throughput": s["request_throughput"],
            "hit_rate": doc["sim"]["prefix_hit_rate"], "failed": s["failed"]}


def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """Markdown table; ``cols`` = (key, header, format)."""
    out = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        out.append("| " + " | ".join("-" if r.get(k) is None else format(r[k], f) for k, _, f in cols) + " |")
    return "\n".join(out)


def pivot(rows: list[dict], key: str, fmt: str) -> str:
    """Configs down, rates across: one metric."""
    rates = sorted({r["rate"] for r in rows})
    configs = list(dict.fromkeys(r["config"] for r in rows))
    cells = {(r["config"], r["rate"]): r[key] for r in rows}
    out = ["| config | " + " | ".join(f"{x:g} req/s" for x in rates) + " |", "|---" * (len(rates) + 1) + "|"]
    for c in configs:
        out.append(f"| {c} | " + " | ".join("-" if cells.get((c, x)) is None else format(cells[(c, x)], fmt)
                                            for x in rates) + " |")
    return "\n".join(out)


def save(name: str, data: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path
