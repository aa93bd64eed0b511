"""The int8 KV cache's correctness matrix through real clusters (Ray actors, KV blocks over NIXL; issue 49 must-show
2): every output equals an in-process engine with the same KV dtype (int8) and no tiers, peers or splits, token for
token. Where each path is checked:

  P/D handoff (cold), prefix hits (warm: D's own int8 blocks), speculative decoding's verify and rollback,
  mixed precision (P fp32 -> D int8)                          tests/cluster/test_kv_int8_cluster.py
  host and disk tier loads, peer reads over NIXL (the cluster KV pool), migration (a decode worker killed
  mid-stream), tensor parallelism 3:1 (a 3-rank prefill worker -> a 1-rank decode worker: each head staged with
  its scales, kvtransfer/split_reader.py), role flips (a worker keeps its int8 cache; a flip into fp32 KV is
  refused, both dtypes named)                                here
  the same paths inside one process (block copies, tiers, rollback)   tests/engine/test_kv_cache_dtype.py

One cluster serves the tiers, the peers and the migration (2 prefill workers with 24-block device caches over host
and disk tiers, round robin, so later requests find their prefixes on a lower tier or on the other prefill worker;
2 decode workers, one of which is killed last); the 3:1 split needs a model of 3 KV heads and a cluster of its own, and
so do the flips (2 prefill + 1 decode workers, moved to 1 + 2 and back).
"""
from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from tests.cluster.test_disagg_cluster import prompts_for, run_all, stats, wait_for
from tests.cluster.test_faults import (
    HANG_BOUND_S,
    Outcome,
    judge,
    kill_a_decode_worker_streaming,
    recovered,
    run_with_fault,
)
from tests.cluster.test_kv_pool_cluster import family, run_one

pytestmark = pytest.mark.slow
INT8 = {"engine.kv_cache_dtype": "int8"}
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=77, ignore_eos=True)


def int8_engine(model, num_blocks: int = 256) -> Engine:
    return Engine(EngineConfig(model=str(model), num_blocks=num_blocks, kv_cache_dtype="int8"))


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = int8_engine(tiny_model(), 1024)
    return lambda prompts, params: engine.generate(prompts, params)


@pytest.fixture(scope="module")
def pool(cluster_factory, tiny_model, tmp_path_factory):
    probe = int8_engine(tiny_model(), 2)
    bpb = probe.runner.bytes_per_block
    probe.close()
    disk = tmp_path_factory.mktemp("kv-int8-disk")
    return cluster_factory(**INT8, **{
        "prefill.num_workers": 2, "decode.num_workers": 2, "engine.num_blocks": 24, "decode.num_blocks": 32,
        "engine.kv_host_bytes": 32 * bpb, "engine.kv_disk_bytes": 400 * (bpb + 4096), "engine.kv_disk_dir": str(disk),
        "router.prefill_policy": "round_robin", "router.local_prefill_max_tokens": 0,
        "transfer.lease_timeout_s": 4.0, "transfer.transfer_timeout_s": 3.0})


def test_int8_blocks_from_host_and_disk_tiers_and_from_a_peer(pool, loop_thread, reference):
    """tests/cluster/test_kv_pool_cluster.py's workload on int8 caches: 10 families of 4-block prefixes, twice (the
    second round newest first), through prefill caches of 24 blocks: blocks come back from host and disk tiers and
    from the other prefill worker over NIXL, scales inside."""
    before = stats(loop_thread, pool)
    families = [family(s, 4, 2) for s in range(10)]
    for rnd in range(2):
        for f, fam in (enumerate(families) if rnd == 0 else reversed(list(enumerate(families)))):
            for i, ids in enumerate(fam):
                params = SEEDED if (f + i) % 3 == 0 else GREEDY
                got = run_one(loop_thread, pool, f"int8-pool-{rnd}-{f}-{i}", ids, params)
                assert got == reference([ids], params)[0]["token_ids"], f"round {rnd} family {f} prompt {i}"
    after = stats(loop_thread, pool)
    prefill = [w for w in after if w.startswith("prefill")]
    for tier in ("host", "disk"):
        assert sum(after[w]["kv_tiers"]["loaded_blocks"][tier] - before[w]["kv_tiers"]["loaded_blocks"][tier]
                   for w in prefill) > 0, f"no int8 block came back from a {tier} tier"
    assert sum(after[w]["import_transfers_ok"] for w in prefill) > 0, "no peer read happened"
    assert all(after[w]["num_peer_import_failures"] == 0 and after[w]["kv_tiers"]["load_failures"] == 0
               for w in prefill)


def test_int8_requests_migrate_when_their_decode_worker_dies(pool, loop_thread, reference):
    """A decode worker SIGKILLed while tokens stream: its requests continue on the other one (the prompt and the
    tokens sent so far prefilled again, into int8 blocks), every output exact; the pool comes back at its target with
    every block free."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(20, 70))] for _ in range(6)]
    params = [SamplingParams(max_tokens=rng.randint(40, 60), ignore_eos=True, temperature=0.0 if i % 2 else 0.8,
                             seed=1000 + i) for i in range(6)]
    migrated = pool.backend.counters["migrated"]
    inject = kill_a_decode_worker_streaming(pool, 4)
    results, _ = run_with_fault(loop_thread, pool, prompts, params, inject, name="int8-kill-decode")
    outcome = judge(results, reference(prompts, params), Outcome())
    assert outcome.exact == len(prompts), (outcome.wrong_detail, outcome.errors, outcome.hung)
    assert pool.backend.counters["migrated"] > migrated
    assert wait_for(lambda: recovered(loop_thread, pool), timeout_s=HANG_BOUND_S, interval_s=0.25)


def test_int8_blocks_cross_a_three_way_split(cluster_factory, loop_thread, tiny_model):
    """A prefill worker of 3 ranks (one KV head each) hands off to a decode worker of 1 rank: the decode worker reads
    every rank's int8 block whole and puts each head, with its scales, in place. Greedy tokens equal a one-rank int8
    engine's (the ranks' all-reduces sum in another order: tokens, not bits, are compared, as for fp32 splits)."""
    model = tiny_model("llama", hidden_size=96, num_heads=6, num_kv_heads=3, intermediate_size=192)
    cluster = cluster_factory(model, **INT8, **{"prefill.tensor_parallel_size": 3, "router.local_prefill_max_tokens": 0})
    prompts = prompts_for(21)
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * len(prompts)
    want = [r["token_ids"] for r in int8_engine(model).generate(prompts, params)]
    got = run_all(loop_thread, cluster.backend, "tp3", prompts, params)
    assert [g["token_ids"] for g in got] == want
    s = stats(loop_thread, cluster)["decode-0"]
    rank_block_bytes = 2 * 2 * 16 * 1 * (16 + 4)  # layers x K,V x tokens x one KV head x (16 int8 + an fp32 scale)
    assert s["transfers_ok"] == len(prompts) and s["num_remote_recomputes"] == 0
    assert s["transfer_bytes"] == sum(-(-len(p) // 16) for p in prompts) * 3 * rank_block_bytes
    loop_thread.run(cluster.stop())


def test_int8_workers_flip_roles_and_keep_their_kv_dtype(cluster_factory, loop_thread, tiny_model):
    """Role flips (cluster/flip.py) between int8 pools: a prefill worker becomes a decode worker in place and back,
    keeping its engine and so its int8 cache (its stats and its KVCompat say int8), and serves in its new role the
    tokens of a colocated int8 engine. A flip into a pool of another KV dtype is refused by the worker, both dtypes
    named (``reload_reason``); the cluster config does not plan such flips at all (``flip_blockers``,
    tests/cluster/test_config.py)."""
    import dataclasses

    from ray.exceptions import RayTaskError

    from prefill_worker.base import FlipRefusedError
    from router.routing.policy import Role
    from tests.cluster.test_operating import all_blocks_free, on_loop
    from tests.cluster.test_role_flip import PARAMS, PROMPTS, client, flipped_to, serve_through, settled

    cluster = cluster_factory(**INT8, **{"prefill.num_workers": 2, "router.local_prefill_max_tokens": 0})
    pools = cluster.pools
    assert pools.flip_blockers == []
    want = [r["token_ids"] for r in int8_engine(tiny_model()).generate(PROMPTS, PARAMS)]
    on_loop(loop_thread, pools.set_target, Role.PREFILL, 1)
    on_loop(loop_thread, pools.set_target, Role.DECODE, 2)
    assert wait_for(lambda: settled(cluster, 1, 2), timeout_s=90), pools.autoscaler_view()
    old, new = flipped_to(cluster, Role.DECODE)
    assert old.startswith("prefill") and new == "decode-1"
    (prefiller,) = [r.worker_id for r in cluster.registry.ready(Role.PREFILL)]
    assert serve_through(loop_thread, client(cluster, prefiller), client(cluster, new), "int8-flipped") == want
    s = stats(loop_thread, cluster)
    assert s[new]["kv_cache"]["cache_dtype"] == "int8" and s[new]["transfers_ok"] == len(PROMPTS)
    options, engine_config = cluster.pools._spawn.worker_args(Role.PREFILL, "prefill-x")
    assert engine_config.kv_cache_dtype == "int8"
    handle = cluster.registry.get(new).client.handle
    async def flip_to_fp32_kv():  # the other pool's config, with fp32 KV: the worker refuses
        return await handle.flip_role.remote(options, dataclasses.replace(engine_config, kv_cache_dtype="auto"))

    with pytest.raises(RayTaskError) as refused:
        loop_thread.run(flip_to_fp32_kv())
    assert isinstance(refused.value.cause, FlipRefusedError)
    assert "kv_cache_dtype 'int8' != 'auto'" in str(refused.value.cause)
    on_loop(loop_thread, pools.set_target, Role.DECODE, 1)  # and back: a decode worker becomes a prefill worker
    on_loop(loop_thread, pools.set_target, Role.PREFILL, 2)
    assert wait_for(lambda: settled(cluster, 2, 1), timeout_s=90), pools.autoscaler_view()
    back_old, back_new = flipped_to(cluster, Role.PREFILL)
    (decoder,) = [r.worker_id for r in cluster.registry.ready(Role.DECODE)]
    assert serve_through(loop_thread, client(cluster, back_new), client(cluster, decoder), "int8-back") == want
    assert stats(loop_thread, cluster)[back_new]["kv_cache"]["cache_dtype"] == "int8"
    assert (pools.counters["flipped"], pools.counters["flip_failures"], pools.counters["flip_fallbacks"]) == (2, 0, 0)
    assert wait_for(lambda: all_blocks_free(loop_thread, cluster), timeout_s=20)
    loop_thread.run(cluster.stop())
