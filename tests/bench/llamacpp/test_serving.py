"""bench/llamacpp/serving.py's pure pieces: the SLO throughput filter, the output-count check, the workload, the
engines' KV-size log lines."""
from __future__ import annotations

import pytest

from bench.llamacpp.serving import FULL, SLO, kv_sizes, output_count_errors, serve_requests, slo_output_tok_s
from bench.workloads import BenchRequest


def _req(i, ttft, tpot, out=128, prompt=200, ok=True):
    return {"index": i, "ok": ok, "ttft_s": ttft, "tpot_s": tpot, "output_tokens": out, "prompt_tokens": prompt,
            "error": None if ok else "HTTP 500"}


def test_slo_throughput_counts_only_requests_that_meet_both_targets():
    slo = {"ttft_s": 1.0, "ttft_per_token_s": 0.01, "tpot_s": 0.1}  # TTFT target 3 s for a 200-token prompt
    reqs = [_req(0, 2.9, 0.09), _req(1, 3.1, 0.05),  # TTFT over
            _req(2, 0.5, 0.11),  # TPOT over
            _req(3, 0.5, None, out=1),  # one token: any TPOT target is met
            _req(4, 0.1, 0.01, ok=False)]  # failed: never good
    assert slo_output_tok_s(reqs, 2.0, slo) == (128 + 1) / 2.0
    assert slo_output_tok_s(reqs, 0.0, slo) == 0.0


def test_count_errors_name_failed_and_short_requests():
    asked = [BenchRequest((5, 6, 7), 128)] * 3
    got = [_req(0, 1, 0.1), _req(1, 1, 0.1, out=100), _req(2, 1, 0.1, ok=False)]
    assert output_count_errors(got, asked) == ["request 1: 100 tokens, asked 128", "request 2: HTTP 500"]


def test_workload_is_seeded_and_within_the_prompt_range():
    a = serve_requests(49152, 64, (128, 256), 128, seed=8)
    assert a == serve_requests(49152, 64, (128, 256), 128, seed=8) != serve_requests(49152, 64, (128, 256), 128, seed=9)
    assert all(128 <= len(r.prompt) <= 256 and r.output_len == 128 for r in a)
    assert len({len(r.prompt) for r in a}) > 10  # lengths vary
    assert all(3 <= t < 49152 for r in a for t in r.prompt)


def test_llama_server_slot_holds_the_longest_request():
    assert FULL.slot_context >= FULL.prompt_lens[1] + FULL.output_len and FULL.slot_context % 16 == 0
    assert SLO["ttft_s"] > 0 and SLO["tpot_s"] > 0


def test_kv_sizes_read_the_engines_log_lines():
    log = ("(DecodeWorker pid=12) INFO engine.kv.sizing: KV cache: 1234 blocks of 16 tokens (1.51 GiB) on cpu: auto: "
           "0.25 x 12.10 GiB RAM available (MemAvailable) / 2 co-located engine(s)\nother line\n"
           "KV cache: 16 blocks of 16 tokens (256.0 KiB) on cpu: num_blocks is set\n")
    log += ("2026-11-28 09:42:12,498 INFO cluster.launcher: worker prefill-0: 1258 KV blocks of 16 tokens, context 8192 "
            "tokens\n")
    first, second, worker = kv_sizes(log)
    assert first == {"engine": "colocated", "blocks": 1234, "block_tokens": 16, "size": "1.51 GiB",
                     "reason": "auto: 0.25 x 12.10 GiB RAM available (MemAvailable) / 2 co-located engine(s)"}
    assert second["blocks"] == 16 and second["reason"] == "num_blocks is set"
    assert worker == {"engine": "prefill-0", "blocks": 1258, "block_tokens": 16, "context_tokens": 8192}
    assert kv_sizes("nothing here") == []


@pytest.mark.parametrize("duration", [1.0, 4.0])
def test_slo_throughput_scales_with_duration(duration):
    assert slo_output_tok_s([_req(0, 0.1, 0.01)], duration, SLO) == 128 / duration
