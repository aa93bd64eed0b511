"""Decode's load from what arrives, and the backlog beyond it (cluster/autoscale_forecast.py), as the policy uses
them at the budget (cluster/autoscaler.py). The cases are the H100 model's at budget 4 (docs/simulator.md e): 3P+1D
fixed met every window, and the autoscaler moved a prefill worker to decode on a decode KV peak that the one
decode worker worked off in seconds."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from cluster.autoscale_estimate import estimate
from cluster.autoscaler import AutoscalerConfig, decide
from cluster.observe import PoolObserver
from router.routing.demand import DecodeDemand, kv_block_tokens
from router.routing.policy import Role
from router.workers.registry import WorkerRegistry
from tests.cluster.autoscale_cases import BUDGET4, loaded, steady

P, D = Role.PREFILL, Role.DECODE
# horizon: max(ttft_slo_s 1, 2-s intervals x estimate_window 3) = 6 s; ITL target 0.08 s; sequences are not
# what binds here (100 per worker)
CFG = dataclasses.replace(BUDGET4, decode_running_high=100)


def asked(o, requests: int, output: int, block_tokens: int, finished: tuple[int, int] = (0, 0)):
    """An observation with what its interval's requests asked of decode (and what finished ones generated)."""
    return dataclasses.replace(o, decode_requests_arrived=requests, output_tokens_requested=requests * output,
                               kv_block_tokens_requested=block_tokens, output_tokens_finished=finished[0],
                               output_tokens_finished_requested=finished[1])


def test_the_forecast_is_littles_law_over_the_arrivals():
    """Per 2-s interval 4 requests of 100 prompt and 50 output tokens (16-token blocks: 8 blocks at mid-output,
    400 block-tokens each); decode steps take 20 ms. Sequences at the 80-ms ITL target: 100 tokens/s x 0.08 = 8;
    blocks: 800 block-tokens/s x 0.02 s = 16; a request decodes 50 x 0.02 = 1 s, 1/6 of the 6-s horizon."""
    bt = 4 * kv_block_tokens(100, 50, 16)
    assert bt == 4 * 8 * 50
    hist = [asked(loaded(t * 2, p=1, d=1, steps=100, dbusy=2.0, tokens=400), 4, 50, bt) for t in range(3)]
    sig = estimate(hist, CFG).decode.signals
    assert sig["decode_forecast_seqs"] == pytest.approx(8)
    assert sig["decode_forecast_blocks"] == pytest.approx(16)
    assert sig["decode_forecast_residence_s"] == pytest.approx(1.0)
    assert sig["decode_backlog_share"] == pytest.approx(1 / 6)
    # the finished requests generated half what they asked for: the asks count half
    halved = [asked(o, 4, 50, bt, finished=(100, 200)) for o in hist]
    sig = estimate(halved, CFG).decode.signals
    assert sig["decode_output_ratio"] == 0.5 and sig["decode_forecast_blocks"] == pytest.approx(8)
    assert sig["decode_forecast_seqs"] == pytest.approx(4)



def test_kv_blocks_are_forecast_at_the_step_time_of_a_full_worker():
    """A decode step reads the KV cache: it slows as the cache fills, a request holds its blocks for longer, and
    the forecast made at a light load's step time understates the blocks a steady state holds (the H100 model,
    budget 8 burst: 11-ms steps at a tenth full read 1.1 workers of KV, where the pool filled 5 at 38 ms). Steps
    of 10 ms at 10 blocks and 20 ms at 50 (one worker of 100 blocks): a line 7.5 ms + 0.25 ms a block, 31.25 ms at
    the 95-block target — capped at the ITL target (80 ms here: a worker that full would break it first)."""
    bt = 4 * kv_block_tokens(100, 50, 16)  # 800 block-tokens per second
    light = [asked(loaded(t * 2, p=1, d=1, used=10 if t % 2 else 50, steps=100, dbusy=1.0 if t % 2 else 2.0,
                          tokens=400), 4, 50, bt) for t in range(4)]
    sig = estimate(light, CFG).decode.signals
    assert sig["decode_forecast_kv_step_s"] == pytest.approx(0.03125)
    assert sig["decode_forecast_blocks"] == pytest.approx(800 * 0.03125)
    assert sig["decode_forecast_step_s"] == pytest.approx(4 / 300)  # the last 3 intervals: residence, backlog share
    steep = [asked(loaded(t * 2, p=1, d=1, used=10 if t % 2 else 50, steps=100, dbusy=1.0 if t % 2 else 5.0,
                          tokens=400), 4, 50, bt) for t in range(4)]
    assert estimate(steep, CFG).decode.signals["decode_forecast_kv_step_s"] == pytest.approx(0.08)
    # a burst in one interval of three: KV is sized for the window's mean arrivals, not its peak
    burst = light[:-1] + [asked(dataclasses.replace(light[-1]), 4, 50, 3 * bt)]
    assert estimate(burst, CFG).decode.signals["decode_forecast_blocks"] == pytest.approx(5 / 3 * 800 * 0.03125)
    # blocks that span too little to fit a slope: the measured step time, as before
    flat = [asked(loaded(t * 2, p=1, d=1, used=40 if t % 2 else 50, steps=100, dbusy=2.0, tokens=400), 4, 50, bt)
            for t in range(4)]
    sig = estimate(flat, CFG).decode.signals
    assert sig["decode_forecast_kv_step_s"] == pytest.approx(0.02)
    assert sig["decode_forecast_blocks"] == pytest.approx(16)


def kv_peak(output: int):
    """3P+1D: prefill 2.9 workers of load; the decode worker's cache 95 % full and 96 blocks held for it on
    prefill (191 blocks against 95 a worker holds: 2.01 workers measured), while the arrivals ask 85.5 blocks
    in the steady state (0.9 workers). ``output``: tokens per request at 20 ms a step (its residence)."""
    requests = 1000 // output  # per 2-s interval: the same output tokens per second either way
    return [asked(loaded(t * 2, p=3, d=1, arrived=round(2.9 * 500 * 0.7 * 2), busy=10.0, computed=5000, used=95,
                         held_blocks=96, steps=100, dbusy=2.0, tokens=400), requests, output, 8550)
            for t in range(2)]


def test_a_kv_peak_decode_works_off_in_seconds_moves_no_prefill_worker_away():
    """Requests that decode for 1 s work the 105.5 blocks beyond the steady state off well within the 6-s horizon:
    the peak counts 1/6 (1.09 workers), and 2P+2D would run prefill at 1.45 per worker — no move. Requests that
    decode for 10 s hold the peak past the horizon: it counts whole (2.01 workers) and a worker moves."""
    fast = kv_peak(output=50)
    est = estimate(fast, CFG).decode
    assert est.signals["decode_kv_blocks_needed"] == 191 and est.signals["decode_backlog_share"] == pytest.approx(1 / 6)
    assert est.load == pytest.approx((85.5 + (191 - 85.5) / 6) / 95)
    out = decide(fast, steady(3, 1), CFG)
    assert out[P].target == 3 and out[D].target == 1 and out[D].code == "budget", out[D].reason
    assert out[D].signals["decode_kv_blocks_load"] == pytest.approx(103.08, abs=0.01)
    slow = kv_peak(output=500)
    assert estimate(slow, CFG).decode.load == pytest.approx(191 / 95)
    out = decide(slow, steady(3, 1), CFG)
    assert (out[P].target, out[D].target, out[D].code) == (2, 2, "rebalance"), out[D].reason
    assert ("decode_kv_blocks_load 191 (decode_kv_blocks_needed 191, decode_forecast_blocks 85.5, "
            "decode_backlog_share 1.00) over decode_kv_capacity_blocks 95") in out[D].reason


def test_the_forecast_moves_a_worker_before_the_backlog_shows():
    """3P+1D, prefill 1.5 workers of load; decode holds 30 blocks (0.32 workers) but the requests arriving ask 190
    blocks in the steady state (long outputs: their KV grows for a while yet). Decode's load is the forecast, 2.0,
    and prefill gives a worker. Without the arrivals reported, the backlog alone moves nothing."""
    hist = [loaded(t * 2, p=3, d=1, arrived=round(1.5 * 500 * 0.7 * 2), busy=10.0, computed=5000, used=30, steps=100,
                   dbusy=2.0, tokens=400) for t in range(2)]
    out = decide(hist, steady(3, 1), CFG)
    assert (out[P].target, out[D].target) == (3, 1)
    assert estimate(hist, CFG).decode.load == pytest.approx(30 / 95)  # no arrivals reported: the backlog as it is
    leading = [asked(o, 2, 500, 19000) for o in hist]
    assert estimate(leading, CFG).decode.load == pytest.approx(2.0)
    out = decide(leading, steady(3, 1), CFG)
    assert (out[P].target, out[D].target, out[D].code) == (2, 2, "rebalance"), out[D].reason


def test_a_threshold_asks_for_a_worker_but_moves_none_at_the_budget_when_the_estimate_fits():
    """3P+1D, prefill at 2.9 workers of load, the decode worker's cache 82 % full (over the 0.8 threshold) but
    0.86 workers by the estimate. Read as a whole worker of load, the threshold moved 3P+1D → 2P+2D on the H100
    model and starved prefill. It still asks for a decode worker — granted below the budget — but moves none at
    it. An ITL over the SLO is a breach: the same cluster moves one."""
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


def test_the_live_observer_reads_the_routers_counters_per_interval():
    demand = DecodeDemand(block_size=16)
    observer = PoolObserver(WorkerRegistry(), SimpleNamespace(prefill_tokens_routed=0, demand=demand), None,
                            AutoscalerConfig())
    demand.placed(100, 51)
    demand.placed(2000, 257)
    demand.placed(5000, 1)  # its only token is the prefill's: nothing asked of decode
    first = observer.observe(10.0)
    assert (first.decode_requests_arrived, first.output_tokens_requested) == (2, 306)  # the first tokens: prefill's
    assert first.kv_block_tokens_requested == 8 * 50 + 134 * 256  # ceil(252 / 32), ceil(4258 / 32) blocks
    demand.finished(121, 257)
    demand.finished(1, 1)
    second = observer.observe(20.0)  # per interval, not cumulative
    assert second.decode_requests_arrived == 0 and second.kv_block_tokens_requested == 0
    assert (second.output_tokens_finished, second.output_tokens_finished_requested) == (120, 256)
    # a backend that does not count them: no arrivals, and the policy sizes decode from its backlog alone
    plain = PoolObserver(WorkerRegistry(), SimpleNamespace(prefill_tokens_routed=0), None, AutoscalerConfig())
    assert plain.observe(10.0).decode_requests_arrived == 0
