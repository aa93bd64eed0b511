"""bench-serve's report: the markdown tables and the summary lines printed at the end.

``report["searches"]`` holds, per workload and configuration, one goodput search (bench/goodput_search.py,
``SearchResult.to_dict`` with every probe's rate, attainment and p90 TTFT / TPOT). The ratio is duet's best
goodput (disaggregated or colocated) over vLLM CPU's on the same workload; a search that never passed
counts as 0, and one whose first vLLM probe failed leaves the ratio undefined (n/a), never guessed.
"""
from __future__ import annotations

import os
import platform

from bench.sim.calibrate import cpu_model_name

SEARCHED = ("random", "shared-prefix")  # the workloads whose rate is searched; the ratio line's is the last
TRACE = "mooncake-conversation"


def machine() -> dict:
    return {"cpu": cpu_model_name(), "cores": os.cpu_count(), "python": platform.python_version(), "gpu": None}


def ms_text(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def _s1(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:.1f} %"


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def duet_over_vllm(by_config: dict[str, dict]) -> tuple[float | None, str]:
    """(duet's best goodput / vLLM CPU's, the two goodputs as text); None with the reason when undefined."""
    duet = {c: r for c, r in by_config.items() if c.startswith("duet")}
    vllm = by_config.get("vllm-cpu")
    if not duet or vllm is None:
        return None, f"{'vLLM CPU' if vllm is None else 'duet'} was not measured in this run"
    best = max(duet, key=lambda c: duet[c]["goodput_rps"] or 0.0)
    pair = f"{best} {duet[best]['label']} / vllm-cpu {vllm['label']} req/s"
    if duet[best]["lowest_failing_rps"] is None or vllm["lowest_failing_rps"] is None:
        pair += " (a search that never failed gives only a lower bound)"
    if not vllm["goodput_rps"]:
        return None, f"vLLM CPU failed its first probe: {pair}"
    return (duet[best]["goodput_rps"] or 0.0) / vllm["goodput_rps"], pair


def summary_lines(report: dict) -> list[str]:
    """One line per workload (each configuration's goodput; the trace's attainment), the ratio line last."""
    slo, searches = report["slo"], report.get("searches") or {}
    lines = []
    for wl in SEARCHED:
        if wl in searches:
            ratio, _ = duet_over_vllm(searches[wl])
            lines.append(f"goodput {wl} (req/s, >= 90 % in SLO): "
                         + ", ".join(f"{c} {r['label']}" for c, r in searches[wl].items())
                         + f"; duet's best / vLLM: {_fmt(ratio)}")
    trace = [r for r in report["runs"] if r["workload"] == TRACE and not r.get("study")]
    if trace:
        lines.append(f"trace (its own arrival times, TTFT <= {ttft_text(report['trace_slo'])}): in SLO "
                     + ", ".join(f"{r['config']} {r['summary']['good_fraction'] * 100:.0f} % "
                                 f"({r['summary']['goodput']:.3f} req/s)" for r in trace))
    ratio, pair = duet_over_vllm(searches.get("shared-prefix", {}))
    slo_text = f"TTFT <= {ttft_text(slo)} and TPOT <= {slo['tpot_s']} s"
    lines.append(f"ratio: {ratio:.2f} (duet's best DistServe goodput / vLLM CPU's, shared-prefix workload: {pair}; "
                 f">= 90 % of requests within {slo_text})" if ratio is not None else f"ratio: n/a ({pair})")
    return lines


def _probe(p: dict) -> str:
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
    return f"{p['rate_rps']:g}: {p['attainment'] * 100:.0f} % ({ms(p['ttft_p90_s'])} / {ms(p['tpot_p90_s'])})"


def markdown(report: dict) -> str:
    lines = [f"bench-serve, {report['date']}, {report['machine']['cores']} cores ({report['machine']['cpu']}), "
             f"SLO TTFT <= {ttft_text(report['slo'])} (trace: {ttft_text(report['trace_slo'])}), TPOT <= {report['slo']['tpot_s']} s, "
             f"{report['elapsed_s'] / 60:.0f} min"]
    searches = report.get("searches") or {}
    if searches:
        lines += ["", "DistServe goodput: the highest Poisson rate with >= 90 % of requests within both SLOs, "
                  "found by search (every probe listed):", "",
                  "| workload | config | goodput req/s | search stopped | probes: rate req/s: in SLO (TTFT p90 / TPOT p90 ms) |",
                  "|---|---|---|---|---|"]
        for wl, by in searches.items():
            for cfg, r in by.items():
                lines.append(f"| {wl} | {cfg} | **{r['label']}** | {r['stopped']} | "
                             + "; ".join(_probe(p) for p in r["probes"]) + " |")
    lines += ["", "| config | workload | client | rate req/s | ok | in SLO | good req/s | out tok/s | "
              "TTFT p50 / p90 / p99 ms | TPOT p50 / p90 ms | ITL p50 ms | E2E p50 s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        s = r["summary"]
        t = s["ttft_s"]
        q = s["tpot_s"]

        def m(v):
            return "-" if v is None else f"{v * 1000:.0f}"

        lines.append(f"| {r['config']} | {r['workload']}{' (' + r['study'] + ')' if r.get('study') else ''} | "
                     f"{r['client']} | {r['rate'] if r.get('rate') else 'trace' if r['workload'].startswith('mooncake') else 'closed loop'} | "
                     f"{s['completed']}/{s['completed'] + s['failed']} | {_pct(s.get('good_fraction'))} | "
                     f"{s['goodput']:.3f} | {s['output_throughput']:.1f} | "
                     f"{m(t['p50'])} / {m(t['p90'])} / {m(t['p99'])} | {m(q['p50'])} / {m(q['p90'])} | "
                     f"{m(s['itl_s']['p50'])} | {_s1(s['e2e_s']['p50'])} |")
    for conc, ag in (report.get("agreement") or {}).items():
        lines += ["", f"Client agreement at concurrency {conc} (duet bench vs vLLM's client, same workload and server; gap = "
                  "(duet bench - vLLM) / vLLM of the medians of 3 runs each, alternating which client goes first; "
                  "noise = the larger (max - min) / median of one client's own 3 runs):", "", "| metric | duet bench | vLLM client | gap | noise |", "|---|---|---|---|---|"]
        for k in ag["gap"]:
            a, b = ag["per_run"]["duet bench"][k], ag["per_run"]["vllm.benchmarks.serve"][k]
            fmt = (lambda v: f"{v * 1000:.1f} ms") if k.endswith("_s") else (lambda v: f"{v:.2f} tok/s")
            lines.append(f"| {k} | {', '.join(fmt(v) for v in a)} | {', '.join(fmt(v) for v in b)} | "
                         f"{ag['gap'][k] * 100:+.1f} % | {_pct(ag['noise'][k])} |")
    rt = report.get("routing")
    if rt:
        lines += ["", "Prefill routing, duet 2 prefill + 1 decode, shared-prefix workload:", "",
                  "| policy | good req/s | TTFT p50 / p90 ms | prefill workers (requests, computed / cached prompt tokens) |",
                  "|---|---|---|---|"]
        for pol, d in rt.items():
            s = d["summary"]
            ws = "; ".join(", ".join(f"{k} {v}" for k, v in w.items() if k != "worker") for w in d["prefill"])
            lines.append(f"| {pol} | {s['goodput']:.3f} | {s['ttft_s']['p50'] * 1000:.0f} / "
                         f"{s['ttft_s']['p90'] * 1000:.0f} | {ws} |")
    return "\n".join(lines)


def ttft_text(slo: dict) -> str:
    """The TTFT target in words: flat, or growing with the prompt."""
    per_token = slo.get("ttft_per_token_s", 0.0)
    return f"{slo['ttft_s']:g} s" + (f" + {per_token * 1000:g} ms x prompt tokens" if per_token else "")
