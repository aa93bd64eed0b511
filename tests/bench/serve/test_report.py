"""bench-serve's report (bench/serve/report.py) and plan (bench/serve/__main__.py), without servers: the goodput
rows with every probe, the per-workload lines, the ratio line (duet's best over vLLM's, shared-prefix, last),
and the ratio left undefined rather than guessed."""
from __future__ import annotations

import pytest

from bench.goodput_search import RateSearch, search_rate
from bench.serve.__main__ import make_plan
from bench.serve.report import markdown, summary_lines
from bench.summary import summarize

SLO = {"ttft_s": 2.0, "tpot_s": 0.2}
KNEES = {"random": {"duet-disagg-1p1d": 0.6, "duet-colocated": 1.0, "vllm-cpu": 1.1},
         "shared-prefix": {"duet-disagg-1p1d": 0.7, "duet-colocated": 1.5, "vllm-cpu": 1.2}}


def summary(attainment: float, n: int = 20) -> dict:
    good = round(attainment * n)
    reqs = [{"ok": True, "prompt_tokens": 256, "output_tokens": 8, "ttft_s": 0.5 if i < good else 3.0,
             "tpot_s": 0.1, "e2e_s": 1.2} for i in range(n)]
    return summarize(reqs, 30.0, SLO)


def fake_report(knees: dict, trace: bool = True) -> dict:
    runs, searches = [], {}
    params = RateSearch(start_rps=0.25, growth=2.0, resolution=1.1, ceiling_rps=8.0, max_probes=9)
    for wl, by in knees.items():
        for cfg, at in by.items():
            probes = []

            def measure(rate, cfg=cfg, at=at, wl=wl, probes=probes):
                s = summary(0.95 if rate <= at else 0.5)
                runs.append({"file": f"{cfg}-{wl}-p{len(probes)}.json", "config": cfg, "rate": rate,
                             "probe": len(probes), "client": "vllm.benchmarks.serve", "workload": wl,
                             "summary": s, "duration_s": 30.0})
                probes.append({"rate_rps": rate, "attainment": s["good_fraction"], "num_requests": 20,
                               "ttft_p90_s": s["ttft_s"]["p90"], "tpot_p90_s": s["tpot_s"]["p90"]})
                return s["good_fraction"]

            searches.setdefault(wl, {})[cfg] = {**search_rate(measure, params).to_dict(), "probes": probes}
    if trace:
        for cfg in ("duet-disagg-1p1d", "duet-colocated", "vllm-cpu"):
            runs.append({"file": f"{cfg}-trace.json", "config": cfg, "rate": None, "client": "duet bench",
                         "workload": "mooncake-conversation", "summary": summary(0.8), "duration_s": 30.0})
    return {"machine": {"cores": 2, "cpu": "test"}, "date": "2026-11-24", "elapsed_s": 60.0, "slo": SLO,
            "trace_slo": {"ttft_s": 5.0, "tpot_s": 0.2}, "runs": runs, "searches": searches,
            "agreement": None, "routing": None}


def test_report_lists_each_goodput_with_every_probe():
    report = fake_report(KNEES)
    md = markdown(report)
    for wl, by in report["searches"].items():
        for cfg, found in by.items():
            row = next(line for line in md.splitlines() if line.startswith(f"| {wl} | {cfg} | **"))
            assert f"**{found['label']}**" in row and found["stopped"] in row
            assert row.count(" % (") == len(found["probes"])  # rate: attainment (TTFT p90 / TPOT p90) each
            assert knees_bracket(found, KNEES[wl][cfg])
    assert md.count("| vllm.benchmarks.serve |") == sum(len(f["probes"]) for by in report["searches"].values()
                                                        for f in by.values())


def knees_bracket(found: dict, knee: float) -> bool:
    return found["goodput_rps"] <= knee < found["lowest_failing_rps"] <= found["goodput_rps"] * 1.1


def test_summary_lines_end_with_the_shared_prefix_ratio_of_duets_best_over_vllm():
    report = fake_report(KNEES)
    *per_workload, last = summary_lines(report)
    sp = report["searches"]["shared-prefix"]
    want = sp["duet-colocated"]["goodput_rps"] / sp["vllm-cpu"]["goodput_rps"]
    assert last.startswith(f"ratio: {want:.2f} (") and "duet-colocated" in last
    assert [line.split(" ")[:2] for line in per_workload[:2]] == [["goodput", "random"], ["goodput", "shared-prefix"]]
    rnd = report["searches"]["random"]
    assert per_workload[0].endswith(f"duet's best / vLLM: {rnd['duet-colocated']['goodput_rps'] / rnd['vllm-cpu']['goodput_rps']:.2f}")
    assert per_workload[2].startswith("trace (its own arrival times") and "80 %" in per_workload[2]


@pytest.mark.parametrize("knees, reason", [
    ({"shared-prefix": {"duet-colocated": 1.0, "vllm-cpu": 0.1}}, "vLLM CPU failed its first probe"),
    ({"shared-prefix": {"duet-colocated": 1.0}}, "vLLM CPU was not measured"),
])
def test_ratio_is_undefined_rather_than_guessed(knees, reason):
    last = summary_lines(fake_report(knees, trace=False))[-1]
    assert last.startswith("ratio: n/a (") and reason in last


def test_duet_failing_everywhere_counts_as_zero():
    last = summary_lines(fake_report({"shared-prefix": {"duet-colocated": 0.1, "vllm-cpu": 1.0}}, trace=False))[-1]
    assert last.startswith("ratio: 0.00 (") and "duet-colocated < 0.25" in last


def test_ratio_says_when_a_goodput_is_only_a_lower_bound():
    last = summary_lines(fake_report({"shared-prefix": {"duet-colocated": 9.0, "vllm-cpu": 1.0}}, trace=False))[-1]
    assert "duet-colocated >= 8 / vllm-cpu" in last and "only a lower bound" in last


def test_plan_bounds_and_probe_size():
    full, small = make_plan(False), make_plan(True)
    assert full.probe_requests(0.25) == 40 and full.probe_requests(2.0) == 120  # >= 40 requests and >= 60 s
    assert small.probe_requests(0.5) == 16 and small.search.max_probes < full.search.max_probes
    tiny = make_plan(True, start_rps=1.0, max_probes=2, ceiling_rps=2.0)
    assert (tiny.search.start_rps, tiny.search.max_probes, tiny.search.ceiling_rps) == (1.0, 2, 2.0)
    assert tiny.search.resolution == small.search.resolution
