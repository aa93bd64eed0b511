"""`duet bench` (bench/client.py) and the shared workloads (bench/workloads.py): the metric definitions
against numpy and by hand, the trace scaling, and a real run against a real engine behind the HTTP API."""
from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from bench import workloads
from bench.client import RequestResult, run, summarize
from bench.serve.clients import compare_clients, from_vllm_result
from bench.summary import stats as percentiles
from bench.workloads import BenchRequest


def test_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = list(rng.exponential(size=n))
        got = percentiles(xs)
        for q in (50, 90, 99):
            assert got[f"p{q}"] == pytest.approx(float(np.percentile(xs, q)))
        assert got["mean"] == pytest.approx(float(np.mean(xs)))
    assert percentiles([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_goodput_counts_requests_meeting_both_slos():
    rs = [RequestResult(0, 0, 10, 5, ttft_s=0.5, tpot_s=0.1, e2e_s=0.9, ok=True),   # good
          RequestResult(1, 0, 10, 5, ttft_s=2.5, tpot_s=0.1, e2e_s=2.9, ok=True),   # TTFT too slow
          RequestResult(2, 0, 10, 5, ttft_s=0.5, tpot_s=0.3, e2e_s=1.7, ok=True),   # TPOT too slow
          RequestResult(3, 0, 10, 1, ttft_s=1.0, tpot_s=None, e2e_s=1.0, ok=True),  # one token: meets any TPOT
          RequestResult(4, 0, 10, 0, ok=False, error="HTTP 400")]                  # failed: never good
    s = summarize(rs, 4.0, slo_ttft_s=2.0, slo_tpot_s=0.2)
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["goodput"] == pytest.approx(2 / 4.0)
    assert s["output_throughput"] == pytest.approx(16 / 4.0)
    assert s["request_throughput"] == pytest.approx(1.0)


def test_scaled_trace_keeps_the_sharing_structure():
    reqs = workloads.scaled_trace(vocab=49152, limit=200, block_tokens=16, time_scale=2.0)
    raw = [json.loads(line) for line, _ in zip(open(workloads.TRACE), range(200))]
    assert len(reqs) == 200
    for r, rec in zip(reqs, raw):
        assert len(r.prompt) == min(math.ceil(rec["input_length"] * 16 / 512), 16 * len(rec["hash_ids"]), 2048)
        assert r.output_len == min(max(1, round(rec["output_length"] / 16)), 64)
        assert r.arrival_s == pytest.approx((rec["timestamp"] - raw[0]["timestamp"]) / 1000 * 2.0)
        assert all(256 <= t < 49152 for t in r.prompt)
    # equal hash-id prefixes <=> equal token prefixes, block by block
    for a in reqs[:60]:
        for b in reqs[:60]:
            for k in range(min(len(a.hash_ids), len(b.hash_ids), len(a.prompt) // 16, len(b.prompt) // 16)):
                same_ids = a.hash_ids[:k + 1] == b.hash_ids[:k + 1]
                assert same_ids == (a.prompt[:16 * (k + 1)] == b.prompt[:16 * (k + 1)])
    assert any(a.hash_ids[0] == b.hash_ids[0] for a in reqs for b in reqs if a is not b)  # the trace does share


def test_workload_lines_ours_and_vllm_custom(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text('{"prompt": "hello there", "output_tokens": 5}\n{"prompt": [300, 301], "output_len": 2, "arrival_s": 1.5}\n')
    a, b = workloads.load(p)
    assert a == BenchRequest("hello there", 5) and b == BenchRequest((300, 301), 2, 1.5)
    for bad in ('{"prompt": "x", "output_tokens": 0}', '{"prompt": "x", "output_len": 3, "temperature": 1}',
                '{"prompt": [], "output_len": 3}', '{"prompt": "x"}', '[1, 2]'):
        p.write_text(bad + "\n")
        with pytest.raises(ValueError, match="w.jsonl:1"):
            workloads.load(p)


def test_vllm_detailed_result_converts_to_the_same_metrics():
    raw = {"duration": 10.0, "start_times": [100.0, 101.0], "ttfts": [0.5, 0.0], "itls": [[0.1, 0.2, 0.3], []],
           "latencies": [1.1, 0.0], "output_lens": [4, 0], "input_lens": [32, 32], "errors": ["", "HTTP 500"]}
    doc = from_vllm_result(raw, {"ttft_s": 1.0, "tpot_s": 0.25}, {"name": "random"}, 1.0)
    r0, r1 = doc["requests"]
    assert r0["ok"] and r0["tpot_s"] == pytest.approx((1.1 - 0.5) / 3) and r0["arrival_s"] == 0.0
    assert not r1["ok"] and r1["error"] == "HTTP 500" and r1["arrival_s"] == 1.0
    assert doc["summary"]["goodput"] == pytest.approx(0.1) and doc["summary"]["failed"] == 1


def test_client_comparison_reports_gap_and_noise():
    def doc(ttft, tput):
        return {"summary": {"ttft_s": {"mean": ttft}, "tpot_s": {"mean": 0.1}, "itl_s": {"mean": 0.1},
                            "output_throughput": tput}}
    got = compare_clients({"duet bench": [doc(1.0, 10), doc(1.2, 10), doc(1.1, 10)],
                           "vllm.benchmarks.serve": [doc(1.0, 10), doc(1.0, 12), doc(1.0, 11)]})
    assert got["gap"]["ttft_mean_s"] == pytest.approx(0.1)  # medians 1.1 vs 1.0
    assert got["gap"]["output_throughput"] == pytest.approx(10 / 11 - 1)
    assert got["noise"]["ttft_mean_s"] == pytest.approx(0.2 / 1.1) and got["noise"]["output_throughput"] == pytest.approx(2 / 11)


@pytest.mark.slow
def test_duet_bench_against_a_real_engine(tiny_model):
    """A real run: tiny engine behind the real HTTP API; every request streams exactly output_len tokens
    (ignore_eos), the timings are consistent, a bad request is a recorded failure, not a crash."""
    from cluster.local_backend import LocalBackend
    from engine.config import EngineConfig
    from router.http.app import create_app
    from tests.router.http.http_harness import ServerThread

    backend = LocalBackend.from_config(EngineConfig(model=str(tiny_model()), num_blocks=256, max_model_len=256))
    vocab = backend.engine.model_config.vocab_size
    reqs = workloads.random_requests(vocab=vocab, num=6, input_len=20, output_len=5, seed=1)
    reqs += [BenchRequest(tuple([vocab + 5] * 4), 3)]  # an id outside the vocabulary: a 400
    try:
        with ServerThread(create_app(backend)) as server:
            doc = asyncio.run(run(server.url, reqs, rate=50.0, seed=2, progress=False, slo_ttft_s=30, slo_tpot_s=30))
    finally:
        backend.async_engine.shutdown()
    s = doc["summary"]
    assert (s["completed"], s["failed"]) == (6, 1)
    bad = doc["requests"][-1]
    assert not bad["ok"] and bad["error"].startswith("HTTP 400")
    for r in doc["requests"][:-1]:
        assert r["ok"] and r["output_tokens"] == 5 and r["prompt_tokens"] == 20
        assert 0 < r["ttft_s"] <= r["e2e_s"] <= doc["duration_s"]
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 4)
        assert len(r["itl_s"]) >= 1 and sum(r["itl_s"]) == pytest.approx(r["e2e_s"] - r["ttft_s"])
    assert s["output_tokens"] == 30 and s["goodput"] == pytest.approx(6 / doc["duration_s"])
    arrivals = [r["arrival_s"] for r in doc["requests"]]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0  # Poisson-spaced, not all at once


def test_usage_in_the_last_chunk_with_choices_is_read():
    """llama-server sends ``usage`` in its final chunk (empty text, finish_reason), not in a chunk of its own."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from tests.router.http.http_harness import ServerThread

    async def completions(request):
        async def events():
            for text in ("a", "b", "c"):
                yield f"data: {json.dumps({'choices': [{'text': text, 'index': 0, 'finish_reason': None}]})}\n\n"
            last = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                    "usage": {"completion_tokens": 3, "prompt_tokens": 4, "total_tokens": 7}}
            yield f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    with ServerThread(Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])) as server:
        doc = asyncio.run(run(server.url, [BenchRequest((5, 6, 7, 8), 3)], model="m", progress=False))
    r = doc["requests"][0]
    assert r["ok"] and (r["output_tokens"], r["prompt_tokens"]) == (3, 4)
