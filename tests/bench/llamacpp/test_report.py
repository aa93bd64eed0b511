"""bench/llamacpp/report.py: the best of each side, the ratios, and the last line's form."""
from __future__ import annotations

from bench.llamacpp.report import RATIO_MODEL, markdown, ratio_lines, serving_ratio


def _doc(tok_s, slo_tok_s):
    s = {"output_throughput": tok_s, "ttft_s": {"p50": 0.5, "p99": 1.0}, "tpot_s": {"p50": 0.05, "p99": None},
         "failed": 0}
    return {"summary": s, "slo_output_tok_s": slo_tok_s, "requests": [{}] * 4, "count_errors": []}


def _result(label, duet_decode, llama_decode):
    return {"label": label, "path": "/x.gguf",
            "engine": {"rounds": 2, "sides": ["duet fp32", "llama.cpp"], "notes": [],
                       "decode": {"duet fp32": duet_decode, "llama.cpp": llama_decode},
                       "prefill": {"duet fp32": [100.0, 120.0], "llama.cpp": [60.0, 50.0]}},
            "serving": {"slo": {"ttft_s": 2.0, "ttft_per_token_s": 0.01, "tpot_s": 0.25},
                        "runs": {"duet 1P+1D": {"32": _doc(300.0, 100.0)}, "duet colocated": {"32": _doc(200.0, 150.0)},
                                 "llama-server": {"32": _doc(100.0, 50.0)}}}}


def test_ratios_take_each_sides_best_and_the_last_line_is_the_1_5b_decode():
    results = {"smollm2-q4_1": _result("S", [50.0, 60.0], [120.0, 100.0]), RATIO_MODEL: _result("B", [4.0, 5.0], [20.0, 19.0])}
    lines = ratio_lines(results)
    assert lines[0] == ("S: duet / llama.cpp: decode 0.50x, prefill 2.00x, serving 32 streams 3.00x (duet 1P+1D 300.0 "
                        "vs 100.0 tok/s), serving 32 streams in SLO 3.00x (duet colocated 150.0 vs 50.0 tok/s)")
    assert lines[-1] == "ratio: 0.25"
    assert any("| batch-1 decode, 128 tokens | 60.0 | 120.0 | 0.50x |" == line for line in markdown(results))


def test_no_1_5b_decode_says_so_on_the_last_line():
    assert ratio_lines({"smollm2-q4_1": _result("S", [1.0], [2.0])})[-1].startswith("ratio: n/a")


def test_serving_ratio_without_llama_server_is_none():
    serving = {"runs": {"duet 1P+1D": {"32": _doc(300.0, 100.0)}}}
    assert serving_ratio(serving, 32, "output_tok_s") == ("—", None, None)


def test_a_llama_server_with_nothing_in_slo_is_named_not_divided():
    res = _result("S", [1.0], [2.0])
    res["serving"]["runs"]["llama-server"]["32"] = _doc(100.0, 0.0)
    assert "serving 32 streams in SLO llama.cpp 0 (duet colocated 150.0 vs 0.0 tok/s)" in ratio_lines({"s": res})[0]


def test_a_run_of_some_servers_keeps_the_others_rows_of_the_same_plan():
    from bench.llamacpp.__main__ import merge_serving

    def part(servers, plan):
        return {"plan": plan, "slo": {"ttft_s": 2.0}, "ran_at": "t", "runs": {s: {"1": s} for s in servers},
                **{k: {s: k for s in servers} for k in ("memory", "kv", "ready_s", "failed_starts", "killed_after_stop")}}

    old = part(["duet 1P+1D", "llama-server"], {"output_len": 64})
    merged = merge_serving(old, part(["llama-server", "duet colocated"], {"output_len": 64}))
    assert set(merged["runs"]) == set(merged["memory"]) == {"duet 1P+1D", "llama-server", "duet colocated"}
    assert merge_serving(old, part(["duet colocated"], {"output_len": 128}))["runs"] == {"duet colocated": {"1": "duet colocated"}}
    assert merge_serving(None, old) is old


def test_int8_activations_get_their_own_ratio_column_and_note():
    res = _result("S", [50.0], [100.0])
    e = res["engine"]
    e["sides"] = ["duet fp32", "duet int8", "llama.cpp"]
    e["decode"]["duet int8"], e["prefill"]["duet int8"] = [80.0], [300.0]
    assert "decode 0.50x (int8 0.80x), prefill 2.00x (int8 5.00x)" in ratio_lines({"s": res})[0]
    table = markdown({"s": res})
    assert "| prefill, 512 tokens | 120.0 | 300.0 | 60.0 | 2.00x | 5.00x |" in table
    assert "| best of 2 (tok/s) | duet fp32 | duet int8 | llama.cpp | duet fp32 / llama.cpp | duet int8 / llama.cpp |" in table
