"""The policy's memory of its own moves (cluster/autoscale_moves.py): a move at the budget that was undone within
``failed_move_intervals`` is not made again for ``failed_move_hold_intervals``.

The case it comes from (docs/simulator.md e, CPU budget 8 Mooncake): decode read 0.7 workers of load at 2 workers,
so 6P+2D → 7P+1D looked right; at 1 worker its backlog grew to 2.8, the move was undone, and 70–250 s later made
again — each round losing goodput to the flips and to the overloaded minutes (2.42 vs 2.92 req/s for 6P+2D).
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from cluster.autoscale_moves import failed_move_held, recent_move_undone
from cluster.autoscaler import AutoscalerConfig, Observation, PoolState, WorkerSample, decide, history_kept
from engine.errors import ConfigError
from router.routing.policy import Role

P, D = Role.PREFILL, Role.DECODE
FAIL_S, HOLD_S = 120.0, 600.0


def splits(*stays: tuple[int, int, float]) -> list[SimpleNamespace]:
    """Observations every 10 s: ``(prefill, decode, seconds)`` per stay — only what the function reads."""
    out, t = [], 0.0
    for p, d, seconds in stays:
        for _ in range(round(seconds / 10)):
            out.append(SimpleNamespace(t_s=t, prefill=(None,) * p, decode=(None,) * d))
            t += 10.0
    return out


def target(p: int, d: int) -> int:
    return p - d


def test_a_move_undone_quickly_is_held_and_released_after_the_hold():
    # 6P+2D for long, 7P+1D for 70 s (through the flip's transient 6P+1D), back to 6P+2D
    hist = splits((6, 2, 300), (6, 1, 10), (7, 1, 60), (6, 1, 10), (6, 2, 100))
    held = failed_move_held(hist, target(7, 1), FAIL_S, HOLD_S)
    assert held is not None and held.reached == "7P+1D"
    assert (held.left_t_s, held.back_t_s) == (300.0, 380.0)
    assert "7P+1D" in held.reason(hist[-1].t_s, HOLD_S) and "t=980" in held.reason(hist[-1].t_s, HOLD_S)
    # further the same way (8P+0D is past 7P+1D): held too; the hold ends 600 s after the move came back
    assert failed_move_held(hist, target(8, 0), FAIL_S, HOLD_S) is not None
    later = splits((6, 2, 300), (6, 1, 10), (7, 1, 60), (6, 1, 10), (6, 2, 610))
    assert failed_move_held(later, target(7, 1), FAIL_S, HOLD_S) is None


def test_the_move_that_undid_it_is_not_held():
    # just moved 6P+2D → 7P+1D and decode is overloaded: the way back must stay open
    hist = splits((6, 2, 300), (6, 1, 10), (7, 1, 40))
    assert failed_move_held(hist, target(6, 2), FAIL_S, HOLD_S) is None
    # and a return to the split the cluster started in (left long ago) is no failed move either
    hist = splits((4, 4, 30), (6, 2, 300))
    assert failed_move_held(hist, target(4, 4), FAIL_S, HOLD_S) is None


def test_a_shorter_move_the_same_way_stays_open():
    # 5P+3D → 7P+1D failed (back through 6P+2D): 7P+1D is held, 6P+2D is not — it was never what failed
    hist = splits((5, 3, 200), (7, 1, 50), (6, 2, 20), (5, 3, 100))
    assert failed_move_held(hist, target(7, 1), FAIL_S, HOLD_S).reached == "7P+1D"
    assert failed_move_held(hist, target(6, 2), FAIL_S, HOLD_S) is None


def test_a_move_that_held_longer_than_the_failure_window_is_not_a_failure():
    hist = splits((6, 2, 300), (7, 1, 200), (6, 2, 50))
    assert failed_move_held(hist, target(7, 1), FAIL_S, HOLD_S) is None
    assert failed_move_held(hist, target(7, 1), 250.0, HOLD_S) is not None  # within a longer window it is


def test_a_pool_that_scaled_down_and_grew_back_moved_no_worker():
    """7P+1D → 6P+1D (prefill's load fitted in fewer) → 7P+1D (TTFT broke): ``P - D`` went down and up like a
    move to decode and back, but decode never got a worker. Read as a failed move, it held every move toward
    decode for 10 minutes and damped them through the cooldown — in the simulator's burst, one decode worker met
    78 % of the burst's requests against 90 % at 6P+2D. A real trade through the same splits still counts."""
    hist = splits((7, 1, 300), (6, 1, 100), (7, 1, 30))
    assert failed_move_held(hist, target(6, 2), FAIL_S, HOLD_S) is None
    assert recent_move_undone(hist, to_prefill=False, cooldown=6) == 0
    traded = splits((7, 1, 300), (6, 1, 10), (6, 2, 90), (6, 1, 10), (7, 1, 20))
    assert failed_move_held(traded, target(6, 2), FAIL_S, HOLD_S).reached == "6P+2D"
    assert recent_move_undone(traded, to_prefill=False, cooldown=6) == 1
    # a decode start and stop below the budget is no move either
    assert failed_move_held(splits((6, 1, 300), (6, 2, 60), (6, 1, 30)), target(6, 2), FAIL_S, HOLD_S) is None


BUDGET8 = AutoscalerConfig(enabled=True, interval_s=2, min_prefill=1, max_prefill=7, min_decode=1, max_decode=7,
                           max_total_workers=8, ttft_slo_s=1.0, itl_slo_s=0.1, decode_kv_usage_high=0.8,
                           decode_running_high=10, rebalance_intervals=2, failed_move_intervals=12,
                           failed_move_hold_intervals=60)


def interval(t: float, p: int, d: int, waiting: int = 0) -> Observation:
    """Prefill needs 9 workers (500 tok/s learned, at 0.7 utilisation); decode holds 40 KV blocks: 0.5 workers of
    its 80-block capacity — 7P+1D is what the estimates ask for from 6P+2D. ``waiting``: handoffs waiting for
    decode blocks (decode's distress)."""
    pre = tuple(WorkerSample(f"prefill-{i}", True, busy_s=12.0 / p, prefill_tokens=6000 // p, kv_blocks_total=100)
                for i in range(p))
    dec = tuple(WorkerSample(f"decode-{i}", True, kv_blocks_used=40 // d, kv_blocks_total=100,
                             handoffs_waiting=waiting if i == 0 else 0) for i in range(d))
    return Observation(t, pre, dec, prefill_tokens_arrived=round(9 * 500 * 0.7 * 2))


def history(*stays: tuple) -> list[Observation]:
    """Stays of (prefill, decode, intervals[, handoffs waiting for decode blocks])."""
    out, t = [], 0.0
    for p, d, n, *waiting in stays:
        for _ in range(n):
            out.append(interval(t, p, d, *waiting))
            t += BUDGET8.interval_s
    return out


def test_the_policy_holds_a_move_that_was_undone_and_says_why():
    steady = {P: PoolState(6, 6), D: PoolState(2, 2)}
    fresh = history((6, 2, 10))
    out = decide(fresh, steady, BUDGET8)
    assert (out[P].code, out[P].target, out[D].target) == ("rebalance", 7, 1), out[P].reason
    # the same estimates after 7P+1D was tried for 10 s, decode's handoffs waited for blocks there, and it was
    # undone (beyond the cooldown's reach now)
    undone = history((6, 2, 10), (7, 1, 5, 3), (6, 2, 10))
    out = decide(undone, steady, BUDGET8)
    assert out[P].direction == out[D].direction == "hold" and out[P].code == out[D].code == "failed_move_held"
    assert "7P+1D" in out[P].reason and "undone" in out[P].reason and "prefill_demand_tokens_per_s" in out[P].reason
    # tried for longer than failed_move_intervals (24 s) before it came back: a move like any other
    kept = history((6, 2, 10), (7, 1, 15, 3), (6, 2, 10))
    assert decide(kept, steady, BUDGET8)[P].code == "rebalance"
    # undone although decode met its SLOs and nothing waited for it at 7P+1D: the undo was the mistake, not the move
    unharmed = history((6, 2, 10), (7, 1, 5), (6, 2, 10))
    assert decide(unharmed, steady, BUDGET8)[P].code == "rebalance"


def test_the_history_kept_covers_a_failed_move_and_its_hold():
    assert history_kept(BUDGET8) >= BUDGET8.failed_move_intervals + BUDGET8.failed_move_hold_intervals + 1
    assert history_kept(dataclasses.replace(BUDGET8, failed_move_intervals=0, failed_move_hold_intervals=0)) >= 32
    with pytest.raises(ConfigError, match="failed_move_hold_intervals"):
        dataclasses.replace(BUDGET8, failed_move_intervals=30, failed_move_hold_intervals=10)
