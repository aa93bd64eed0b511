"""make bench-router-decision-tiers at a tiny size: it runs, its placement is what its docstring says, and
it reports the figures docs/benchmarks.md quotes, ending with the ratio line."""
from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

from bench.routing.decision_cost_tiers import make_docs, place
from engine.kv.events import TIERS

REPO = Path(__file__).resolve().parents[3]


def test_each_tier_holds_the_most_recent_blocks_up_to_its_capacity():
    rng = random.Random(3)
    docs = make_docs(rng, 50)
    capacity = dict(zip(TIERS, (300, 700, 2500)))
    p = place(rng, docs, capacity)
    for tier, cap in capacity.items():
        per_doc = p.blocks[tier]
        assert sum(per_doc) == cap
        held = [j for j, n in enumerate(per_doc) if n]  # a suffix of the served documents, whole but the first
        assert held == list(range(held[0], len(p.docs)))
        assert all(per_doc[j] == len(docs[p.docs[j]]) for j in held[1:])
    for j in range(len(p.docs)):  # written through: device within host within disk
        assert p.blocks[TIERS[0]][j] <= p.blocks[TIERS[1]][j] <= p.blocks[TIERS[2]][j]


def test_bench_runs_and_reports_a_ratio():
    done = subprocess.run([sys.executable, "-m", "bench.routing.decision_cost_tiers", "--workers", "8",
                           "--entries", "40000", "--iters", "60", "--churn-batches", "20", "--docs", "80"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    entries = [int(n.replace(",", "")) for n in re.findall(r"\] 8 workers, ([\d,]+) \(worker, tier, block\)", out)]
    assert len(entries) == 2 and all(30_000 < n <= 40_000 for n in entries)  # tiers, then device-only
    for label in ("tiers", "device-only"):
        for what in ("build:", "memory: RSS", "churn on the full index", "route us: p50", "match us: p50"):
            assert re.search(rf"\[{label}\] +{what}", out), (label, what, out)
    assert re.search(r"per tier: device [\d,]+, host 0, disk 0", out)  # the baseline is device only
    for label in ("tiers", "device-only"):  # alternated passes, three each by default
        assert re.search(rf"\[{label}\] route\(\) p99 per pass \(us\): \d+, \d+, \d+\n", out)
    assert re.search(r"\n\[tiers\] \d+ decisions over 8 candidates .*; .* [1-9]\d* with a peer named", out)
    assert re.search(r"ratio: \d+\.\d+ \(route\(\) p99, tiers / device-only at equal entries\)\n$", out)
