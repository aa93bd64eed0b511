"""Tensor-parallel workers in a live cluster (issue 27): losing a rank (under load, and while idle), the KV tiers,
role flips.

Must-show 3: killing one rank of a tensor-parallel decode worker under streaming load. The worker's
rank 0 fails its next collective and ends its process (prefill_worker/base.py ``_exit_process``), so the worker
dies as a one-rank worker would: its requests migrate (state rebuilt from tokens) and the pool replaces it with
a new worker of 2 ranks. The checks are the fault suite's (tests/cluster/test_faults.py): no hang, every request
exact or cleanly failed, pools back at target with every block free, a fresh batch exact."""
from __future__ import annotations

import asyncio
import time

import pytest
import ray

from router.routing.policy import Role
from router.workers.registry import WorkerState
from tests.cluster.test_faults import Outcome, finish, judge, pick, reference, run_with_fault, workload  # noqa: F401

pytestmark = pytest.mark.slow

TP_CLUSTER = {"prefill.num_workers": 1, "decode.num_workers": 2, "decode.tensor_parallel_size": 2,
              "router.local_prefill_max_tokens": 0, "transfer.lease_timeout_s": 4.0,
              "transfer.transfer_timeout_s": 3.0}


def rank_actor(cluster, worker_id: str, rank: int):
    """Rank ``rank`` (>= 1) of one of this cluster's workers (its spawner keeps the handles)."""
    return cluster.pools._spawn.ranks[worker_id][rank - 1]


@pytest.fixture
def tp_cluster(cluster_factory, loop_thread):
    """A cluster of this test's own, stopped when it ends (the module's clusters would hold their CPUs and
    placement groups until the module ends)."""
    clusters = []

    def start(**overrides):
        clusters.append(cluster_factory(**overrides))
        return clusters[-1]

    yield start
    for cluster in clusters:
        loop_thread.run(cluster.stop())


def test_kill_one_rank_of_a_decode_worker_mid_stream(tp_cluster, loop_thread, reference):  # noqa: F811
    cluster = tp_cluster(**TP_CLUSTER)
    before = dict(cluster.backend.counters)
    prompts, params = workload(7, 12)

    async def inject(fault):
        while sum(cluster.backend.inflight[r.worker_id] for r in cluster.registry.ready(Role.DECODE)) < 6:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # tokens are flowing
        victim = pick(cluster, Role.DECODE)
        fault.update(at=time.monotonic(), worker=victim.worker_id)
        ray.kill(rank_actor(cluster, victim.worker_id, 1))

    results, at = run_with_fault(loop_thread, cluster, prompts, params, inject, name="kill-decode-rank")
    outcome = judge(results, reference(prompts, params), Outcome())
    figures = finish("kill-decode-rank", cluster, loop_thread, reference, outcome, at, len(prompts), before)
    assert figures["exact"] + figures["errors"] == len(prompts) and figures["migrations"] >= 1, figures
    assert cluster.pools.counters["replaced"] >= 1
    new = [r.worker_id for r in cluster.registry.ready(Role.DECODE)]
    assert len(new) == 2 and all(rank_actor(cluster, w, 1) is not None for w in new)  # the replacement has its ranks


def test_tensor_parallel_workers_keep_their_heads_on_the_host_tier(tp_cluster, loop_thread, tiny_model):
    """KV tiers with TP: rank 0's mover runs every job on every rank's own host tier (its heads of the same
    blocks and slots). A device cache of 24 blocks and 9 prompts of 7 blocks: the first prompts leave the device
    and come back from the host tier on both ranks (rank 1's heads too: else its attention reads stale blocks) —
    outputs equal a one-rank engine without tiers."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams
    from tests.cluster.test_disagg_cluster import stats
    from tests.cluster.test_faults import stream

    cluster = tp_cluster(**{"prefill.tensor_parallel_size": 2, "decode.tensor_parallel_size": 2,
                            "router.local_prefill_max_tokens": 0, "engine.num_blocks": 24,
                                 "engine.kv_host_bytes": 96 * 2 * 2 * 16 * 1 * 16 * 4})  # 96 blocks of one rank
    prompts = [[3 + (7 * i + j) % 490 for j in range(112)] for i in range(9)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = Engine(EngineConfig(model=str(tiny_model()), num_blocks=256)).generate(prompts, params)

    async def run(tag, batch):
        out = []
        for i, p in enumerate(batch):  # one at a time: each prompt's blocks are cached before the next
            out.append(await stream(cluster.backend, f"{tag}-{i}", p, params))
        return out

    first = loop_thread.run(run("first", prompts))
    again = loop_thread.run(run("again", prompts[:3]))
    assert [t for t, _, _ in first] == [w["token_ids"] for w in want]
    assert [t for t, _, _ in again] == [w["token_ids"] for w in want[:3]]
    # the prompts came back from a host tier (the decode worker holds every handed-off prompt: the router sends
    # a prompt it holds whole to it alone), loaded on both of its ranks
    host = sum(s["prefix_hit_tokens_by_source"]["host"] for s in stats(loop_thread, cluster).values())
    assert host >= 3 * 96


def test_a_rank_lost_while_idle_is_found_by_the_health_probe(tp_cluster, loop_thread):
    """No step runs, so no collective fails: the worker's health asks its ranks, and the pool replaces it."""
    from tests.cluster.test_disagg_cluster import wait_for

    cluster = tp_cluster(**{"prefill.tensor_parallel_size": 2, "decode.tensor_parallel_size": 2,
                            "lifecycle.health_interval_s": 0.5})
    victim = cluster.registry.ready(Role.PREFILL)[0].worker_id
    replaced = cluster.pools.counters["replaced"]
    ray.kill(rank_actor(cluster, victim, 1))
    assert wait_for(lambda: cluster.pools.counters["replaced"] > replaced, timeout_s=30)
    record = cluster.registry.get(victim)
    assert "rank 1 does not answer" in record.reason, record.reason
    assert wait_for(lambda: len(cluster.registry.ready(Role.PREFILL)) == 1
                    and cluster.registry.ready(Role.PREFILL)[0].worker_id != victim, timeout_s=90)


def test_tensor_parallel_workers_flip_roles_with_their_ranks(tp_cluster, loop_thread):
    """prefill 2 -> 1 with decode 1 -> 2 is a flip, and back: each rank's agents follow rank 0's role (a prefill
    rank opens the agent peers read from, a decode rank closes it); the flipped workers serve the same tokens."""
    from tests.cluster.test_disagg_cluster import wait_for
    from tests.cluster.test_operating import on_loop
    from tests.cluster.test_role_flip import client, flipped_to, serve_through, settled

    cluster = tp_cluster(**{"prefill.num_workers": 2, "prefill.tensor_parallel_size": 2,
                            "decode.tensor_parallel_size": 2, "router.local_prefill_max_tokens": 0})
    pools = cluster.pools
    reference = serve_through(loop_thread, client(cluster, "prefill-0"), client(cluster, "decode-0"), "before")
    on_loop(loop_thread, pools.set_target, Role.PREFILL, 1)
    on_loop(loop_thread, pools.set_target, Role.DECODE, 2)
    assert wait_for(lambda: settled(cluster, 1, 2), timeout_s=90), pools.autoscaler_view()
    old, new = flipped_to(cluster, Role.DECODE)
    (prefiller,) = [r.worker_id for r in cluster.registry.ready(Role.PREFILL)]
    assert serve_through(loop_thread, client(cluster, prefiller), client(cluster, new), "as-decode") == reference
    on_loop(loop_thread, pools.set_target, Role.DECODE, 1)
    on_loop(loop_thread, pools.set_target, Role.PREFILL, 2)
    assert wait_for(lambda: settled(cluster, 2, 1), timeout_s=90), pools.autoscaler_view()
    _, back = flipped_to(cluster, Role.PREFILL)
    (decoder,) = [r.worker_id for r in cluster.registry.ready(Role.DECODE)]
    assert serve_through(loop_thread, client(cluster, back), client(cluster, decoder), "as-prefill") == reference
    assert (pools.counters["flipped"], pools.counters["flip_failures"], pools.counters["started"]) == (2, 0, 0)
    # the flipped workers' ranks and placement groups went with them to their new ids: stopping the cluster
    # releases them (else two ranks and their CPUs stay held in Ray: the suite's ray_left_clean check)
    live = {r.worker_id for r in cluster.registry.records(states=(WorkerState.READY,))}
    assert set(pools._spawn.ranks) == set(pools._spawn.groups) == live, (pools._spawn.ranks, live)
