"""make bench-tiers' cluster comparison (bench/kv/tiers_cluster.py) at a tiny size: the structure its ratio rests on.

A real cluster twice (tiers off, then on: Ray actors, NIXL handoffs, the router's ClusterBackend) on the
tiny model. Not the timing targets — only what must hold whatever the machine: the outputs are equal, the
host tier is loaded from, the prefill worker computes fewer prompt tokens with it (exactly the ideal: every
prefix once), and every prompt token is either computed or a hit on some tier.
"""
from __future__ import annotations

import pytest

from bench.kv.tiers_cluster import build_workload, ideal_computed, make_setup, run_pair

pytestmark = pytest.mark.slow

PREFIX_TOKENS = 64


def test_tiers_cut_prefill_compute_with_equal_outputs(tiny_model, ray_up):
    prompts = build_workload(prefixes=12, visits=3, prefix_tokens=PREFIX_TOKENS, suffix_tokens=16, vocab=500, seed=1)
    # one request at a time: which blocks are on the device is then independent of timing
    setup = make_setup(str(tiny_model("llama")), prompts, PREFIX_TOKENS, device_fraction=0.25, max_tokens=3,
                       concurrency=1, decode_blocks=64)
    assert setup.device_blocks * 4 <= setup.working_set_blocks
    base, tiered, c = run_pair(setup, prompts)

    assert c["mismatched"] == []
    assert all(len(out) == 3 for out in tiered["outputs"])
    assert base["kv_tiers"] is None
    t = tiered["kv_tiers"]
    assert t["loads"] > 0 and t["loaded_blocks"]["host"] > 0
    assert t["load_failures"] == 0 and t["op_failures"] == 0 and t["stores_skipped"] == 0
    assert tiered["computed"] < base["computed"]
    # the host tier held every block: each prefix computed once, however the device tier churned
    assert tiered["computed"] == ideal_computed(prompts, PREFIX_TOKENS)
    assert tiered["tier_hits"] == t["loaded_blocks"]["host"] * 16
    for run in (base, tiered):  # every prompt token computed, or found on the device or a lower tier
        assert run["computed"] + run["device_hits"] + run["tier_hits"] == run["prompt_tokens"]
