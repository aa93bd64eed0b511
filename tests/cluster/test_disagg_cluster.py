"""The disaggregated path end to end: router -> prefill actor -> NIXL -> decode actor -> tokens.

Must-shows of issue 3 checked here against a single in-process engine (the colocated reference):
token-for-token equality for concurrent mixed requests with cold and warm prefix caches, conditional
disaggregation, lease expiry when no decode worker fetches, failed transfers (a prefill worker that
died) recomputed or failed explicitly and counted, cancellation leaving no block behind, and the KV
events reaching the router's index.
"""
from __future__ import annotations

import asyncio
import time

import pytest
import ray

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from router.routing.index import NO_MATCH

pytestmark = pytest.mark.slow

LENGTHS = (1, 7, 16, 33, 64, 90, 130)


def prompts_for(seed: int, lengths=LENGTHS, vocab: int = 500) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def params_for(i: int) -> SamplingParams:
    if i % 3 == 2:  # seeded sampling must survive the prefill -> decode boundary too
        return SamplingParams(max_tokens=10 + i, temperature=0.9, top_p=0.9, seed=1000 + i, ignore_eos=True)
    return SamplingParams(max_tokens=10 + i, temperature=0, ignore_eos=True, logprobs=2)


async def collect(backend, rid, ids, params):
    tokens, text, logprobs, last = [], "", [], None
    async for out in backend.generate(rid, ids, params):
        tokens += out.new_token_ids
        text += out.new_text
        logprobs += out.new_logprobs
        last = out
    return {"token_ids": tokens, "text": text, "finish_reason": last.finish_reason, "logprobs": logprobs,
            "cached": last.num_cached_tokens}


def reference(model, prompts, params):
    engine = Engine(EngineConfig(model=str(model), num_blocks=256))
    out = []
    for ids, p in zip(prompts, params):
        r = engine.generate([ids], p)[0]
        out.append(r)
    return out


def run_all(loop_thread, backend, tag, prompts, params):
    async def go():
        return await asyncio.gather(*(collect(backend, f"{tag}-{i}", ids, p)
                                      for i, (ids, p) in enumerate(zip(prompts, params))))
    return loop_thread.run(go())


def stats(loop_thread, cluster) -> dict[str, dict]:
    return {s["worker_id"]: s for s in loop_thread.run(cluster.stats())}


def wait_for(predicate, timeout_s=10.0, interval_s=0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return predicate()


@pytest.fixture(scope="module")
def disagg(cluster_factory):
    """1 prefill + 1 decode worker; every prompt is disaggregated (no local prefill)."""
    return cluster_factory(**{"router.local_prefill_max_tokens": 0})


def test_disaggregated_equals_colocated_cold_then_warm(disagg, loop_thread, tiny_model):
    prompts = prompts_for(1)
    params = [params_for(i) for i in range(len(prompts))]
    want = reference(tiny_model(), prompts, params)
    cold = run_all(loop_thread, disagg.backend, "cold", prompts, params)
    for got, ref in zip(cold, want):
        assert got["token_ids"] == ref["token_ids"]
        assert got["text"] == ref["text"]
    s = stats(loop_thread, disagg)
    assert s["prefill-0"]["num_handoffs"] == len(prompts)
    assert s["decode-0"]["num_remote_kv_received"] == len(prompts)
    assert s["decode-0"]["transfers_ok"] == len(prompts)
    computed_cold = s["prefill-0"]["num_computed_tokens"]
    backend = disagg.backend
    assert wait_for(lambda: all(backend.index.match(backend.hasher(ids)).get("decode-0", NO_MATCH).total == len(ids) // 16
                                for ids in prompts)), "the router never learned the decode worker's blocks"

    warm = run_all(loop_thread, disagg.backend, "warm", prompts, params)  # P and D caches now hold the prompts
    for got, ref in zip(warm, want):
        assert got["token_ids"] == ref["token_ids"]
    s2 = stats(loop_thread, disagg)
    # A prompt D holds completely (a multiple of the block size) has nothing uncached there: D serves it
    # alone (conditional disaggregation with threshold 0). Every other prompt goes through P again, which
    # recomputes at most its last partial block, and D pulls only that block, reusing its own full ones.
    whole_on_d = [n for n in LENGTHS if n % 16 == 0]
    assert backend.counters["local_prefill"] == len(whole_on_d)
    assert s2["prefill-0"]["num_computed_tokens"] - computed_cold <= sum(n % 16 for n in LENGTHS)
    assert s2["decode-0"]["num_remote_prefix_hit_blocks"] == sum(n // 16 for n in LENGTHS if n % 16)
    assert sum(g["cached"] for g in warm) > 0
    for w in s2.values():
        assert w["kv_blocks_used"] == 0 and w["num_requests"] == 0, w
    assert s2["prefill-0"]["leases_held"] == 0
    assert s2["prefill-0"]["leases_released"] == 2 * len(prompts) - len(whole_on_d)


def test_router_index_learns_prefill_blocks_from_events(disagg, loop_thread):
    ids = prompts_for(7, lengths=(80,))[0]
    loop_thread.run(collect(disagg.backend, "ev-0", ids, SamplingParams(max_tokens=2, temperature=0)))
    hashes = disagg.backend.hasher(ids)
    held = wait_for(lambda: disagg.backend.index.match(hashes).get("prefill-0", NO_MATCH).total == len(hashes))
    assert held, disagg.backend.index.match(hashes)


def test_first_token_can_end_the_request_on_the_prefill_worker(disagg, loop_thread, tiny_model):
    ids = prompts_for(3, lengths=(40,))[0]
    got = loop_thread.run(collect(disagg.backend, "one", ids, SamplingParams(max_tokens=1, temperature=0)))
    want = reference(tiny_model(), [ids], [SamplingParams(max_tokens=1, temperature=0)])[0]
    assert got["token_ids"] == want["token_ids"] and got["finish_reason"] == "length"


def test_client_leaving_mid_stream_frees_every_block(disagg, loop_thread):
    ids = prompts_for(4, lengths=(70,))[0]

    async def leave_early():
        stream = disagg.backend.generate("leave", ids, SamplingParams(max_tokens=400, ignore_eos=True, temperature=0))
        n = 0
        async for out in stream:
            n += len(out.new_token_ids)
            if n >= 3:
                break
        await stream.aclose()
        return n

    assert loop_thread.run(leave_early()) == 3
    free = wait_for(lambda: all(w["kv_blocks_used"] == 0 and w["num_requests"] == 0
                                for w in stats(loop_thread, disagg).values()))
    assert free, stats(loop_thread, disagg)


def test_conditional_disaggregation_prefills_short_prompts_on_the_decode_worker(cluster_factory, loop_thread, tiny_model):
    cluster = cluster_factory(**{"router.local_prefill_max_tokens": 32})
    short, long_ = prompts_for(5, lengths=(20, 100))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = run_all(loop_thread, cluster.backend, "cond", [short, long_], [params, params])
    want = reference(tiny_model(), [short, long_], [params, params])
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]
    s = stats(loop_thread, cluster)
    assert s["prefill-0"]["num_handoffs"] == 1  # only the long prompt went through the prefill worker
    assert s["decode-0"]["num_remote_kv_received"] == 1
    assert cluster.backend.counters["local_prefill"] == 1 and cluster.backend.counters["disaggregated"] == 1


@pytest.fixture(scope="module")
def faulty(cluster_factory):
    """Short lease and transfer timeouts, so faults resolve within a test."""
    return cluster_factory(**{"router.local_prefill_max_tokens": 0, "transfer.lease_timeout_s": 2.0,
                              "transfer.transfer_timeout_s": 1.5})


def test_lease_expires_when_no_decode_worker_fetches(faulty, loop_thread):
    p = faulty.prefill[0]
    ids = prompts_for(6, lengths=(50,))[0]
    first = loop_thread.run(p.prefill("orphan", ids, SamplingParams(max_tokens=5, temperature=0)))
    assert first.handoff is not None and first.handoff.lease_id
    s = stats(loop_thread, faulty)["prefill-0"]
    assert s["leases_held"] == 1 and s["kv_blocks_used"] == len(first.handoff.block_ids)
    expired = wait_for(lambda: stats(loop_thread, faulty)["prefill-0"]["leases_expired"] == 1, timeout_s=10)
    assert expired
    s = stats(loop_thread, faulty)["prefill-0"]
    assert s["kv_blocks_used"] == 0 and s["leases_held"] == 0


def _dead_prefill_handoff(faulty, loop_thread, tiny_model, rid, ids, params, decode_handles=()):
    """A prefill worker that hands off and dies before the decode worker pulls."""
    from cluster.launcher import _spawner
    from cluster.ray_client import RayWorkerClient
    from router.routing.policy import Role

    handle = _spawner(faulty.config, True)(Role.PREFILL, f"prefill-x-{rid}")
    info = ray.get(handle.info.remote())
    for d in (faulty.decode[0].handle, *decode_handles):
        ray.get(d.add_peers.remote([info.peer]))
    client = RayWorkerClient(handle, info)
    first = loop_thread.run(client.prefill(rid, ids, params))
    ray.kill(handle)
    assert wait_for(lambda: not _process_exists(info.pid), timeout_s=20), "the killed prefill worker lingers"
    return first


def _process_exists(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_failed_transfer_is_recomputed_and_counted(faulty, loop_thread, tiny_model):
    ids = prompts_for(8, lengths=(60,))[0]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = _dead_prefill_handoff(faulty, loop_thread, tiny_model, "dead-p", ids, params)
    before = stats(loop_thread, faulty)["decode-0"]

    async def decode():
        return [t async for out in faulty.decode[0].decode(first.handoff) for t in out.new_token_ids]

    rest = loop_thread.run(decode(), timeout=60)
    want = reference(tiny_model(), [ids], [params])[0]["token_ids"]
    assert first.new_token_ids + rest == want  # recomputed locally: same tokens
    after = stats(loop_thread, faulty)["decode-0"]
    assert after["num_remote_recomputes"] == before["num_remote_recomputes"] + 1
    assert after["transfers_failed"] == before["transfers_failed"] + 1
    assert after["kv_blocks_used"] == 0


def test_failed_transfer_without_recompute_ends_with_a_clear_error(faulty, loop_thread, tiny_model):
    import dataclasses

    from cluster.config import TransferConfig
    from cluster.launcher import _spawner
    from cluster.ray_client import RayWorkerClient
    from router.routing.policy import Role

    config = dataclasses.replace(faulty.config, transfer=TransferConfig(2.0, 1.5, recompute_on_failure=False))
    handle = _spawner(config, True)(Role.DECODE, "decode-strict")
    strict = RayWorkerClient(handle, ray.get(handle.info.remote()))
    ids = prompts_for(9, lengths=(45,))[0]
    first = _dead_prefill_handoff(faulty, loop_thread, tiny_model, "dead-p2", ids, SamplingParams(max_tokens=6),
                                  decode_handles=[handle])

    async def decode():
        return [out async for out in strict.decode(first.handoff)]

    outs = loop_thread.run(decode(), timeout=60)
    assert outs[-1].finished and outs[-1].finish_reason == "error"
    assert "KV transfer failed" in outs[-1].error
    s = loop_thread.run(strict.stats())
    assert s["num_remote_failures"] == 1 and s["num_remote_recomputes"] == 0
    assert s["kv_blocks_used"] == 0 and s["num_requests"] == 0
    ray.kill(handle)


def test_shared_redis_index_feeds_the_router(cluster_factory, loop_thread, redis_url, tiny_model):
    """`router.index: redis://`: workers publish to a real redis-server; the router's index follows the stream,
    and a second router (a fresh feed restored from the same stream) holds the same index."""
    from router.routing.feed import IndexFeed
    from router.routing.index import PrefixIndex
    from router.routing.load import LoadTracker
    from router.routing.redis_feed import RedisEventSource

    cluster = cluster_factory(**{"router.index": redis_url, "router.local_prefill_max_tokens": 0})
    prompts = prompts_for(11, lengths=(48, 80))
    params = [SamplingParams(max_tokens=4, temperature=0)] * 2
    got = run_all(loop_thread, cluster.backend, "redis", prompts, params)
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in reference(tiny_model(), prompts, params)]
    backend = cluster.backend
    assert wait_for(lambda: all(backend.index.match(backend.hasher(ids)).get("prefill-0", NO_MATCH).total == len(ids) // 16
                                for ids in prompts))
    second = IndexFeed(PrefixIndex(), LoadTracker())
    source = RedisEventSource(redis_url, second)
    source.restore()
    assert wait_for(lambda: source.catch_up() >= 0 and second.index.snapshot() == backend.index.snapshot())
    assert second.index.snapshot()["workers"].get("decode-0")  # both pools' events went through Redis
    source.close()


def test_killed_prefill_worker_leaves_the_pool_no_request_is_lost_and_it_is_replaced(cluster_factory, loop_thread,
                                                                                   tiny_model):
    cluster = cluster_factory(**{"prefill.num_workers": 2, "router.prefill_policy": "round_robin",
                                 "router.local_prefill_max_tokens": 0})
    victim = cluster.prefill[0]
    ray.kill(victim.handle)
    assert wait_for(lambda: not _process_exists(victim.info.pid), timeout_s=20)
    prompts = prompts_for(12, lengths=(30, 50, 70, 90))
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)] * len(prompts)
    got = run_all(loop_thread, cluster.backend, "kill", prompts, params)
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in reference(tiny_model(), prompts, params)]
    assert victim.worker_id in cluster.backend.lost and victim.worker_id not in cluster.backend.prefill
    # the pool is brought back to its target by a new worker
    assert wait_for(lambda: len(cluster.backend.prefill) == 2, timeout_s=90), (
        cluster.pools.autoscaler_view()["pools"], cluster.pools.counters,
        [(r.worker_id, r.state.value, r.reason) for r in cluster.pools.registry.records()], ray.available_resources())
    assert victim.worker_id not in cluster.backend.prefill
    assert all(s["kv_blocks_used"] == 0 for s in stats(loop_thread, cluster).values())
