"""Faults timed into a chosen window of a request's life (the fault suite's oracle: tests/cluster/test_faults.py).

A kill "mid-transfer" cannot be timed from outside when a pull over NIXL takes microseconds, so this
cluster injects a delay: `transfer.fault_pull_delay_s` holds every decode pull for 1.5 s after the decode
worker has reserved its blocks (the prefill worker holds the lease, the decode worker's request is
`remote_pending`). Each scenario waits until the window is open on some worker — read from the workers'
own stats — and kills there. The decode pool is given few blocks so that handoffs also queue for free
blocks (`waiting_for_blocks`). Every scenario then checks that the fault really landed in its window.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.cluster.test_faults import HANG_BOUND_S, Outcome, before, finish, judge, reference, run_with_fault, workload  # noqa: F401

pytestmark = pytest.mark.slow

TIMED_CLUSTER = {"prefill.num_workers": 2, "decode.num_workers": 2, "router.local_prefill_max_tokens": 0,
                 "transfer.lease_timeout_s": 6.0, "transfer.transfer_timeout_s": 3.0,
                 "transfer.fault_pull_delay_s": 1.5, "decode.num_blocks": 96}


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    return cluster_factory(**TIMED_CLUSTER)


async def _worker_stats(cluster) -> dict[str, dict]:
    return {s["worker_id"]: s for s in await cluster.stats()}


async def _wait_for_window(cluster, role: str, key: str, timeout_s: float = HANG_BOUND_S) -> tuple[str, dict]:
    """The first worker of ``role`` whose stats show ``key`` > 0, and everyone's stats at that moment."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = await _worker_stats(cluster)
        for worker_id, s in stats.items():
            if s["role"] == role and s.get(key, 0) > 0:
                return worker_id, stats
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {role} worker ever had {key} > 0")


def _pid(cluster, worker_id: str) -> int:
    return cluster.registry.get(worker_id).pid


def _decode_failed_transfers(loop_thread, cluster) -> int:
    stats = loop_thread.run(_worker_stats(cluster))
    return sum(s.get("transfers_failed", 0) for s in stats.values() if s["role"] == "decode")


def test_kill_a_prefill_worker_while_a_decode_worker_is_pulling_its_blocks(cluster, before, loop_thread, reference):
    prompts, params = workload(11, 8)
    failed_before = _decode_failed_transfers(loop_thread, cluster)

    async def inject(fault):
        _, stats = await _wait_for_window(cluster, "decode", "remote_pending")
        # the prefill worker whose lease a pull is waiting on (it holds leases; the window lasts 1.5 s)
        holders = [w for w, s in stats.items() if s["role"] == "prefill" and s.get("leases_held", 0) > 0]
        assert holders, stats
        fault.update(at=time.monotonic(), worker=holders[0], leases=stats[holders[0]]["leases_held"])
        os.kill(_pid(cluster, holders[0]), signal.SIGKILL)

    results, at = run_with_fault(loop_thread, cluster, prompts, params, inject, name="kill-prefill-mid-transfer")
    outcome = judge(results, reference(prompts, params), Outcome())
    # The pull found its peer gone: the decode worker recomputed the prompt (recompute_on_failure: true),
    # so every request is exact — and the failed pull proves the kill landed inside the transfer window.
    failed = _decode_failed_transfers(loop_thread, cluster) - failed_before
    figures = finish("kill-prefill-mid-transfer", cluster, loop_thread, reference, outcome, at, len(prompts), before,
                     failed_pulls_recomputed=failed)
    assert figures["exact"] == len(prompts), figures
    assert failed >= 1, "no pull failed: the prefill worker died outside the transfer window"


@pytest.mark.parametrize("name, seed, long_prompts, window", [
    ("kill-decode-mid-transfer", 12, False, "remote_pending"),  # blocks reserved, pull not done
    # 600-900-token prompts: one fits in the 96 blocks at a time, the others' handoffs queue
    ("kill-decode-waiting-for-blocks", 13, True, "waiting_for_blocks"),
])
def test_kill_a_decode_worker_in_a_window(cluster, before, loop_thread, reference, name, seed, long_prompts, window):
    prompts, params = workload(seed, 8, long_prompts=long_prompts)
    victim_state = {}

    async def inject(fault):
        victim, stats = await _wait_for_window(cluster, "decode", window)
        victim_state.update(stats[victim])
        fault.update(at=time.monotonic(), worker=victim)
        os.kill(_pid(cluster, victim), signal.SIGKILL)

    results, at = run_with_fault(loop_thread, cluster, prompts, params, inject, name=name)
    outcome = judge(results, reference(prompts, params), Outcome())
    figures = finish(name, cluster, loop_thread, reference, outcome, at, len(prompts), before,
                     **{f"victim_{window}": victim_state.get(window)})
    assert victim_state[window] >= 1
    assert figures["exact"] == len(prompts), figures
    # its requests went on elsewhere (continued after the prefill's first token, or placed again)
    assert figures["migrations"] + figures["placed_again"] >= 1, figures
