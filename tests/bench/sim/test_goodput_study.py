"""DistServe goodput in the simulator (bench/sim/goodput_study.py) and the autoscaler's rebalancing by role flips
(bench/sim/autoscale.py, cluster/autoscaler.py): the windows, the workload shapes, and a run in
which the policy moves workers from one role to the other."""
from __future__ import annotations

import pytest

from bench.sim.goodput_study import (
    WARMUP,
    WINDOWS,
    attainment,
    best_of_fixed_and_ratio,
    make_warmup,
    make_workload,
    report,
    spread,
    with_warmup,
)
from bench.sim.scenarios import cpu_scenario, trace
from bench.summary import meets_slo
from bench.workloads import BenchRequest
from cluster.autoscaler import AutoscalerConfig
from tests.bench.sim.test_simulate import Deployment, hardware, prompt, run


def test_attainment_by_windows_in_arrival_order():
    slo = {"ttft_s": 1.0, "tpot_s": 0.1}
    recs = [{"index": i, "ok": True, "ttft_s": 0.5 if i < 6 else 2.0, "tpot_s": 0.05, "prompt_tokens": 10}
            for i in range(8)]
    overall, per = attainment({"requests": recs[::-1]}, slo, windows=4)
    assert overall == 0.75 and per == [1.0, 1.0, 1.0, 0.0]
    # a TTFT target that grows with the prompt
    long = {"ok": True, "ttft_s": 3.0, "tpot_s": 0.05, "prompt_tokens": 1000}
    assert meets_slo(long, {"ttft_s": 1.0, "ttft_per_token_s": 0.002, "tpot_s": 0.1})
    assert not meets_slo(long, {"ttft_s": 1.0, "ttft_per_token_s": 0.001, "tpot_s": 0.1})


def test_spread_and_workload_shapes():
    reqs = [BenchRequest(prompt(32, i), 8, t) for i, t in enumerate((0.0, 0.0, 0.0, 3.0, 6.0, 6.0))]
    assert [r.arrival_s for r in spread(reqs)] == [0.0, 1.0, 2.0, 3.0, 6.0, 6.0]  # the last tick has no next
    sc = cpu_scenario(limit=200)
    base = make_workload("mooncake", sc)
    burst, shift = make_workload("burst", sc), make_workload("shift", sc)
    assert [r.prompt for r in burst] == [r.prompt for r in base]
    gaps = lambda rs, a, b: rs[b].arrival_s - rs[a].arrival_s  # noqa: E731
    assert gaps(burst, 101, 149) == pytest.approx(gaps(base, 101, 149) / 3)
    assert gaps(burst, 0, 100) == pytest.approx(gaps(base, 0, 100))
    first, second = shift[:100], shift[100:]
    assert all(s.output_len == max(1, b.output_len // 4) for s, b in zip(first, base))
    assert sum(len(r.prompt) for r in second) < sum(len(r.prompt) for r in base[100:]) / 3
    assert sum(r.output_len for r in second) > 2 * sum(r.output_len for r in base[100:])
    with pytest.raises(ValueError):
        make_workload("nope", sc)


def test_case_ratio_is_against_the_best_fixed_split_per_window_and_overall():
    rows = [{"config": "1P+3D", "goodput": 1.0, "windows": [2.0, 1.0, 1.0, 1.0]},
            {"config": "3P+1D", "goodput": 1.5, "windows": [1.0, 2.0, 1.5, 1.5]},
            {"config": "autoscaler (2P+2D start)", "goodput": 1.35, "windows": [1.8, 1.8, 1.5, 1.2]},
            {"config": "colocated-4", "goodput": 9.0, "windows": [9.0] * WINDOWS}]
    row = best_of_fixed_and_ratio(("cpu", 4, "mooncake"), rows)
    assert row["best_fixed"] == "3P+1D" and row["ratio"] == pytest.approx(0.9)
    assert row["best_fixed_windows"] == [2.0, 2.0, 1.5, 1.5]
    assert row["window_ratios"] == pytest.approx([0.9, 0.9, 1.0, 0.8]) and row["lowest_ratio"] == pytest.approx(0.8)
    assert row["colocated_goodput"] == 9.0  # reported, not the baseline
    assert row["window_intervals"] == [None] * WINDOWS and row["lowest_ratio_long_windows"] == row["lowest_ratio"]


def test_windows_shorter_than_the_control_loop_are_named_not_dropped():
    """400 measured requests, 4 windows of 100: at 2 req/s a window lasts 50 s = 5 intervals of 10 s (short), at
    1.5 req/s 6.7 intervals. The strict lowest ratio keeps every window; the second one leaves the short out."""
    rows = [{"config": "1P+3D", "goodput": 1.0, "windows": [2.0, 1.0, 1.0, 1.0]},
            {"config": "3P+1D", "goodput": 1.5, "windows": [1.0, 2.0, 1.5, 1.5]},
            {"config": "autoscaler (2P+2D start)", "goodput": 1.35, "windows": [1.8, 1.6, 1.5, 1.4],
             "requests": 400, "interval_s": 10.0},
            {"config": "colocated-4", "goodput": 9.0, "windows": [9.0] * WINDOWS}]
    row = best_of_fixed_and_ratio(("gpu", 8, "shift"), rows)
    assert row["window_intervals"] == [5.0, 5.0, 6.7, 6.7]
    assert row["lowest_ratio"] == pytest.approx(0.8)  # window 2: 1.6 / 2.0
    assert row["lowest_ratio_long_windows"] == pytest.approx(0.9)  # overall 1.35 / 1.5; windows 3-4: 1.0, 0.93
    assert "5 / 5 / 6.7 / 6.7" in report([row])


def test_the_autoscaler_flips_a_worker_to_the_short_role_at_the_budget():
    """Long prompts with two output tokens at the budget of 4 (2P+2D): prefill is short, decode idle. The
    policy moves decode workers to prefill (code rebalance) and the simulated pool flips them in place."""
    reqs = [BenchRequest(prompt(240, 10_000 * (i + 1)), 2, 0.25 * i) for i in range(120)]
    cfg = AutoscalerConfig(enabled=True, interval_s=2.0, min_prefill=1, max_prefill=3, min_decode=1, max_decode=3,
                           max_total_workers=4, ttft_slo_s=2.0, itl_slo_s=0.25, warmup_s=1.0)
    doc = run(Deployment("auto", 2, 2), reqs, hardware(startup_s=30.0, flip_s=1.0), autoscaler=cfg)
    auto = doc["sim"]["autoscaler"]
    moves = [d for d in auto["decisions"] if d["code"] == "rebalance"]
    assert moves and moves[0]["role"] in ("prefill", "decode") and "decode → prefill" in moves[0]["reason"]
    assert {d["role"]: d["target"] for d in moves[:2]} == {"prefill": 3, "decode": 1}
    assert doc["sim"]["counters"]["flips"] >= 1 and doc["summary"]["completed"] == 120
    assert max(t["prefill_ready"] for t in auto["timeline"]) == 3  # no 30 s start: the flip took 1 s
    no_flip = run(Deployment("auto", 2, 2), reqs, hardware(startup_s=30.0, flip_s=None), autoscaler=cfg)
    assert "flips" not in no_flip["sim"]["counters"]  # drain + a 30 s start instead
    assert no_flip["sim"]["counters"]["decode_redirected"] >= 1  # handoffs aimed at the draining worker went on
    assert doc["summary"]["ttft_s"]["mean"] < no_flip["summary"]["ttft_s"]["mean"]


def test_the_warmup_is_other_requests_first_and_is_not_counted():
    sc = cpu_scenario(limit=200)
    base, shift = make_workload("mooncake", sc), make_workload("shift", sc)
    warm, warm_shift = make_warmup("mooncake", sc), make_warmup("shift", sc)
    after = spread(trace({**sc.workload, "start": 200, "limit": round(200 * WARMUP)}))  # the trace's next requests
    assert [r.prompt for r in warm] == [r.prompt for r in after] and warm[0].prompt != base[0].prompt
    assert [r.output_len for r in warm_shift] == [max(1, r.output_len // 4) for r in warm]  # the first phase's shape
    both = with_warmup(warm, shift)
    assert [r.prompt for r in both] == [r.prompt for r in warm + shift]
    times = [r.arrival_s for r in both]
    assert times == sorted(times) and times[0] == 0.0 and times[len(warm)] > times[len(warm) - 1]
    assert times[-1] - times[len(warm)] == pytest.approx(shift[-1].arrival_s - shift[0].arrival_s)
    recs = [{"index": i, "ok": True, "ttft_s": 9.0 if i < 4 else 0.1, "tpot_s": 0.01, "prompt_tokens": 1}
            for i in range(12)]
    assert attainment({"requests": recs}, {"ttft_s": 1.0, "tpot_s": 0.1}, skip=4) == (1.0, [1.0] * WINDOWS)
    assert attainment({"requests": recs}, {"ttft_s": 1.0, "tpot_s": 0.1})[0] == pytest.approx(8 / 12)


def test_a_grid_point_near_the_bar_is_decided_by_the_median_of_three_nearby_rates():
    from bench.sim.goodput_study import JITTER, Search

    sc = cpu_scenario(limit=8)
    seen: list[float] = []

    class Scripted(Search):  # an additional check of the rule alone: attainments scripted by rate
        def _run(self, rate):
            self.simulated += 1
            seen.append(round(rate / self.base_rate, 4))
            table = {1.0: (0.88, [0.5, 0.99, 0.93, 0.88]), JITTER[0]: (0.92, [0.6, 0.99, 0.85, 0.91]),
                     JITTER[1]: (0.91, [0.7, 0.99, 0.80, 0.95])}
            far = (0.99, [0.99] * WINDOWS)
            o, per = table.get(round(rate / self.base_rate, 4), far) if rate < 1.05 * self.base_rate else far
            return o, per, {}

    s = Scripted(sc, make_workload("mooncake", sc), Deployment("1P+1D", 1, 1), base_rate=1.0)
    overall, per = s.measure(0)
    assert seen == [1.0, *JITTER] and s.simulated == 3
    assert overall == 0.91 and per == [0.6, 0.99, 0.85, 0.91]  # element-wise medians
    seen.clear()
    assert s.measure(1) == (0.99, [0.99] * WINDOWS) and seen == [1.1] and s.simulated == 4  # far from the bar: one run
    assert s.measure(0)[0] == 0.91 and s.simulated == 4  # cached


def test_a_traced_case_shows_each_window_and_the_autoscalers_moves():
    """goodput-trace: one run per named configuration at one rate; the autoscaler's lines say when the windows
    start and every move it made, with its reason."""
    from bench.sim.goodput_study import trace_case

    sc = cpu_scenario(limit=48)
    text = trace_case(sc, 4, "shift", 2.0, ("3P+1D", "autoscaler"))
    lines = text.splitlines()
    assert [ln.split()[0] for ln in lines if " met " in ln] == ["3P+1D", "autoscaler"]
    starts = next(ln for ln in lines if "windows start at" in ln)
    assert len(starts.split("=")[1].split("/")) == WINDOWS
    moves = [ln for ln in lines if ln.startswith("  t = ")]
    assert all("(" in m and "):" in m for m in moves)  # code and reason


def test_a_restudy_searches_only_the_autoscaler_and_reuses_the_saved_fixed_splits(monkeypatch):
    """`goodput --reuse-fixed saved.json`: a policy change re-runs the autoscaler's searches only (the fixed
    splits and colocated do not depend on the policy); a row the saved study lacks is an error."""
    import bench.sim.goodput_study as sg

    searched = []

    def fake_search(args):
        sc, wl, dep, auto, base = args
        searched.append(dep.name)
        return {"config": dep.name, "goodput": 2.0, "windows": [2.0, 1.0, 2.0, 2.0]}

    monkeypatch.setattr(sg, "_search_task", fake_search)
    sc = cpu_scenario()
    n = sc.workload["limit"]
    fixed = [{"config": f"{p}P+{4 - p}D", "goodput": float(p), "windows": [float(p)] * WINDOWS, "requests": n}
             for p in (1, 2, 3)]
    saved = [{"scenario": sc.name, "budget": 4, "workload": "mooncake",
              "configs": [*fixed, {"config": "colocated-4", "goodput": 1.5, "windows": [1.5] * WINDOWS, "requests": n}]}]
    (case,) = sg.study_goodput([sc], (4,), ("mooncake",), reuse=saved)
    assert len(searched) == 1 and searched[0].startswith("autoscaler")
    assert case["best_fixed"] == "3P+1D" and case["colocated_goodput"] == 1.5
    assert case["window_ratios"] == pytest.approx([2 / 3, 1 / 3, 2 / 3, 2 / 3])
    with pytest.raises(SystemExit, match="2P\\+2D"):
        sg.study_goodput([sc], (4,), ("mooncake",), reuse=[{**saved[0], "configs": [fixed[0], fixed[2]]}])
    other = [{**saved[0], "configs": [{**r, "requests": n // 2} for r in saved[0]["configs"]]}]
    with pytest.raises(SystemExit, match="measured"):  # rows of another number of requests do not compare
        sg.study_goodput([sc], (4,), ("mooncake",), reuse=other)


def test_saved_studies_merge_and_set_how_many_requests_a_restudy_measures(tmp_path):
    """`--reuse-fixed a.json,b.json`: the cases of several saved studies (one file per hardware and budget); the
    scenario then measures as many requests as its saved rows did, and a --limit that disagrees is an error."""
    import json

    import bench.sim.goodput_study as sg

    def study(scenario, budget, n):
        rows = [{"config": f"{p}P+{budget - p}D", "goodput": 1.0, "windows": [1.0] * WINDOWS, "requests": n}
                for p in range(1, budget)]
        return {"cases": [{"scenario": scenario, "budget": budget, "workload": "burst", "configs": rows}]}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(study("cpu", 4, 1000)))
    b.write_text(json.dumps(study("gpu", 8, 500)))
    cases = sg.load_fixed([str(a), str(b)])
    assert [(c["scenario"], c["budget"]) for c in cases] == [("cpu", 4), ("gpu", 8)]
    assert sg.reused_limit(cases, "gpu", 8, None) == 500 and sg.reused_limit(cases, "cpu", 4, None) == 1000
    assert sg.reused_limit(cases, "gpu", 8, 500) == 500
    assert sg.reused_limit(None, "gpu", 8, 300) == 300  # nothing reused: --limit as given
    assert sg.reused_limit(cases, "gpu", 4, 300) == 300  # nor for a budget the files do not hold
    with pytest.raises(SystemExit, match="--limit 1000"):
        sg.reused_limit(cases, "gpu", 8, 1000)
    with pytest.raises(SystemExit, match="both hold"):
        sg.load_fixed([str(a), str(a)])
    unsized = tmp_path / "c.json"
    unsized.write_text(json.dumps({"cases": [{"scenario": "gpu", "budget": 4, "workload": "burst",
                                              "configs": [{"config": "1P+3D", "goodput": 1.0, "windows": []}]}]}))
    with pytest.raises(SystemExit, match="without their number of requests"):
        sg.reused_limit(sg.load_fixed([str(unsized)]), "gpu", 4, None)


def test_the_goodput_command_searches_the_autoscaler_on_as_many_requests_as_the_saved_rows(tmp_path, monkeypatch,
                                                                                             capsys):
    """`python -m bench.sim goodput --reuse-fixed F` (what `make bench-sim` runs): the scenario measures the
    saved rows' number of requests, and the run ends with the ratio line over the cases."""
    import json

    import bench.sim.goodput_study as sg
    from bench.sim.__main__ import main

    sizes = []

    def fake_search(args):
        sc, wl, dep, auto, base = args
        sizes.append(len(sg.make_workload(wl, sc)))
        return {"config": dep.name, "goodput": 1.0, "windows": [1.0, 1.0, 0.5, 1.0], "requests": sizes[-1]}

    monkeypatch.setattr(sg, "_search_task", fake_search)

    def case(budget, n):
        rows = [{"config": f"{p}P+{budget - p}D", "goodput": 1.0, "windows": [1.0] * WINDOWS, "requests": n}
                for p in range(1, budget)] + [{"config": f"colocated-{budget}", "goodput": 1.0,
                                               "windows": [1.0] * WINDOWS, "requests": n}]
        return {"scenario": "gpu", "budget": budget, "workload": "burst", "configs": rows}

    saved, both = tmp_path / "gpu-b8.json", tmp_path / "gpu-b4.json"
    saved.write_text(json.dumps({"cases": [case(8, 300)]}))
    both.write_text(json.dumps({"cases": [case(4, 200)]}))
    main(["goodput", "--hardware", "gpu", "--budgets", "8", "--workloads", "burst", "--reuse-fixed", str(saved),
          "--out-dir", str(tmp_path / "out")])
    assert sizes == [300]  # the autoscaler alone, on the saved rows' 300 requests (not the default 1,000)
    assert "ratio: 0.500" in capsys.readouterr().out
    # budgets whose saved rows measured different numbers: each budget's autoscaler on its own rows' number
    sizes.clear()
    main(["goodput", "--hardware", "gpu", "--budgets", "4,8", "--workloads", "burst", "--reuse-fixed",
          f"{both},{saved}", "--out-dir", str(tmp_path / "out")])
    assert sizes == [200, 300]
    assert "over 2 cases" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--limit 1000"):
        main(["goodput", "--hardware", "gpu", "--budgets", "8", "--workloads", "burst", "--reuse-fixed", str(saved),
              "--limit", "1000", "--out-dir", str(tmp_path / "out")])
