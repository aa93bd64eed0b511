"""DistServe goodput in the simulator: the autoscaler against the best fixed P:D split, per window and overall.

    python -m bench.sim goodput [--hardware cpu,gpu] [--budgets 4,8] [--workloads mooncake,burst,shift]
                                     [--limit N] [--jobs J]

Goodput is DistServe's: the highest request rate at which >= 90 % of requests meet both the TTFT and the TPOT
target (bench/goodput_search.py holds the definition, shared with ``make bench-serve``). Each
configuration's rate is searched on a geometric grid (``GRID_STEP`` apart: exponential steps from a first
guess, then bisection: ``goodput_search.highest``), assuming attainment falls as the rate grows. Per
window: the requests are cut into ``WINDOWS`` equal slices in arrival order (the same requests at every
rate), and a window's goodput is the highest grid rate at which >= 90 % *of that window's* requests meet
both targets — so a configuration that is right for one phase of a workload and wrong for another shows it.

Configurations at budget B: every fixed split pP+(B-p)D, p = 1 .. B-1 (the best of them per window and
overall is the baseline), the autoscaler (cluster.autoscaler.decide with min 1 / max B-1 per role and
``max_total_workers`` B, started at an even split), and colocated-B as a reference (not a P:D split: reported,
not in the ratio). Every configuration first serves a warm-up that is not counted (``make_warmup``:
as many requests again, the trace's next ones, shaped as the workload's first phase, at the same rate): a
cluster meets a change of load from the split that fitted the load before it, and the windows measure how
the autoscaler follows the workload's changes — not how far an arbitrary starting split is from the first
window's best.

Workloads, from the scenario's Mooncake window (bench/sim/scenarios.py):
- ``mooncake``: the trace as it is;
- ``burst``: the third quarter of the requests arrives 3x as fast (the arrival gaps there divided by 3);
- ``shift``: the input/output mix turns over at half-time — the first half prompt-heavy (outputs / 4), the
  second half decode-heavy (prompts cut to a quarter, whole blocks; outputs x 4 up to the scenario's cap).
"""
from __future__ import annotations

import dataclasses
import json
import math
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.goodput_search import ATTAINMENT, highest, passes
from bench.sim.cluster import Deployment
from bench.sim.scenarios import Scenario, at_rate, simulate_run, trace, workload_desc
from bench.summary import meets_slo

# SLOs of this study: the TTFT target grows with the prompt (bench.summary.meets_slo), because the idle
# cluster itself misses a flat target on the trace's long prompts (CPU idle TTFT p90 5 s, GPU 1.3 s, p99 6.6 s)
# and 90 % attainment would then be out of reach at any rate. Idle attainment with these: 0.99 (both).
GOODPUT_SLO = {"cpu": {"ttft_s": 2.0, "ttft_per_token_s": 0.010, "tpot_s": 0.25},
               "gpu": {"ttft_s": 1.0, "ttft_per_token_s": 0.0001, "tpot_s": 0.05}}
WINDOWS = 4
# the autoscaler's interval here (the default since 2026-11-27; the scenarios' 10 s is study b's): the GPU model's
# budget-8 windows last 11-26 s, and a move needs two agreeing intervals and a flip (docs/simulator.md e)
INTERVAL_S = 5.0
GRID_STEP = 1.1
WORKLOADS = ("mooncake", "burst", "shift")
WARMUP = 1.0  # warm-up requests served before the measured ones, per measured request (not counted)
# Near the bar one run's attainment is chaotic: a 0.1 % change of rate moves the arrivals enough to swing it by
# 3-5 points (docs/simulator.md e). A grid point whose overall or any window's attainment lies within NEAR of
# the bar is run twice more at these rate factors, and each attainment is the median of the three — for every
# configuration alike (fixed splits, autoscaler, colocated). Without it the per-window baseline, the best of
# 7 fixed splits, is the maximum of noisy values: biased upward by the noise itself.
NEAR = 0.05
JITTER = (0.99, 1.01)
# A window shorter than this many autoscaler intervals (at its baseline's rate) is reported, and counted in the
# ratio, but also named: the autoscaler moves after two agreeing intervals and a flip, so such a window measures
# the backlog the run carries into it rather than whether the split follows the load (docs/simulator.md e)
SHORT_WINDOW_INTERVALS = 6


def spread(reqs: list) -> list:
    """The trace's timestamps lie on a 3-second grid (bursts of up to 28 requests at one instant, whatever the
    rate): requests that share a timestamp are spread evenly until the next one, so a slower rate really is
    less load (docs/simulator.md). Order and mean rate are kept."""
    out, i = [], 0
    while i < len(reqs):
        j = i
        while j < len(reqs) and reqs[j].arrival_s == reqs[i].arrival_s:
            j += 1
        t0 = reqs[i].arrival_s
        gap = (reqs[j].arrival_s - t0) if j < len(reqs) else 0.0
        out += [dataclasses.replace(r, arrival_s=t0 + gap * (m / (j - i))) for m, r in enumerate(reqs[i:j])]
        i = j
    return out


def make_workload(name: str, sc: Scenario) -> list:
    """The scenario's trace window (its grid spread out) reshaped as ``name``, at the trace's own time scale."""
    reqs = spread(trace(sc.workload))
    n = len(reqs)
    if name == "mooncake":
        return reqs
    if name == "burst":
        lo, hi = n // 2, 3 * n // 4
        out, shift = [], 0.0
        for i, r in enumerate(reqs):
            if lo < i < hi:
                gap = r.arrival_s - reqs[i - 1].arrival_s
                shift += gap - gap / 3
            out.append(dataclasses.replace(r, arrival_s=r.arrival_s - shift))
        return out
    if name == "shift":
        B, cap = sc.workload["block_tokens"], sc.workload["max_output"]
        out = []
        for i, r in enumerate(reqs):
            if i < n // 2:
                out.append(dataclasses.replace(r, output_len=max(1, r.output_len // 4)))
            else:
                keep = max(B, len(r.prompt) // 4 // B * B) if len(r.prompt) > B else len(r.prompt)
                out.append(dataclasses.replace(r, prompt=r.prompt[:keep], output_len=min(cap, r.output_len * 4)))
        return out
    raise ValueError(f"workload {name!r}: use one of {', '.join(WORKLOADS)}")


def make_warmup(name: str, sc: Scenario) -> list:
    """What the cluster served before the measured requests (``WARMUP`` of their number): the trace's requests
    right after the scenario's window (other prompts: no cache hits on the measured ones), shaped as the
    workload's first phase. A cluster meets a workload's changes from a split that fitted what came before,
    not from an arbitrary one: the windows then measure how the autoscaler follows a change, not its start."""
    n = sc.workload["limit"]
    reqs = spread(trace({**sc.workload, "start": sc.workload.get("start", 0) + n, "limit": max(1, round(n * WARMUP))}))
    if name == "shift":
        reqs = [dataclasses.replace(r, output_len=max(1, r.output_len // 4)) for r in reqs]
    return reqs


def with_warmup(warm: list, reqs: list) -> list:
    """``warm`` then ``reqs`` on one timeline (each from 0; ``reqs`` one mean gap after the last warm-up)."""
    gap = (reqs[-1].arrival_s - reqs[0].arrival_s) / max(1, len(reqs) - 1)
    w0, r0 = warm[0].arrival_s, reqs[0].arrival_s
    offset = warm[-1].arrival_s - w0 + gap
    return ([dataclasses.replace(r, arrival_s=r.arrival_s - w0) for r in warm]
            + [dataclasses.replace(r, arrival_s=r.arrival_s - r0 + offset) for r in reqs])


def attainment(doc: dict, slo: dict, windows: int = WINDOWS, skip: int = 0) -> tuple[float, list[float]]:
    """(overall, per window) fraction of requests meeting both targets; windows in arrival order; requests
    with an index below ``skip`` (a warm-up) are not counted."""
    recs = sorted((r for r in doc["requests"] if r["index"] >= skip), key=lambda r: r["index"])
    good = [bool(r["ok"] and meets_slo(r, slo)) for r in recs]
    n = len(good)
    cuts = [round(k * n / windows) for k in range(windows + 1)]
    per = [sum(good[a:b]) / (b - a) if b > a else 1.0 for a, b in zip(cuts, cuts[1:])]
    return (sum(good) / n if n else 0.0), per


def run_at_rate(sc: Scenario, dep: Deployment, autoscaler, reqs: list, warm: list,
                rate: float) -> tuple[dict, float, list[float]]:
    """One run: ``warm`` then ``reqs`` with the measured requests at ``rate`` req/s (their rate sets the time scale);
    (the run's document, attainment overall, per window — the warm-up not counted)."""
    _, scale = at_rate(reqs, rate)
    timeline = [dataclasses.replace(r, arrival_s=r.arrival_s * scale)
                for r in (with_warmup(warm, reqs) if warm else reqs)]
    slo = GOODPUT_SLO[sc.name]
    doc = simulate_run(dep, sc.hardware, timeline, workload_desc(sc.workload, scale, len(timeline)), slo, autoscaler)
    overall, per = attainment(doc, slo, skip=len(warm))
    return doc, overall, per


@dataclasses.dataclass
class Search:
    """One configuration's goodput search on one workload (runs cached by grid index)."""

    sc: Scenario
    reqs: list
    dep: Deployment
    autoscaler: object = None
    base_rate: float = 1.0
    warm: list = dataclasses.field(default_factory=list)  # served first, not counted (make_warmup)
    runs: dict = dataclasses.field(default_factory=dict)  # k -> (overall, per window, summary extras)
    simulated: int = 0  # simulated runs (up to 3 per grid point: NEAR)

    def rate(self, k: int) -> float:
        return self.base_rate * GRID_STEP ** k

    def measure(self, k: int) -> tuple[float, list[float]]:
        if k not in self.runs:
            first = self._run(self.rate(k))
            if any(abs(a - ATTAINMENT) <= NEAR for a in (first[0], *first[1])):
                runs = [first, *(self._run(self.rate(k) * f) for f in JITTER)]
                med = lambda values: sorted(values)[1]  # noqa: E731
                first = (med([r[0] for r in runs]), [med([r[1][w] for r in runs]) for w in range(WINDOWS)], first[2])
            self.runs[k] = first
        return self.runs[k][:2]

    def _run(self, rate: float) -> tuple[float, list[float], dict]:
        self.simulated += 1
        doc, overall, per = run_at_rate(self.sc, self.dep, self.autoscaler, self.reqs, self.warm, rate)
        auto = doc["sim"]["autoscaler"]
        return overall, per, ({"mean_prefill": auto["mean_prefill_ready"], "mean_decode": auto["mean_decode_ready"],
                               "decisions": len(auto["decisions"])} if auto else {})

    def goodput(self, guess: int = 0) -> dict:
        overall = highest(lambda k: passes(self.measure(k)[0]), guess)
        g = overall if overall is not None else guess
        per = [highest(lambda k, w=w: passes(self.measure(k)[1][w]), g) for w in range(WINDOWS)]
        at = self.runs.get(overall, (None, None, {}))[2] if overall is not None else {}
        return {"config": self.dep.name, "goodput": self._r(overall), "windows": [self._r(k) for k in per],
                "runs": self.simulated, "requests": len(self.reqs),
                **({"interval_s": self.autoscaler.interval_s} if self.autoscaler is not None else {}), **at}

    def _r(self, k: int | None) -> float:
        return 0.0 if k is None else round(self.rate(k), 4)


def autoscaler_config(sc: Scenario, budget: int):
    """The scenario's autoscaler at this budget, given the SLOs the study judges by: a TTFT target per request
    (a base and a term per prompt token) and the TPOT target as its ITL SLO."""
    slo = GOODPUT_SLO[sc.name]
    return dataclasses.replace(sc.autoscaler, min_prefill=1, max_prefill=budget - 1, min_decode=1,
                               max_decode=budget - 1, max_total_workers=budget, ttft_slo_s=slo["ttft_s"],
                               ttft_slo_per_token_s=slo["ttft_per_token_s"], itl_slo_s=slo["tpot_s"],
                               interval_s=INTERVAL_S)


def configs(sc: Scenario, budget: int) -> list[tuple[Deployment, object]]:
    lp = sc.local_prefill_max_tokens
    out = [(Deployment(f"{p}P+{budget - p}D", p, budget - p, local_prefill_max_tokens=lp), None)
           for p in range(1, budget)]
    half = budget // 2
    out.append((Deployment(f"autoscaler ({half}P+{budget - half}D start)", half, budget - half,
                           local_prefill_max_tokens=lp), autoscaler_config(sc, budget)))
    out.append((Deployment(f"colocated-{budget}", 0, budget, local_prefill_max_tokens=lp), None))
    return out


def _search_task(args) -> dict:
    sc, workload, dep, auto, base = args
    return Search(sc, make_workload(workload, sc), dep, auto, base, make_warmup(workload, sc)).goodput()


def load_fixed(paths: list[str]) -> list[dict]:
    """The cases of saved studies (``--reuse-fixed``), several files merged; a case two files both hold is an error."""
    cases, seen = [], {}
    for path in paths:
        for c in json.loads(Path(path).read_text())["cases"]:
            key = (c["scenario"], c["budget"], c["workload"])
            if key in seen:
                raise SystemExit(f"{path} and {seen[key]} both hold the case {key}")
            seen[key] = path
            cases.append(c)
    return cases


def reused_limit(reuse: list[dict] | None, scenario: str, budget: int, limit: int | None) -> int | None:
    """The requests a case measures when saved rows are reused: as many as that scenario and budget's rows measured
    (a search on another number of requests is not comparable with them; budgets may differ: the H100 model's
    budget-8 windows need 1,000 requests to last 5-6 intervals). ``limit`` (``--limit``), if given, must agree."""
    rows = [r for c in reuse or () if c["scenario"] == scenario and c["budget"] == budget for r in c["configs"]]
    if any("requests" not in r for r in rows):
        raise SystemExit(f"saved {scenario} budget {budget} rows without their number of requests: cannot tell "
                         "whether they compare")
    counts = {r["requests"] for r in rows}
    if len(counts) > 1:
        raise SystemExit(f"the saved {scenario} budget {budget} rows measured different numbers of requests: "
                         f"{sorted(counts)}")
    if not counts:
        return limit
    (saved,) = counts
    if limit is not None and limit != saved:
        raise SystemExit(f"--limit {limit}, but the saved {scenario} budget {budget} rows measured {saved} requests")
    return saved


def study_goodput(scenarios: list[Scenario], budgets: tuple[int, ...], workloads: tuple[str, ...],
                  jobs: int = 1, reuse: list[dict] | None = None) -> list[dict]:
    """Every (scenario, budget, workload) case: each configuration's goodput, overall and per window, and
    the autoscaler's ratio to the best fixed split. ``reuse``: a saved study's cases, whose fixed splits and
    colocated rows are taken as they are (they do not depend on the autoscaler's policy): only the autoscaler
    is searched again. A case or configuration the saved study lacks is an error, not a silent re-run."""
    saved = {(c["scenario"], c["budget"], c["workload"], r["config"]): r for c in reuse or () for r in c["configs"]}
    tasks, keys, rows = [], [], []
    for sc in scenarios:
        base = sc.autoscale_rates[0]
        for budget in budgets:
            for wl in workloads:
                for dep, auto in configs(sc, budget):
                    key = (sc.name, budget, wl)
                    if reuse is not None and auto is None:
                        if (*key, dep.name) not in saved:
                            raise SystemExit(f"the saved study has no {dep.name} row for {key}")
                        row = saved[(*key, dep.name)]
                        if row["requests"] != sc.workload["limit"]:
                            raise SystemExit(f"the saved {dep.name} row for {key} measured {row['requests']} requests, "
                                             f"this run {sc.workload['limit']}")
                        rows.append((key, row))
                        continue
                    tasks.append((sc, wl, dep, auto, base * budget / 4))
                    keys.append(key)
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            results = list(pool.map(_search_task, tasks))
    else:
        results = [_search_task(t) for t in tasks]
    cases: dict[tuple, list[dict]] = {}
    for key, res in [*zip(keys, results), *rows]:
        cases.setdefault(key, []).append(res)
    return [best_of_fixed_and_ratio(key, rows) for key, rows in cases.items()]


def best_of_fixed_and_ratio(key: tuple, rows: list[dict]) -> dict:
    scenario, budget, wl = key
    fixed = [r for r in rows if "P+" in r["config"] and not r["config"].startswith("autoscaler")]
    auto = next(r for r in rows if r["config"].startswith("autoscaler"))
    coloc = next(r for r in rows if r["config"].startswith("colocated"))
    best = max(fixed, key=lambda r: r["goodput"])
    best_w = [max(r["windows"][w] for r in fixed) for w in range(WINDOWS)]
    ratio = auto["goodput"] / best["goodput"] if best["goodput"] else math.nan
    ratios_w = [a / b if b else math.nan for a, b in zip(auto["windows"], best_w)]
    # how long each window lasts at its baseline's rate, in the autoscaler's intervals: a window of one or two
    # intervals measures the backlog a run carries into it, not whether a control loop follows the load
    n, interval = auto.get("requests"), auto.get("interval_s")
    span = [round(n / WINDOWS / b / interval, 1) if n and interval and b else None for b in best_w]
    return {"scenario": scenario, "budget": budget, "workload": wl, "configs": rows,
            "best_fixed": best["config"], "best_fixed_goodput": best["goodput"], "best_fixed_windows": best_w,
            "autoscaler_goodput": auto["goodput"], "autoscaler_windows": auto["windows"],
            "colocated_goodput": coloc["goodput"], "ratio": ratio, "window_ratios": ratios_w,
            "lowest_ratio": min([ratio, *ratios_w]), "window_intervals": span,
            "lowest_ratio_long_windows": min([ratio, *(r for r, v in zip(ratios_w, span)
                                                       if v is None or v >= SHORT_WINDOW_INTERVALS)])}


def report(cases: list[dict]) -> str:
    """The table: per case the best fixed split, the autoscaler, colocated; goodput overall and per window."""
    def ws(values) -> str:
        return " / ".join(f"{v:.3g}" for v in values)

    lines = ["| hardware | budget | workload | best fixed split (req/s) | autoscaler (req/s) | ratio | per window: "
             "best fixed | per window: autoscaler | window ratios | window length (intervals) | colocated |",
             "|---" * 11 + "|"]
    for c in cases:
        lines.append(f"| {c['scenario']} | {c['budget']} | {c['workload']} | {c['best_fixed']} {c['best_fixed_goodput']:.3g}"
                     f" | {c['autoscaler_goodput']:.3g} | **{c['ratio']:.2f}** | {ws(c['best_fixed_windows'])} | "
                     f"{ws(c['autoscaler_windows'])} | {ws(c['window_ratios'])} | "
                     f"{ws(v for v in c.get('window_intervals') or () if v is not None) or '-'} | "
                     f"{c['colocated_goodput']:.3g} |")
    return "\n".join(lines)


def plot(cases: list[dict], path) -> None:
    """One panel per (hardware, budget): per window and overall, the best fixed split's goodput (bars) and
    the autoscaler's (dots), one colour per workload."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(c["scenario"], c["budget"]) for c in cases})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    labels = [f"w{w + 1}" for w in range(WINDOWS)] + ["all"]
    for ax, (scenario, budget) in zip(axes[0], panels):
        mine = [c for c in cases if (c["scenario"], c["budget"]) == (scenario, budget)]
        width = 0.8 / len(mine)
        for i, c in enumerate(mine):
            xs = [x + (i - (len(mine) - 1) / 2) * width for x in range(len(labels))]
            best = [*c["best_fixed_windows"], c["best_fixed_goodput"]]
            auto = [*c["autoscaler_windows"], c["autoscaler_goodput"]]
            bars = ax.bar(xs, best, width * 0.9, alpha=0.35, label=f"{c['workload']}: best fixed ({c['best_fixed']})")
            ax.plot(xs, auto, "o", color=bars.patches[0].get_facecolor()[:3], label=f"{c['workload']}: autoscaler")
        top = max(max(*c["best_fixed_windows"], *c["autoscaler_windows"]) for c in mine)
        ax.set_ylim(0, top * 1.5)  # room for the legend above the bars
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(f"{scenario}, budget {budget}")
        ax.set_ylabel("goodput (req/s, >= 90 % in SLO)")
        ax.legend(fontsize=7, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def trace_case(sc: Scenario, budget: int, workload: str, rate: float, names: tuple[str, ...] = ()) -> str:
    """One run per configuration of a goodput case at ``rate`` (no search, no median): each one's attainment
    overall and per window, when the windows start, and the autoscaler's moves with their reasons — what a
    window's result came from. ``names``: configurations whose name starts with one of these (default all)."""
    reqs, warm = make_workload(workload, sc), make_warmup(workload, sc)
    lines = []
    for dep, auto in configs(sc, budget):
        if names and not dep.name.startswith(names):
            continue
        doc, overall, per = run_at_rate(sc, dep, auto, reqs, warm, rate)
        lines.append(f"{dep.name:28s} met {overall:.1%}; per window " + " / ".join(f"{a:.1%}" for a in per))
        if auto is None:
            continue
        starts = sorted(r["arrival_s"] for r in doc["requests"] if r["index"] >= len(warm))
        lines.append("  windows start at t = " + " / ".join(f"{starts[w * len(starts) // WINDOWS]:.0f}"
                                                            for w in range(WINDOWS)) + " s")
        lines += [f"  t = {d['t_s']:.0f} s {d['role']} {d['direction']} -> {d['target']} ({d['code']}): {d['reason']}"
                  for d in doc["sim"]["autoscaler"]["decisions"] if d["direction"] != "hold"]
    return "\n".join(lines)
