"""bench/llamacpp/llama_bench.py: llama-bench's JSON (the fields of llama.cpp's own `-o json` printer, as the
llama-cpp-python 0.3.36 sdist's llama-bench writes them) parsed, and malformed output refused by name."""
from __future__ import annotations

import json

import pytest

from bench.llamacpp.llama_bench import parse_results

TG = {"build_commit": "unknown", "build_number": 0, "cpu_info": "Intel(R) Xeon(R) Processor", "backends": "CPU",
      "model_filename": "/x/SmolLM2-135M-Instruct.Q4_1.gguf", "model_type": "llama 256M Q4_1", "model_size": 96576768,
      "model_n_params": 134515008, "n_batch": 2048, "n_ubatch": 512, "n_threads": 2, "n_prompt": 0, "n_gen": 128,
      "n_depth": 0, "avg_ns": 1032854609, "stddev_ns": 0, "avg_ts": 123.927, "stddev_ts": 0.0,
      "samples_ns": [1032854609], "samples_ts": [123.927]}
PP = {**TG, "n_prompt": 512, "n_gen": 0, "avg_ts": 850.5, "samples_ts": [850.5]}


def test_parses_a_decode_and_a_prefill_test():
    tg, pp = parse_results(json.dumps([TG, PP]))
    assert (tg.test, tg.tok_s, tg.n_threads, tg.samples_tok_s) == ("tg128", 123.927, 2, (123.927,))
    assert (pp.test, pp.tok_s) == ("pp512", 850.5)
    assert tg.model_type == "llama 256M Q4_1" and tg.model_bytes == 96576768 and tg.build == "unknown (0)"


@pytest.mark.parametrize("text, message", [
    ("| model | size |", "not JSON"),
    ("[]", "non-empty list"),
    (json.dumps({"avg_ts": 1}), "non-empty list"),
    (json.dumps([{k: v for k, v in TG.items() if k != "avg_ts"}]), "lacks avg_ts"),
    (json.dumps([{**TG, "n_prompt": 512}]), "prompt-only or generation-only"),
])
def test_malformed_output_is_refused_naming_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_results(text)
