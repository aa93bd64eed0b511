"""The dashboard's speculative decoding series (cluster/dashboard/timeline.py): acceptance rate, mean acceptance
length and draft tokens per second from the per-worker deltas of the workers' cumulative ``spec_decode``
counters, over a registry fed by hand (no cluster)."""
from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest

from cluster.dashboard import Timeline
from router.metrics.collector import RouterMetrics
from router.routing.policy import Role
from router.workers.registry import WorkerRegistry


def spec(drafts: int, draft_tokens: int, accepted: int, method: str = "ngram") -> dict:
    return {"method": method, "num_drafts": drafts, "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted, "num_accepted_tokens_per_pos": [accepted]}


def timeline_over(reg: WorkerRegistry) -> Timeline:
    pools = SimpleNamespace(registry=reg, targets={Role.PREFILL: 1, Role.DECODE: 3},
                            backend=SimpleNamespace(counters=collections.Counter()))
    return Timeline(pools, RouterMetrics("m", 8192))


def join(reg: WorkerRegistry, worker_id: str, role: Role, stats: dict) -> None:
    reg.add(worker_id, role, 0.0)
    reg.mark_ready(worker_id, 0.0)
    reg.update_stats(worker_id, stats, 0.0)


def test_spec_series_are_per_worker_deltas_without_spikes():
    reg = WorkerRegistry()
    join(reg, "prefill-0", Role.PREFILL, {"prefix_cache_queried_tokens": 100})  # does not speculate
    join(reg, "decode-0", Role.DECODE, {"transfer_bytes": 10, "spec_decode": spec(10, 40, 20)})
    join(reg, "decode-1", Role.DECODE, {"spec_decode": spec(5, 15, 6, method="suffix")})
    tl = timeline_over(reg)
    first = tl.sample(1000.0, 0.0)
    assert first["spec_on"] is True
    assert (first["spec_accept_rate"], first["spec_accept_len"], first["spec_draft_tok_s"]) == (None, None, 0.0)

    # two seconds on: both advance; decode-2 joins with large cumulative counters, decode-3 with no stats yet
    reg.update_stats("decode-0", {"transfer_bytes": 10, "spec_decode": spec(18, 72, 40)}, 2.0)
    reg.update_stats("decode-1", {"spec_decode": spec(9, 27, 10, method="suffix")}, 2.0)
    join(reg, "decode-2", Role.DECODE, {"spec_decode": spec(10**6, 4 * 10**6, 3 * 10**6)})
    join(reg, "decode-3", Role.DECODE, {})
    second = tl.sample(1002.0, 2.0)
    drafts, draft_tokens, accepted = 8 + 4, 32 + 12, 20 + 4
    assert second["spec_accept_rate"] == pytest.approx(accepted / draft_tokens)  # 24 / 44
    assert second["spec_accept_len"] == pytest.approx(1 + accepted / drafts) == 3.0
    assert second["spec_draft_tok_s"] == pytest.approx(draft_tokens / 2.0) == 22.0
    assert second["xfer_bytes_s"] == 0.0

    # decode-0 leaves, decode-1 stands still, decode-2 advances, decode-3's first report is large: no spike
    reg.mark_dead("decode-0", "drained", 3.0, fault=False)
    reg.update_stats("decode-2", {"spec_decode": spec(10**6 + 10, 4 * 10**6 + 30, 3 * 10**6 + 15)}, 3.0)
    reg.update_stats("decode-3", {"transfer_bytes": 5 * 10**9, "spec_decode": spec(500, 2000, 900)}, 3.0)
    third = tl.sample(1003.0, 3.0)
    assert (third["spec_accept_rate"], third["spec_accept_len"], third["spec_draft_tok_s"]) == (0.5, 2.5, 30.0)
    assert third["xfer_bytes_s"] == 0.0 and third["spec_on"] is True

    # nothing drafted in a second: no rate, no length (a gap in the chart), zero draft tokens per second
    fourth = tl.sample(1004.0, 4.0)
    assert (fourth["spec_accept_rate"], fourth["spec_accept_len"], fourth["spec_draft_tok_s"]) == (None, None, 0.0)

    # a worker that resets its counters (restarted under the same id) makes no negative rate
    reg.update_stats("decode-2", {"spec_decode": spec(4, 12, 6)}, 5.0)
    fifth = tl.sample(1005.0, 5.0)
    assert fifth["spec_draft_tok_s"] == 0.0 and fifth["spec_accept_rate"] is None


def test_spec_off_without_a_speculating_worker():
    reg = WorkerRegistry()
    join(reg, "prefill-0", Role.PREFILL, {"prefix_cache_queried_tokens": 100, "prefix_cache_hit_tokens": 10})
    join(reg, "decode-0", Role.DECODE, {"transfer_bytes": 1000})
    tl = timeline_over(reg)
    for now in (0.0, 1.0):
        reg.update_stats("prefill-0", {"prefix_cache_queried_tokens": 100 + 50 * now,
                                       "prefix_cache_hit_tokens": 10 + 25 * now}, now)
        point = tl.sample(1000.0 + now, now)
        assert point["spec_on"] is False
        assert (point["spec_accept_rate"], point["spec_accept_len"], point["spec_draft_tok_s"]) == (None, None, 0.0)
    assert point["prefix_hit"] == 0.5  # the other counters' deltas are unchanged
