"""Prefill workers lend each other prefix blocks (the cluster pool): one worker exports blocks it holds on its
device or host tier under a lease, another reads them over real NIXL instead of recomputing. Two workers in this
process (their engines on their own threads, real agents); outputs equal to a worker that computed everything,
bytes equal, a failed read recomputed and counted, every lease ended."""
from __future__ import annotations

import random
import time

import pytest
import torch

from decode_worker.role_worker import Worker
from engine.config import EngineConfig
from engine.request import SamplingParams
from prefill_worker.base import WorkerOptions

B = 16
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def make_worker(model_dir, name, num_blocks=64, host_blocks=0):
    probe = EngineConfig(model=str(model_dir), num_blocks=2)
    from engine.engine import Engine

    engine = Engine(probe)
    bpb = engine.runner.bytes_per_block
    engine.close()
    config = EngineConfig(model=str(model_dir), num_blocks=num_blocks, kv_host_bytes=host_blocks * bpb)
    return Worker(config, WorkerOptions(worker_id=name, role="prefill", lease_timeout_s=5.0,
                                               transfer_timeout_s=2.0))


@pytest.fixture(scope="module")
def workers(tiny_model, loop):
    model_dir = tiny_model("llama")
    a = make_worker(model_dir, "prefill-a", num_blocks=24, host_blocks=64)
    b = make_worker(model_dir, "prefill-b")
    fresh = make_worker(model_dir, "prefill-fresh")
    loop.run_until_complete(b.add_import_peers([a.peer_info()]))
    yield a, b, fresh
    for w in (a, b, fresh):
        w.shutdown()


def prompt(seed, n_blocks, tail=5):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n_blocks * B + tail)]


def prefill(loop, worker, rid, tokens, peer=None):
    return loop.run_until_complete(worker.prefill(rid, tokens, PARAMS, peer=peer))


def call(loop, worker, fn):
    from prefill_worker.base import _wrap

    return loop.run_until_complete(_wrap(worker.aengine.call(fn)))


def wait_leases_end(loop, worker, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if call(loop, worker, lambda e: len(worker.role.leases)) == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"{worker.options.worker_id} still holds leases")


def test_peer_blocks_are_read_not_recomputed(loop, workers):
    a, b, fresh = workers
    shared = prompt(1, 6, tail=0)
    first = prefill(loop, a, "a-1", shared + [9, 9, 9])
    loop.run_until_complete(a.release("a-1"))
    mine = shared + [11, 12, 13]
    hashes = b.engine.hasher(mine)
    peer = loop.run_until_complete(a.export_blocks(hashes, mine, 0))
    assert peer is not None and len(peer.remote_block_ids) == 6
    before = b.engine.stats.num_computed_tokens
    out = prefill(loop, b, "b-1", mine, peer=peer)
    computed = b.engine.stats.num_computed_tokens - before
    expected = prefill(loop, fresh, "f-1", mine)
    assert out.new_token_ids == expected.new_token_ids
    assert computed == len(mine) - 6 * B  # only the tail ran
    assert b.engine.scheduler.num_peer_hit_tokens == 6 * B
    # the bytes b read are a's bytes
    b_blocks = call(loop, b, lambda e: [e.pool.get_cached_block(h, mine[i * B:(i + 1) * B]).block_id
                                        for i, h in enumerate(hashes[:6])])
    a_blocks = call(loop, a, lambda e: [e.pool.get_cached_block(h, mine[i * B:(i + 1) * B]).block_id
                                        for i, h in enumerate(hashes[:6])])
    assert torch.equal(b.engine.runner.kv_cache[b_blocks], a.engine.runner.kv_cache[a_blocks])
    wait_leases_end(loop, a)
    del first


def test_blocks_on_the_peers_host_tier_are_read_too(loop, workers):
    a, b, fresh = workers
    shared = prompt(2, 5, tail=0)
    prefill(loop, a, "a-2", shared + [1, 2])
    loop.run_until_complete(a.release("a-2"))
    for i in range(4):  # push it off a's 24-block device tier: it stays on a's host tier
        prefill(loop, a, f"a-push-{i}", prompt(100 + i, 6))
        loop.run_until_complete(a.release(f"a-push-{i}"))
    mine = shared + [3, 4, 5]
    hashes = b.engine.hasher(mine)
    assert call(loop, a, lambda e: e.pool.get_cached_block(hashes[0], mine[:B])) is None
    peer = loop.run_until_complete(a.export_blocks(hashes, mine, 0))
    n_cache = a.engine.pool.num_blocks
    assert peer is not None and len(peer.remote_block_ids) == 5
    assert all(r >= n_cache for r in peer.remote_block_ids), "expected host-tier ids"
    out = prefill(loop, b, "b-2", mine, peer=peer)
    assert out.new_token_ids == prefill(loop, fresh, "f-2", mine).new_token_ids
    wait_leases_end(loop, a)


def test_unused_peer_blocks_release_the_lease(loop, workers):
    a, b, _ = workers
    shared = prompt(3, 3, tail=0)
    prefill(loop, a, "a-3", shared + [1])
    loop.run_until_complete(a.release("a-3"))
    prefill(loop, b, "b-3a", shared + [2])  # b has it itself now
    loop.run_until_complete(b.release("b-3a"))
    mine = shared + [7, 7]
    peer = loop.run_until_complete(a.export_blocks(b.engine.hasher(mine), mine, 0))
    counters_before = a.role.leases.counters.released
    prefill(loop, b, "b-3", mine, peer=peer)
    wait_leases_end(loop, a)
    assert a.role.leases.counters.released == counters_before + 1  # ended by b's notice, not by its deadline


def test_failed_peer_read_is_recomputed_and_counted(loop, workers):
    a, b, fresh = workers
    shared = prompt(4, 4, tail=0)
    prefill(loop, a, "a-4", shared + [1])
    loop.run_until_complete(a.release("a-4"))
    mine = shared + [8, 8, 8]
    peer = loop.run_until_complete(a.export_blocks(b.engine.hasher(mine), mine, 0))
    from dataclasses import replace

    bogus = replace(peer, source="no-such-agent")  # a peer b never met (or one that died): the read fails
    failures = b.engine.stats.num_peer_import_failures
    out = prefill(loop, b, "b-4", mine, peer=bogus)
    assert out.new_token_ids == prefill(loop, fresh, "f-4", mine).new_token_ids
    assert b.engine.stats.num_peer_import_failures == failures + 1
    # a's lease is never released by b (it could not reach it): it ends at its deadline
    deadline = time.monotonic() + 8
    while call(loop, a, lambda e: len(a.role.leases)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert call(loop, a, lambda e: len(a.role.leases)) == 0
    call(loop, a, lambda e: e.pool.check())
    call(loop, b, lambda e: e.pool.check())
