"""Disaggregated goodput, simulated: duet's real router, prefix index, block pools, scheduler and autoscaler
policy replay the Mooncake trace with the model replaced by a calibrated step-time model.

    python -m bench.sim all [--hardware cpu,gpu]            # studies a-c on both scenarios (~2-3 min)
    python -m bench.sim disagg    [--hardware cpu|gpu]      # a. disaggregated vs colocated, rate sweep
    python -m bench.sim autoscale [--hardware cpu|gpu]      # b. autoscaler vs every fixed P:D split
    python -m bench.sim routing   [--hardware cpu|gpu]      # c. cache_aware vs least_loaded vs round_robin
    python -m bench.sim tiers --hardware gpu [--configs colocated-4,colocated-8] [--arms abcd]
                                                                 # d. KV tiers and peers (bench/sim/tiers_study.py)
    python -m bench.sim tier-weights --hardware gpu [--config colocated-4] [--rate 4] [--alphas 4]
                                 [--weights "1,1,1;0.75,0.25,0.5"] [--start N]  # d2. the routing weights on tiers
    python -m bench.sim kv-dtype --hardware gpu [--configs colocated-4,2P+2D]
                                 # f. a quantized KV cache: capacity, hit rate, goodput (bench/sim/kv_dtype_study.py)
    python -m bench.sim goodput [--hardware cpu,gpu] [--budgets 4,8] [--workloads mooncake,burst,shift] [--jobs 2]
                                 # e. DistServe goodput: the autoscaler vs the best fixed split
                                 # (bench/sim/goodput_study.py)
                                 [--reuse-fixed build/sim/goodput.json[,...]]  # a policy change: the autoscaler only
    python -m bench.sim goodput-trace --hardware cpu --budgets 8 --workloads mooncake --rate 3.54 \
                                 [--only 6P+2D,auto]
                                 # one run per configuration of a case at one rate: windows met, the autoscaler's moves
    python -m bench.sim run --config 2P+2D --rate 1.0 [--hardware cpu] [--policy round_robin] [--out F]
    python -m bench.sim calibration-check --real build/bench/serve/duet-disagg-1p1d-trace.json

Scenarios (bench/sim/scenarios.py): ``cpu`` = this machine's engine (bench/sim/calibration/cpu-smollm2.json)
on the CPU-scaled trace; ``gpu`` = Llama-3.1-8B on H100s from a roofline, on the full-size trace. Goodput
counts requests meeting both the TTFT and the TPOT target per second (DistServe). Each study prints a
table and writes JSON under build/bench/sim/ (per run: the benchmark document ``duet bench`` writes, so a
simulated run and a real run compare field by field). docs/simulator.md has the model and the results.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from bench.sim.calibration_check import calibration_check
from bench.sim.cluster import Deployment
from bench.sim.goodput_study import (
    SHORT_WINDOW_INTERVALS,
    WORKLOADS,
    load_fixed,
    plot,
    report,
    reused_limit,
    study_goodput,
    trace_case,
)
from bench.sim.kv_dtype_study import study_kv_dtype
from bench.sim.runs import OUT, POLICY_NAMES, parse_config, pivot, row, run_at, save, split_name, table
from bench.sim.scenarios import (
    CALIBRATION,
    Scenario,
    cpu_scenario,
    gpu_scenario,
)
from bench.sim.tiers_study import TIER_WEIGHT_GRID, study_tiers, sweep_tier_weights


def _slo(slo: dict) -> str:
    return f"TTFT <= {slo['ttft_s']:g} s, TPOT <= {slo['tpot_s']:g} s"


def study_disagg(sc: Scenario, out_dir: Path) -> dict:
    """a. Disaggregated vs colocated with the same number of workers (2, and every split of the budget),
    over the rate sweep."""
    n = sc.budget
    configs = [split_name(0, 2), split_name(1, 1)] + [split_name(p, n - p) for p in range(n)]
    runs, rows = [], []
    for name in configs:
        for rate in sc.rates:
            doc = run_at(sc, parse_config(name, sc.local_prefill_max_tokens), rate)
            runs.append(doc)
            rows.append(row(doc, sc))
    text = "\n\n".join([
        f"goodput, req/s ({_slo(sc.slo)}):\n" + pivot(rows, "goodput", ".3f"),
        "requests meeting both SLOs:\n" + pivot(rows, "good_fraction", ".0%"),
        f"goodput, req/s, strict TPOT ({_slo(sc.slo_strict)}):\n" + pivot(rows, "goodput_strict", ".3f"),
        "TTFT p90, s:\n" + pivot(rows, "ttft_p90", ".2f"),
        "TPOT p90, s:\n" + pivot(rows, "tpot_p90", ".3f")])
    print(f"\n## a. disaggregated vs colocated ({sc.name})\n{text}")
    save(f"{sc.name}-disagg", {"study": "disagg", "scenario": sc.describe(), "rows": rows, "table": text,
                               "runs": runs}, out_dir)
    return {"rows": rows, "table": text}


def study_autoscale(sc: Scenario, out_dir: Path, rates: tuple[float, ...] | None = None) -> dict:
    """b. The autoscaler (starting at 1P+1D, budget ``autoscaler.budget``) vs every fixed split of the budget."""
    budget = sc.autoscaler.budget
    rates = rates or sc.autoscale_rates
    runs, rows = [], []
    for rate in rates:
        for p in range(0, budget):
            doc = run_at(sc, parse_config(split_name(p, budget - p), sc.local_prefill_max_tokens), rate)
            runs.append(doc)
            rows.append(row(doc, sc, mean_prefill=p, mean_decode=budget - p, workers=budget))
        best = max(rows[-budget:], key=lambda r: r["goodput"])
        best["best_fixed"] = True
        doc = run_at(sc, Deployment("autoscaler", 1, 1, local_prefill_max_tokens=sc.local_prefill_max_tokens), rate,
                     autoscaler=sc.autoscaler)
        runs.append(doc)
        a = doc["sim"]["autoscaler"]
        rows.append(row(doc, sc, mean_prefill=a["mean_prefill_ready"], mean_decode=a["mean_decode_ready"],
                        workers=a["mean_workers_provisioned"], decisions=len(a["decisions"]),
                        path=_path(a["decisions"]), final=a["final"]))
    cols = [("rate", "rate req/s", ".2f"), ("config", "config", ""), ("goodput", "goodput req/s", ".3f"),
            ("good_fraction", "met SLO", ".0%"), ("mean_prefill", "P (mean)", ".2f"),
            ("mean_decode", "D (mean)", ".2f"), ("workers", "workers (mean)", ".2f"), ("ttft_p90", "TTFT p90 s", ".2f"),
            ("tpot_p90", "TPOT p90 s", ".3f")]
    text = table([dict(r, config=r["config"] + (" (best fixed)" if r.get("best_fixed") else "")) for r in rows], cols)
    paths = [f"autoscaler at {r['rate']:g} req/s: {r['path']}" for r in rows if r.get("path")]
    text += "\n\n" + "\n".join(paths)
    print(f"\n## b. autoscaler vs fixed P:D splits of {budget} workers ({sc.name}; {_slo(sc.slo)}; "
          f"autoscaler starts at 1P+1D, workers start in {sc.hardware.startup_s:g} s)\n{text}")
    save(f"{sc.name}-autoscale", {"study": "autoscale", "scenario": sc.describe(), "rows": rows, "table": text,
                                  "runs": runs}, out_dir)
    return {"rows": rows, "table": text}


def _path(decisions: list[dict]) -> str:
    """The pool sizes the autoscaler moved through: ``t=40s P2 (code), t=90s D2 (code), ...``."""
    return ", ".join(f"t={d['t_s']:.0f}s {d['role'][0].upper()}{d['target']} ({d['code']})" for d in decisions) or "none"


def study_routing(sc: Scenario, out_dir: Path, rate: float | None = None, kv_factor: int = 8) -> dict:
    """c. Routing policies on the same workers (prefill and decode pools use the same policy), with the
    default KV cache per worker and with ``kv_factor`` times as many blocks."""
    rate = rate or sc.rates[len(sc.rates) // 2]
    n = sc.budget
    runs, rows = [], []
    big = dataclasses.replace(sc, hardware=dataclasses.replace(sc.hardware,
                                                               num_blocks=sc.hardware.num_blocks * kv_factor))
    for kv, scen in ((1, sc), (kv_factor, big)):
        for name in (split_name(n // 2, n - n // 2), split_name(0, n)):
            for policy in POLICY_NAMES:
                doc = run_at(scen, parse_config(name, sc.local_prefill_max_tokens, policy), rate)
                runs.append(doc)
                c = doc["sim"]["counters"]
                rows.append(row(doc, sc, policy=policy, kv=f"x{kv} ({scen.hardware.num_blocks})",
                                transferred=c["transferred_blocks"]))
    cols = [("kv", "KV blocks/worker", ""), ("config", "config", ""), ("policy", "policy", ""),
            ("hit_rate", "prefix hit rate", ".1%"), ("ttft_mean", "TTFT mean s", ".2f"),
            ("ttft_p90", "TTFT p90 s", ".2f"), ("tpot_p90", "TPOT p90 s", ".3f"), ("goodput", "goodput req/s", ".3f"),
            ("good_fraction", "met SLO", ".0%"), ("transferred", "KV blocks moved", "d")]
    text = table(rows, cols)
    print(f"\n## c. routing policies at {rate:g} req/s ({sc.name}; {_slo(sc.slo)})\n{text}")
    save(f"{sc.name}-routing", {"study": "routing", "scenario": sc.describe(), "rate": rate, "rows": rows,
                                "table": text, "runs": runs}, out_dir)
    return {"rows": rows, "table": text}


def scenarios(names: str, args: argparse.Namespace) -> list[Scenario]:
    out = []
    for name in names.split(","):
        if name == "cpu":
            out.append(cpu_scenario(args.calibration, limit=args.limit or 1000))
        elif name == "gpu":
            out.append(gpu_scenario(limit=args.limit or 1000, link=args.link))
        else:
            raise SystemExit(f"unknown hardware {name!r} (cpu, gpu)")
    start = getattr(args, "start", 0) or 0
    return [dataclasses.replace(sc, workload={**sc.workload, "start": start}) if start else sc for sc in out]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("study", choices=["all", "disagg", "autoscale", "routing", "tiers", "tier-weights", "kv-dtype",
                                      "goodput",
                                      "goodput-trace", "run", "calibration-check"])
    ap.add_argument("--hardware", default=None, help="cpu, gpu or cpu,gpu (default: both for all, else cpu)")
    ap.add_argument("--limit", type=int, help="trace window (requests; default 1000)")
    ap.add_argument("--link", default="rdma", choices=["rdma", "nvlink"], help="GPU KV transfer link")
    ap.add_argument("--calibration", type=Path, default=CALIBRATION)
    ap.add_argument("--out-dir", type=Path, default=OUT)
    ap.add_argument("--config", default="2P+2D", help="run: colocated-N or NP+MD")
    ap.add_argument("--rate", type=float, help="run: request rate (req/s); default the scenario's middle rate")
    ap.add_argument("--policy", default="cache_aware", choices=POLICY_NAMES)
    ap.add_argument("--configs", default="colocated-4,colocated-8", help="tiers: the worker configurations")
    ap.add_argument("--arms", default="abcd", help="tiers: (a) device, (b) +host, (c) +host+peers, (d) +disk, "
                    "(e) +int8 host+peers (the host keeps int8 under a bf16 device)")
    ap.add_argument("--host-gib", type=float, default=128.0, help="tiers: host tier per worker, GiB")
    ap.add_argument("--disk-gib", type=float, default=1024.0, help="tiers: disk tier per worker, GiB")
    ap.add_argument("--alphas", default="1,2,4,8", help="tier-weights: the alphas (one: held, no alpha sweep)")
    ap.add_argument("--weights", help="tier-weights: host,disk,peer triples separated by ';' (default: "
                    "bench/sim/tiers_study.py TIER_WEIGHT_GRID)")
    ap.add_argument("--start", type=int, default=0, help="the trace window's first request (default 0)")
    ap.add_argument("--budgets", default="4,8", help="goodput: worker budgets")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="goodput: workloads")
    ap.add_argument("--jobs", type=int, default=1, help="goodput: searches run in this many processes")
    ap.add_argument("--reuse-fixed", help="goodput: saved goodput.json files (comma-separated) whose fixed splits and "
                    "colocated rows are reused (they do not depend on the autoscaler's policy): only the autoscaler is "
                    "searched, on as many requests as the saved rows measured")
    ap.add_argument("--only", help="goodput-trace: configurations whose names start with these (comma-separated; "
                    "e.g. 6P+2D,autoscaler)")
    ap.add_argument("--out", type=Path, help="run: write the benchmark JSON here")
    ap.add_argument("--real", type=Path, help="calibration-check: a real run's JSON (duet bench)")
    ap.add_argument("--workload", type=Path, help="calibration-check: the workload JSONL, when the real JSON's "
                    "workload parameters cannot rebuild it")
    ap.add_argument("--threads", type=int, help="calibration-check: which fit of the calibration JSON (torch threads "
                    "per worker; default 1, see bench/sim/calibration_check.py)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.study == "calibration-check":
        if args.real is None:
            ap.error("calibration-check needs --real")
        calibration_check(args.real, args.workload, args.threads, args.calibration, args.out_dir)
        return
    hw = args.hardware or ("cpu,gpu" if args.study in ("all", "goodput") else "cpu")
    if args.study == "goodput-trace":  # one goodput case at one rate: what its windows came from
        for sc in scenarios(hw, args):
            for budget in (int(b) for b in args.budgets.split(",")):
                for wl in args.workloads.split(","):
                    print(f"## {sc.name}, budget {budget}, {wl}, {args.rate} req/s")
                    print(trace_case(sc, budget, wl, args.rate or sc.autoscale_rates[0] * budget / 4,
                                     tuple(filter(None, (args.only or "").split(",")))))
        return
    if args.study == "goodput":
        reuse = load_fixed(args.reuse_fixed.split(",")) if args.reuse_fixed else None
        cases = []
        for name in hw.split(","):  # one study per number of requests: the saved rows' may differ by budget
            limits: dict[int | None, list[int]] = {}
            for b in (int(b) for b in args.budgets.split(",")):
                limits.setdefault(reused_limit(reuse, name, b, args.limit), []).append(b)
            for limit, budgets in limits.items():
                scs = scenarios(name, argparse.Namespace(**{**vars(args), "limit": limit}))
                cases += study_goodput(scs, tuple(budgets), tuple(args.workloads.split(",")), args.jobs, reuse)
        text = report(cases)
        print(f"\n## e. DistServe goodput (>= 90 % of requests meet both SLOs): autoscaler vs the best fixed split\n{text}")
        save("goodput", {"study": "goodput", "cases": cases, "table": text}, args.out_dir)
        plot(cases, args.out_dir / "goodput.png")
        lowest = min(cases, key=lambda c: c["lowest_ratio"])
        print(f"total {time.perf_counter() - t0:.0f} s; JSON in {args.out_dir}", file=sys.stderr)
        print(f"ratio: {lowest['lowest_ratio']:.3f} (lowest autoscaler / best-fixed-split goodput, per window and "
              f"overall, over {len(cases)} cases; lowest: {lowest['scenario']} budget {lowest['budget']} "
              f"{lowest['workload']}; over windows of at least {SHORT_WINDOW_INTERVALS} intervals only: "
              f"{min(c['lowest_ratio_long_windows'] for c in cases):.3f})")
        return
    for sc in scenarios(hw, args):
        if args.study == "run":
            doc = run_at(sc, parse_config(args.config, sc.local_prefill_max_tokens, args.policy),
                         args.rate or sc.rates[len(sc.rates) // 2])
            from bench.client import format_summary  # duet bench's own report of a result document

            print(format_summary(doc))
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(doc, indent=1) + "\n")
            continue
        t1 = time.perf_counter()
        if args.study in ("all", "disagg"):
            study_disagg(sc, args.out_dir)
        if args.study in ("all", "autoscale"):
            study_autoscale(sc, args.out_dir)
        if args.study in ("all", "routing"):
            study_routing(sc, args.out_dir)
        if args.study == "tiers":
            study_tiers(sc, args.out_dir, tuple(args.configs.split(",")), args.arms, args.host_gib * 2**30,
                        args.disk_gib * 2**30)
        if args.study == "kv-dtype":
            configs = args.configs if args.configs != "colocated-4,colocated-8" else "colocated-4,2P+2D"
            study_kv_dtype(sc, args.out_dir, tuple(configs.split(",")), args.link)
        if args.study == "tier-weights":
            grid = (tuple(tuple(float(x) for x in t.split(",")) for t in args.weights.split(";"))
                    if args.weights else TIER_WEIGHT_GRID)
            sweep_tier_weights(sc, args.out_dir, args.config if args.config != "2P+2D" else "colocated-4", args.rate,
                               tuple(float(a) for a in args.alphas.split(",")), grid)
        print(f"({sc.name}: {time.perf_counter() - t1:.0f} s)")
    print(f"total {time.perf_counter() - t0:.0f} s; JSON in {args.out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
