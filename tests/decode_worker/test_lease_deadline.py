"""A handoff whose prefill-side lease ran out before the decode worker read it (the decode worker waited for
free blocks, or its pull queue, or the machine, for longer than the lease) must not be read: the prefill worker
has unpinned those blocks and may have written another prompt's KV into them, and NIXL reports a READ of reused
memory as a success. In this process, with real NIXL agents: the lease runs out, the prefill worker reuses the
very blocks for another prompt, then the decode worker gets the stale handoff — it recomputes the prompt
(counted) and the tokens are the fault-free run's, where reading the blocks gave another prompt's KV."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from decode_worker.role_worker import Worker
from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from prefill_worker.base import WorkerOptions
from prefill_worker.event_sinks import MemoryEventLog
from prefill_worker.puller import LEASE_CLOCK_MARGIN_S

B = 16
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LEASE_S = 3.0  # long enough for b's own handoff to be read well inside its lease, even on a busy machine


@pytest.fixture(scope="module")
def setup(tiny_model, loop):
    model = str(tiny_model("llama"))
    # the prefill worker holds one prompt: the second prompt must take the first one's freed blocks
    p = Worker(EngineConfig(model=model, num_blocks=5), WorkerOptions(
        worker_id="prefill-0", role="prefill", lease_timeout_s=LEASE_S, transfer_timeout_s=0.4), [MemoryEventLog()])
    d = Worker(EngineConfig(model=model, num_blocks=64), WorkerOptions(
        worker_id="decode-0", role="decode", lease_timeout_s=10.0, transfer_timeout_s=0.4), [MemoryEventLog()])
    loop.run_until_complete(d.add_peers([p.peer_info()]))
    yield p, d, Engine(EngineConfig(model=model, num_blocks=64))
    for w in (p, d):
        w.shutdown()


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(3 * B + 5)]  # 4 blocks of the prefill worker's 5


async def decode(d: Worker, handoff) -> list[int]:
    return [t async for out in d.decode(handoff) for t in out.new_token_ids]


def test_a_handoff_read_after_its_lease_ran_out_is_recomputed_not_read(setup, loop):
    p, d, reference = setup
    a, b = prompt(1), prompt(2)
    want = reference.generate([a], PARAMS)[0]["token_ids"]
    first = loop.run_until_complete(p.prefill("a", a, PARAMS))
    handoff = first.handoff
    assert handoff.lease_deadline_unix_s - time.time() <= LEASE_S  # the handoff says when its lease ends
    blocks_of_a = set(handoff.block_ids)

    async def lease_ends():
        while (await p.stats())["leases_held"]:
            await asyncio.sleep(0.02)
    loop.run_until_complete(asyncio.wait_for(lease_ends(), 5 * LEASE_S))
    assert loop.run_until_complete(p.stats())["leases_expired"] >= 1
    # the prefill worker reuses a's blocks for b (its pool has no others): a's handoff now names b's KV
    second = loop.run_until_complete(p.prefill("b", b, PARAMS))
    assert blocks_of_a & set(second.handoff.block_ids)
    before = loop.run_until_complete(d.stats())
    # b's own handoff is fresh: read, not recomputed, and exact
    want_b = reference.generate([b], PARAMS)[0]["token_ids"]
    assert [second.new_token_ids[0]] + loop.run_until_complete(decode(d, second.handoff)) == want_b
    mid = loop.run_until_complete(d.stats())
    assert mid["transfers_ok"] == before["transfers_ok"] + 1
    assert mid["num_remote_recomputes"] == before["num_remote_recomputes"]
    # a's stale handoff: its blocks hold b's KV now (read, it gave another text from token 1 on)
    tokens = [first.new_token_ids[0]] + loop.run_until_complete(decode(d, handoff))
    after = loop.run_until_complete(d.stats())
    assert tokens == want  # recomputed on the decode worker: exact
    assert after["num_remote_recomputes"] - mid["num_remote_recomputes"] == 1
    assert after["transfers_past_lease"] - mid["transfers_past_lease"] == 1
    assert after["transfers_ok"] == mid["transfers_ok"]

def test_the_margin_leaves_room_under_the_leases_the_cluster_uses():
    from prefill_worker.base import WorkerOptions as Options

    defaults = Options(worker_id="x", role="prefill")
    assert defaults.transfer_timeout_s + LEASE_CLOCK_MARGIN_S < defaults.lease_timeout_s
