"""make bench-autoscale (bench/cluster/autoscale_live.py) on the tiny model: a live cluster with the autoscaler on at a
budget of 3 workers follows long prompts into the prefill pool (a cold start) and then long outputs into the
decode pool — a rebalance at the budget, carried out as a flip in place or a drain + start — with no failed
request, and the moves' reasons name the signals they were judged on. Not the timings (a loaded 2-vCPU machine)."""
from __future__ import annotations

import asyncio

import pytest

from bench.cluster.autoscale_live import PLANS, check, named_signals, phase2_moves, report, run

pytestmark = pytest.mark.slow


def test_capacity_follows_long_prompts_then_long_outputs_at_the_budget(tiny_model, ray_up):
    record = asyncio.run(run(str(tiny_model("llama")), PLANS["tiny"]))
    lines = report(record)
    print("\n".join(lines))
    assert check(record) == [], "\n".join(lines)
    assert [ph["failed"] for ph in record["phases"]] == [0, 0] and all(ph["done"] for ph in record["phases"])

    # phase 2's move: decode up within the budget, a rebalance (prefill down in the same tick)
    (move,) = [d for d in phase2_moves(record)][:1]
    assert move["code"] == "rebalance" and move["target"] == 2
    twin = [d for d in record["decisions"] if d["role"] == "prefill" and d["t_s"] == move["t_s"]]
    assert twin and twin[0]["direction"] == "down" and twin[0]["reason"] == move["reason"]
    assert {"decode_backlog_seqs", "decode_seq_capacity"} <= set(named_signals(move)) \
        or "decode_kv_blocks_needed" in named_signals(move)
    assert all(named_signals(d) for d in record["decisions"] if d["direction"] == "up"), record["decisions"]
    assert all(r["prefill"]["target"] + r["decode"]["target"] <= 3 for r in record["series"])

    # carried out by a flip (prefill -> decode) or a start; the flip vs cold start numbers come from this run
    counters = record["counters"]
    flipped = [f for f in record["flips"] if (f["from"], f["to"]) == ("prefill", "decode")]
    decode_starts = [c for c in record["cold_starts"] if c["role"] == "decode"]
    assert flipped or (decode_starts and counters.get("flip_fallbacks")), counters
    assert record["cold_starts"] and not counters.get("flip_failures") and not counters.get("drain_timeouts")
    assert lines[-1].startswith("ratio: ") and (not flipped or float(lines[-1].split()[1]) > 0)
