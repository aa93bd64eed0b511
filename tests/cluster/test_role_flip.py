"""Role flips on a live cluster (cluster/flip.py): the admin API moves a worker between pools by flipping it in
place — no new actor, no failed request while a stream of requests runs — and the flipped worker serves the
same greedy tokens in its new role as before; a busy worker refuses to flip; pools whose engine configs differ
fall back to drain + start, counted.

Real Ray actors, real NIXL, the tiny model. Each cluster starts 2 prefill + 1 decode workers.
"""
from __future__ import annotations

import random

import pytest
from ray.exceptions import RayTaskError

from engine.request import SamplingParams
from prefill_worker.base import WorkerBusyError
from router.routing.policy import Role
from router.workers.registry import WorkerState
from tests.cluster.test_disagg_cluster import wait_for
from tests.cluster.test_operating import Load, all_blocks_free, on_loop, ready

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
rng = random.Random(11)
PROMPTS = [[rng.randrange(3, 500) for _ in range(rng.randint(20, 70))] for _ in range(4)]


def serve_through(loop_thread, p, d, tag: str) -> list[list[int]]:
    """The prompts prefilled on ``p`` and decoded on ``d`` (clients of the router's registry), greedily."""
    async def one(i, ids):
        first = await p.prefill(f"{tag}-{i}", ids, PARAMS)
        tokens = list(first.new_token_ids)
        async for out in d.decode(first.handoff):
            tokens += out.new_token_ids
        return tokens

    async def run():
        return [await one(i, ids) for i, ids in enumerate(PROMPTS)]

    return loop_thread.run(run(), timeout=120)


def client(cluster, worker_id):
    return cluster.registry.get(worker_id).client


def settled(cluster, n_prefill: int, n_decode: int) -> bool:
    return (ready(cluster, Role.PREFILL) == n_prefill and ready(cluster, Role.DECODE) == n_decode
            and not cluster.registry.records(states=(WorkerState.DRAINING, WorkerState.STARTING)))


def flipped_to(cluster, role: Role) -> tuple[str, str]:
    """(old id, new id) of the latest worker flipped into ``role``."""
    view = cluster.pools.autoscaler_view()["role_flip"]
    last = [f for f in view["flips"] if f["to"] == role.value][-1]
    return last["worker"], last["as"]


class CountingSpawner:
    """The cluster's spawner, counting the actors it starts."""

    def __init__(self, spawn) -> None:
        self.spawn, self.spawned = spawn, []

    def __call__(self, role, worker_id):
        self.spawned.append(worker_id)
        return self.spawn(role, worker_id)

    def worker_args(self, role, worker_id):
        return self.spawn.worker_args(role, worker_id)


def served_by(cluster, worker_id: str, role: Role) -> float:
    """Tokens the router received from ``worker_id`` in ``role``: first tokens (prefill), later ones (decode)."""
    histogram = cluster.metrics.ttft if role == Role.PREFILL else cluster.metrics.itl
    return sum(s.value for s in histogram.collect()[0].samples if s.name.endswith("_count")
               and s.labels["worker"] == worker_id and s.labels["role"] == role.value)


def test_the_admin_api_flips_workers_both_ways_under_load(cluster_factory, loop_thread):
    cluster = cluster_factory(**{"prefill.num_workers": 2, "router.local_prefill_max_tokens": 0})
    pools, backend = cluster.pools, cluster.backend
    spawn = pools._spawn
    pools._spawn = counting = CountingSpawner(spawn)
    before = {p: serve_through(loop_thread, client(cluster, p), client(cluster, "decode-0"), f"before-{p}")
              for p in ("prefill-0", "prefill-1")}
    assert before["prefill-0"] == before["prefill-1"]
    reference = before["prefill-0"]

    # (c) a busy worker refuses to flip, says why, and goes on serving
    options, engine_config = spawn.worker_args(Role.PREFILL, "prefill-x")

    async def flip_busy():
        d = client(cluster, "decode-0")
        stream = d.generate("busy", PROMPTS[0], SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
        await anext(stream)  # the request is in the engine now
        try:
            return await d.handle.flip_role.remote(options, engine_config)
        finally:
            await stream.aclose()

    with pytest.raises(RayTaskError) as refused:
        loop_thread.run(flip_busy())
    assert isinstance(refused.value.cause, WorkerBusyError)
    assert "is busy (1 requests): drain it before flipping" in str(refused.value.cause)

    load = Load(backend, clients=4, prompt_len=40, max_tokens=40, seed=12)
    loop_thread.run(load.start())
    try:
        # prefill 2 -> 1, then decode 1 -> 2 (the budget's order): the drain of a prefill worker becomes a flip
        on_loop(loop_thread, pools.set_target, Role.PREFILL, 1)
        on_loop(loop_thread, pools.set_target, Role.DECODE, 2)
        assert wait_for(lambda: settled(cluster, 1, 2), timeout_s=90), pools.autoscaler_view()
        old, new = flipped_to(cluster, Role.DECODE)
        assert new == "decode-1" and old in ("prefill-0", "prefill-1")
        assert cluster.registry.get(old).reason == "flipped to decode as decode-1" and not cluster.registry.get(old).fault
        assert wait_for(lambda: served_by(cluster, "decode-1", Role.DECODE), timeout_s=60)  # routed to as decode
        (prefiller,) = [r.worker_id for r in cluster.registry.ready(Role.PREFILL)]
        assert serve_through(loop_thread, client(cluster, prefiller), client(cluster, "decode-1"), "as-decode") == reference

        # and back: decode 2 -> 1, prefill 1 -> 2
        on_loop(loop_thread, pools.set_target, Role.DECODE, 1)
        on_loop(loop_thread, pools.set_target, Role.PREFILL, 2)
        assert wait_for(lambda: settled(cluster, 2, 1), timeout_s=90), pools.autoscaler_view()
        back_old, back_new = flipped_to(cluster, Role.PREFILL)
        assert back_old in ("decode-0", "decode-1") and back_new == "prefill-2"
        assert wait_for(lambda: served_by(cluster, back_new, Role.PREFILL), timeout_s=60)  # routed to as prefill
    finally:
        loop_thread.run(load.stop())
    assert load.failed == 0 and load.done > 0, load.errors[:3]

    counters = pools.counters
    assert (counters["flipped"], counters["flip_failures"], counters["flip_fallbacks"]) == (2, 0, 0)
    assert counting.spawned == [] and counters["started"] == 0  # no new actor: both moves were flips
    # the prefill worker's drain told the decode worker to admit its handoffs first; its flip ended that
    assert counters["drain_pull_first"] == 1
    view = pools.autoscaler_view()["role_flip"]
    assert len(view["flip_s"]) == 2 and all(0 < s < 60 for s in view["flip_s"])
    flips = {(s.labels["from_role"], s.labels["to_role"], s.labels["outcome"]): s.value
             for s in cluster.metrics.role_flips.collect()[0].samples if s.name.endswith("_total")}
    assert flips == {("prefill", "decode", "ok"): 1.0, ("decode", "prefill", "ok"): 1.0}

    # (a) the flipped workers serve the same greedy tokens in their new roles
    (decoder,) = [r.worker_id for r in cluster.registry.ready(Role.DECODE)]
    assert serve_through(loop_thread, client(cluster, back_new), client(cluster, decoder), "after") == reference
    assert wait_for(lambda: all_blocks_free(loop_thread, cluster), timeout_s=20)
    assert loop_thread.run(client(cluster, decoder).stats())["draining_sources"] == 0


def test_pools_with_different_engine_configs_drain_and_start_instead(cluster_factory, loop_thread):
    cluster = cluster_factory(**{"prefill.num_workers": 2, "decode.num_blocks": 192,
                                 "router.local_prefill_max_tokens": 0})
    pools = cluster.pools
    assert pools.flip_blockers and "num_blocks 256 != 192" in pools.flip_blockers[0]

    async def rebalance():  # as the autoscaler's tick does: both targets, then one reconcile
        pools.targets[Role.PREFILL], pools.targets[Role.DECODE] = 1, 2
        pools.reconcile()

    loop_thread.run(rebalance())
    assert wait_for(lambda: settled(cluster, 1, 2), timeout_s=90), pools.autoscaler_view()
    counters = pools.counters
    assert (counters["flip_fallbacks"], counters["flipped"], counters["drained"], counters["started"]) == (1, 0, 1, 1)
    assert counters["drain_pull_first"] == 1  # decode-0 was told the drained prefill worker's handoffs go first
    assert cluster.registry.get("decode-1").state == WorkerState.READY  # a fresh actor
    assert pools.autoscaler_view()["role_flip"]["cold_starts"][-1]["worker"] == "decode-1"
    fallbacks = [s for s in cluster.metrics.role_flips.collect()[0].samples if s.name.endswith("_total")]
    assert [(s.labels["from_role"], s.labels["to_role"], s.labels["outcome"], s.value) for s in fallbacks] == [
        ("prefill", "decode", "fallback", 1.0)]
