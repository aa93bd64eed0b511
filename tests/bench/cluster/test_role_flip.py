"""make bench-flip (bench/cluster/role_flip.py) once on the tiny model: the measurements its ratio rests on are real —
one cold start of a new actor, one flip each way without one, no fallback — and the report ends with the
ratio line. Not the timing targets, except the one that holds on any machine: a flip is faster than a start."""
from __future__ import annotations

import asyncio

import pytest

from bench.cluster.role_flip import report, run

pytestmark = pytest.mark.slow


def test_one_round_measures_a_cold_start_and_a_flip_each_way(tiny_model, ray_up):
    view = asyncio.run(run(str(tiny_model("llama")), repeats=1))
    counters = view["counters"]
    assert (counters["started"], counters["flipped"], counters["drained"]) == (1, 2, 1)
    flips = view["role_flip"]["flips"]
    assert [(f["from"], f["to"]) for f in flips] == [("prefill", "decode"), ("decode", "prefill")]
    (cold,) = view["role_flip"]["cold_starts"]
    assert cold["role"] == "decode" and all(f["flip_s"] < cold["cold_start_s"] for f in flips)
    lines = report(view["role_flip"])
    assert lines[-1].startswith("ratio: ") and "(flip idle -> ready / cold start" in lines[-1]
    assert 0 < float(lines[-1].split()[1]) < 1
