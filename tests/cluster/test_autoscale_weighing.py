"""How rule 4 weighs the two roles' loads at the budget (cluster/autoscaler.py, cluster/autoscale_estimate.py).

Both come from the H100 model at a budget of 4 (docs/simulator.md e), where 3P+1D fixed met every window and the
autoscaler moved 3P+1D → 2P+2D on a decode KV peak and starved prefill: a threshold's pressure read as a whole
worker of load, and a KV overload read as throughput while its only cost is a longer TPOT.
"""
from __future__ import annotations

import dataclasses

import pytest

from cluster.autoscale_estimate import estimate, kv_overload_weighed
from cluster.autoscaler import decide
from router.policy import Role
from tests.cluster.test_autoscaler_policy import BUDGET4, loaded, steady

P, D = Role.PREFILL, Role.DECODE


def test_a_threshold_asks_for_a_worker_but_moves_none_at_the_budget_when_the_estimate_fits():
    """The H100 model at budget 4: 3P+1D, prefill at 2.9 workers of load, the decode worker's cache 82 % full (over
    the 0.8 threshold) but 0.86 workers by the estimate (KV sized at 0.95 of its blocks). Read as a whole worker of
    load, the threshold moved 3P+1D → 2P+2D and starved prefill, where 3P+1D fixed met the window. It still asks
    for a decode worker — granted below the budget — but moves none at it. An ITL over the SLO is a breach: the
    same cluster moves one."""
    arrived = round(2.9 * 500 * 0.7 * 2)
    kv_full = [loaded(t * 2, p=3, d=1, arrived=arrived, busy=10.0, computed=5000, used=82) for t in range(2)]
    out = decide(kv_full, steady(3, 1), BUDGET4)
    assert out[P].target == 3 and (out[D].direction, out[D].code) == ("hold", "budget"), out[D].reason
    assert out[D].signals["kv_usage"] == pytest.approx(0.82)
    out = decide(kv_full, steady(3, 1), dataclasses.replace(BUDGET4, max_total_workers=5))
    assert (out[D].direction, out[D].target, out[D].code) == ("up", 2, "kv_usage")
    slow = [loaded(t * 2, p=3, d=1, arrived=arrived, busy=10.0, computed=5000, used=50, itl=[0.2] * 10)
            for t in range(2)]
    out = decide(slow, steady(3, 1), BUDGET4)
    assert (out[P].target, out[D].target, out[D].code) == (2, 2, "rebalance"), out[D].reason
    assert "pressure itl_slo" in out[D].reason


def test_a_kv_overload_counts_as_far_as_it_stretches_tpot_past_the_target():
    assert kv_overload_weighed(0.9, 1, 0.01, 0.04) == 0.9  # within the room: KV is the load as it is
    assert kv_overload_weighed(1.6, 1, 0.03, 0.04) == pytest.approx(1.2)  # TPOT x 1.6 of 30 ms: 48 ms, 1.2 x 40
    assert kv_overload_weighed(1.2, 1, 0.02, 0.04) == 1.0  # the pool is full: never below its workers
    assert kv_overload_weighed(1.6, 1, 0.05, 0.04) == 1.6  # no ITL headroom: the whole overload
    assert kv_overload_weighed(1.6, 1, None, 0.04) == 1.6  # no ITL measured: the whole overload


def test_a_kv_peak_on_a_decode_worker_with_itl_headroom_moves_no_prefill_worker_away():
    """3P+1D, prefill 2.9 workers of load, decode's KV need 2.0 workers (its cache full and as many blocks held for
    it on prefill) at an ITL p90 of 30 ms against a 40-ms target (itl_slo 0.05 x 0.8). Read whole, 2P+2D lowers the
    bottleneck from 2.0 to 1.45 per worker and a worker moves; weighed, decode is 1.5 workers (TPOT x 2 of 30 ms is
    1.5 x 40) and 2P+2D gains 3 %: no move. With the ITL at 45 ms the same KV need is the whole overload: it moves."""
    cfg = dataclasses.replace(BUDGET4, itl_slo_s=0.05, ttft_slo_s=100.0, prefill_queued_tokens_high=10**9)
    arrived = round(2.9 * 500 * 0.7 * 2)

    def hist(itl):
        return [loaded(t * 2, p=3, d=1, arrived=arrived, busy=10.0, computed=5000, used=95, held_blocks=96,
                       itl=[itl] * 10) for t in range(2)]
    est = estimate(hist(0.03), cfg).decode
    assert est.load == pytest.approx(191 / 95) and est.weighed == pytest.approx(191 / 95 * 0.75)
    out = decide(hist(0.03), steady(3, 1), cfg)
    assert out[P].target == 3 and out[D].target == 1 and out[D].code != "rebalance", out[D].reason
    out = decide(hist(0.045), steady(3, 1), cfg)
    assert (out[P].target, out[D].target, out[D].code) == (2, 2, "rebalance"), out[D].reason
    assert "decode 2.01 workers" in out[D].reason
