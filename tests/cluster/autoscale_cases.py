"""Replayed signal series for the autoscaler's policy tests (tests/cluster/test_autoscaler_*.py,
test_autoscale_forecast.py): a small config, observations built from pool-wide totals, and a steady-load replay."""
from __future__ import annotations

import dataclasses

from cluster.autoscaler import AutoscalerConfig, Observation, PoolState, WorkerSample, decide
from router.routing.policy import Role

P, D = Role.PREFILL, Role.DECODE
CFG = AutoscalerConfig(enabled=True, interval_s=2, min_prefill=1, max_prefill=3, min_decode=1, max_decode=3,
                       ttft_slo_s=1.0, itl_slo_s=0.1, prefill_queued_tokens_high=1000, decode_kv_usage_high=0.8,
                       decode_running_high=10, scale_down_fraction=0.5, scale_down_intervals=3, warmup_s=5)


def workers(role: Role, n: int, *, queued=0, running=0, used=0, total=100, warm=True, cold: int = 0):
    """``n`` warm workers sharing a load evenly, plus ``cold`` warming ones reporting ``cold_load``."""
    out = [WorkerSample(f"{role.value}-{i}", warm=warm, running=running // max(n, 1),
                        queued_prefill_tokens=queued // max(n, 1), kv_blocks_used=used // max(n, 1),
                        kv_blocks_total=total) for i in range(n)]
    return tuple(out + [WorkerSample(f"{role.value}-cold{i}", warm=False) for i in range(cold)])


def obs(t=0.0, *, p=1, d=1, queued=0, running=0, used=0, ttft=(), itl=(), queue=(), **kw) -> Observation:
    return Observation(t, workers(P, p, queued=queued, **kw), workers(D, d, running=running, used=used, **kw),
                       ttft_s=tuple(ttft), itl_s=tuple(itl), prefill_queue_s=tuple(queue))


def steady(n_p=1, n_d=1, **kw):
    return {P: PoolState(target=n_p, ready=n_p, **kw), D: PoolState(target=n_d, ready=n_d, **kw)}


BUDGET4 = dataclasses.replace(CFG, max_total_workers=4, rebalance_intervals=2)
BUDGET8 = dataclasses.replace(CFG, max_prefill=7, max_decode=7, max_total_workers=8, rebalance_intervals=2)


def loaded(t, *, p=2, d=2, arrived=0, busy=0.0, computed=0, held=0, held_blocks=0, waiting_handoffs=0,
           running=0, used=0, ttft=(), itl=(), steps=0, tokens=0, dbusy=0.0, queued=0):
    """An interval with the predictive signals: prefill tokens that arrived, what prefill workers computed
    in how much busy time, the decode backlog held on prefill workers and waiting on decode workers."""
    pre = tuple(WorkerSample(f"prefill-{i}", True, busy_s=busy / p, prefill_tokens=computed // p,
                             held_requests=held // p, held_blocks=held_blocks // p, kv_blocks_total=100,
                             queued_prefill_tokens=queued // p)
                for i in range(p))
    dec = tuple(WorkerSample(f"decode-{i}", True, running=running // d, kv_blocks_used=used // d, kv_blocks_total=100,
                             handoffs_waiting=waiting_handoffs // d, busy_s=dbusy / d, decode_steps=steps // d,
                             decode_tokens=tokens // d) for i in range(d))
    return Observation(t, pre, dec, ttft_s=tuple(ttft), itl_s=tuple(itl), prefill_tokens_arrived=arrived)


def splits_over(intervals: int, targets: dict, cfg, observe) -> list[dict]:
    """The targets after each of ``intervals`` decisions, each interval observed by ``observe(t, targets)`` at the
    split the last decision set (a steady load: the same totals whatever the split)."""
    seen, out = [], []
    for t in range(intervals):
        o = observe(t, targets)
        for role, dec in decide([*(seen[-31:]), o], {r: PoolState(targets[r], targets[r]) for r in (P, D)},
                                cfg).items():
            targets[role] = dec.target
        seen.append(o)
        out.append(dict(targets))
    return out
