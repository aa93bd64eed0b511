"""make bench-spec's workloads and output: the prompts it measures and the lines its figures are read from."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from bench.engine.speculative_prompts import CHAT, TOPICS, grounded, misspell, paragraph, prompts

REPO = Path(__file__).resolve().parents[3]


def test_workloads_are_grounded_in_their_prompts_and_disjoint():
    texts = grounded()
    assert len(texts) == len(TOPICS) and len(set(texts)) == len(texts)
    for topic, text in zip(TOPICS, texts):
        body = paragraph(topic)
        assert 40 <= len(body.split()) <= 260  # short topics end early; a last line may pass 1.5 x 160
        assert body in text or misspell(body, TOPICS.index(topic)) in text  # the answer is in the prompt
    assert misspell(paragraph("if"), 1) != paragraph("if")  # typos to correct
    measured, warm = prompts("input-grounded", 16)
    assert len(measured) == 16 and len(warm) == 2 and not set(measured) & set(warm)
    assert prompts("open-chat", 4)[0] == list(CHAT[:4])


def test_bench_spec_runs_and_reports_a_ratio(tiny_model, tmp_path):
    out = tmp_path / "spec.json"
    done = subprocess.run([sys.executable, "-m", "bench.engine.speculative", "--model", str(tiny_model("llama")),
                           "--batches", "1,4", "--max-tokens", "12", "--workloads", "input-grounded", "--paragraph-words", "12",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"input-grounded\s+b=(\d+)\s+(\w+)\s+([\d.]+) tok/s\s+x([\d.]+)", done.stdout)
    assert [(b, m) for b, m, _, _ in rows] == [(b, m) for b in ("1", "4") for m in ("none", "ngram", "suffix")]
    assert "greedy outputs different from no speculation: 0" in done.stdout  # greedy speculation is exact
    cells = json.loads(out.read_text())
    assert cells["input-grounded/b1/none"]["speedup"] == 1.0
    assert cells["input-grounded/b4/ngram"]["tokens"] == cells["input-grounded/b4/none"]["tokens"]
    last = done.stdout.strip().splitlines()[-1]
    best = max(cells[f"input-grounded/b1/{m}"]["speedup"] for m in ("ngram", "suffix"))
    assert last == f"ratio: {best:.2f}", last
