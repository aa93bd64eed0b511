"""What the autoscaler observes of a live cluster (cluster/observe.py), from a real worker registry, the router's
real latency samples (RouterMetrics) and its dispatch counter — no Ray: the interval's work is the difference of
each worker's engine counters, the decode backlog is read where it waits, TTFT comes split into its parts."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from cluster.autoscaler import AutoscalerConfig
from cluster.observe import PoolObserver
from engine.kv.events import WorkerLoad
from engine.outputs import RequestOutput
from router.metrics.collector import RouterMetrics
from router.routing.policy import Role
from router.workers.registry import WorkerRegistry


def stats(busy, prefill, steps, tokens, **kw):
    return {"busy_s": busy, "num_prefill_tokens_computed": prefill, "num_decode_steps": steps,
            "num_decode_tokens": tokens, **kw}


def test_an_interval_is_the_difference_of_the_workers_counters_and_the_backlog_where_it_waits():
    reg = WorkerRegistry()
    for wid, role in (("prefill-0", Role.PREFILL), ("decode-0", Role.DECODE)):
        reg.add(wid, role, 0.0)
        reg.mark_ready(wid, 0.0)
    backend = SimpleNamespace(prefill_tokens_routed=0)
    metrics = RouterMetrics("m", 4096)
    obs = PoolObserver(reg, backend, metrics, AutoscalerConfig(warmup_s=1.0))
    reg.update_stats("prefill-0", stats(1.0, 500, 0, 0, num_held=2, leases_held_blocks=30), 5.0)
    reg.update_stats("decode-0", stats(2.0, 0, 100, 800, waiting_for_blocks=3), 5.0)
    reg.update_load(WorkerLoad("decode-0", "decode", 8, 0, 40, 100, 0), 5.0)
    first = obs.observe(10.0)
    assert first.prefill[0].busy_s == 0 and first.decode[0].decode_tokens == 0  # a first sight counts nothing
    assert (first.prefill[0].held_requests, first.prefill[0].held_blocks) == (2, 30)
    assert first.decode[0].handoffs_waiting == 3 and first.decode[0].running == 8

    reg.update_stats("prefill-0", stats(4.0, 2500, 0, 0, num_held=0, leases_held_blocks=0), 15.0)
    reg.update_stats("decode-0", stats(6.0, 0, 300, 2800, waiting_for_blocks=0), 15.0)
    backend.prefill_tokens_routed = 3000
    timing = metrics.request(100)
    timing.observe("prefill-0", "prefill", RequestOutput("r", [7], "x", False,
                                                         ttft_parts={"queue_s": 0.5, "compute_s": 0.25}))
    second = obs.observe(20.0)
    p, d = second.prefill[0], second.decode[0]
    assert (p.busy_s, p.prefill_tokens) == (3.0, 2000) and (d.busy_s, d.decode_steps, d.decode_tokens) == (4.0, 200, 2000)
    assert second.prefill_tokens_arrived == 3000 and p.held_requests == 0 and d.handoffs_waiting == 0
    assert second.ttft_prompt_tokens == (100,)  # its target: autoscaler.ttft_slo_per_token_s
    assert len(second.ttft_s) == 1 and second.ttft_parts["queue"] == (0.5,) and second.ttft_parts["compute"] == (0.25,)
    assert second.ttft_parts["router"][0] >= 0
    backend.prefill_tokens_routed = 3500
    assert obs.observe(30.0).prefill_tokens_arrived == 500  # per interval, not cumulative


def test_the_decode_backlog_is_bounded_by_the_requests_the_router_committed_to_decode():
    """Live, a burst of 16 requests read as 32 sequences (bench/cluster/autoscale_live.py): the prompts a prefill
    worker's stats() snapshot (polled each second) still showed held for decode were already running on the
    decode worker, whose load came fresh from its events. The router's placed-and-not-done count bounds it."""
    import collections

    from cluster.autoscale_estimate import decode_backlog

    reg = WorkerRegistry()
    for wid, role in (("prefill-0", Role.PREFILL), ("decode-0", Role.DECODE), ("decode-1", Role.DECODE)):
        reg.add(wid, role, 0.0)
        reg.mark_ready(wid, 0.0)
    reg.mark_draining("decode-1", "scale-down")  # a draining worker's requests are still decode's
    backend = SimpleNamespace(prefill_tokens_routed=0, inflight=collections.Counter(
        {"prefill-0": 3, "decode-0": 14, "decode-1": 2}))
    obs = PoolObserver(reg, backend, None, AutoscalerConfig(warmup_s=1.0))
    reg.update_stats("prefill-0", stats(1.0, 500, 0, 0, num_held=16, leases_held_blocks=30), 5.0)  # a second old
    reg.update_load(WorkerLoad("decode-0", "decode", 16, 0, 40, 100, 0), 5.9)  # the same 16, pulled since
    seen = obs.observe(6.0)
    assert seen.decode_requests_inflight == 16 and decode_backlog(seen) == 16  # not 32
    backend.inflight = collections.Counter({"decode-0": 40, "decode-1": 2})  # arrivals still in prefill
    assert decode_backlog(obs.observe(7.0)) == 32  # a bound, never a count: what the workers hold stands
    assert decode_backlog(dataclasses.replace(seen, decode_requests_inflight=None)) == 32  # the simulator: no bound


def test_queued_prefill_tokens_include_what_the_router_sent_while_the_worker_is_in_a_long_step():
    """Live (SmolLM2, a loaded 2-vCPU machine), 8 prompts of 512 tokens went into one prefill step of ~30 s; the
    worker reports its load between steps, so the autoscaler saw 0 queued tokens and held for 12 s. The router's
    tracker knows what it sent and has not seen prefilled: the larger of the two counts."""
    from router.routing.load import LoadTracker

    reg = WorkerRegistry()
    reg.add("prefill-0", Role.PREFILL, 0.0)
    reg.mark_ready("prefill-0", 0.0)
    reg.update_load(WorkerLoad("prefill-0", "prefill", 0, 0, 0, 100, 0), 0.5)  # its last report: idle
    tracker = LoadTracker()
    for i in range(8):
        tracker.dispatch(f"r{i}", "prefill-0", num_prefill_tokens=512, num_kv_blocks=32)
    obs = PoolObserver(reg, SimpleNamespace(prefill_tokens_routed=4096, tracker=tracker), None, AutoscalerConfig())
    assert obs.observe(5.0).prefill[0].queued_prefill_tokens == 4096
    for i in range(8):
        tracker.prefill_done(f"r{i}", "prefill-0")
    reg.update_load(WorkerLoad("prefill-0", "prefill", 0, 2, 0, 100, 700), 6.0)  # the worker knows of more
    assert obs.observe(7.0).prefill[0].queued_prefill_tokens == 700
