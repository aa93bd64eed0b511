"""A draining prefill worker's handoffs go first on a full decode worker (decode_worker/worker.py ``pull_first``),
in this process with real NIXL agents and real engines. The decode worker's pool holds one request at a time, and
each pull is delayed (fault injection), so the order in which waiting handoffs are admitted is the order in which
the requests finish:
- by default, in arrival order;
- once told that a prefill worker drains, its handoff is admitted before one that arrived earlier, and while it
  waits for room nothing overtakes it — not even a small handoff that would fit;
- every stream's tokens are the single-engine run's."""
from __future__ import annotations

import asyncio
import random

import pytest

from decode_worker.role_worker import Worker
from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from prefill_worker.base import WorkerOptions
from prefill_worker.event_sinks import MemoryEventLog

B = 16
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_model, loop):
    model = str(tiny_model("llama"))
    a, b = (Worker(EngineConfig(model=model, num_blocks=64), WorkerOptions(
        worker_id=f"prefill-{i}", role="prefill", lease_timeout_s=30.0, transfer_timeout_s=5.0), [MemoryEventLog()])
        for i in range(2))
    # 7 blocks: a 4-block prompt and its output fit, two of them do not
    d = Worker(EngineConfig(model=model, num_blocks=7), WorkerOptions(
        worker_id="decode-0", role="decode", lease_timeout_s=30.0, transfer_timeout_s=5.0, fault_pull_delay_s=0.3),
        [MemoryEventLog()])
    loop.run_until_complete(d.add_peers([a.peer_info(), b.peer_info()]))
    yield a, b, d, Engine(EngineConfig(model=model, num_blocks=64))
    for w in (a, b, d):
        w.shutdown()


def prompt(seed: int, n: int = 3 * B + 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


async def until(d: Worker, **want) -> None:
    for _ in range(500):
        stats = await d.stats()
        if all(stats[k] == v for k, v in want.items()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"decode worker never reached {want}: {stats}")


async def serve_in_order(d: Worker, handoffs: list, firsts: list[int], before_each=None) -> tuple[list[str], dict]:
    """Hand off one after the other (each waits until the previous one is reserved or queued); the order the
    streams finish in, and each stream's tokens."""
    done, tokens = [], {}

    async def one(h, first):
        out = [first]
        async for o in d.decode(h):
            out += o.new_token_ids
        tokens[h.request_id] = out
        done.append(h.request_id)

    tasks = []
    for i, (h, first) in enumerate(zip(handoffs, firsts)):
        tasks.append(asyncio.ensure_future(one(h, first)))
        if i == 0:
            await until(d, remote_pending=1)
        else:
            await until(d, waiting_for_blocks=i)
        if before_each is not None:
            await before_each(i)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return done, tokens


def test_a_draining_prefill_workers_handoffs_go_first_and_nothing_overtakes_them(setup, loop):
    a, b, d, reference = setup

    def prefill(worker, rid, ids):
        out = loop.run_until_complete(worker.prefill(rid, ids, PARAMS))
        return out.handoff, out.new_token_ids[0]

    # by default: in arrival order
    ids = {f"r{i}": prompt(i) for i in range(3)}
    hs = [prefill(a, "r0", ids["r0"]), prefill(a, "r1", ids["r1"]), prefill(b, "r2", ids["r2"])]
    done, tokens = loop.run_until_complete(serve_in_order(d, [h for h, _ in hs], [f for _, f in hs]))
    assert done == ["r0", "r1", "r2"]
    assert loop.run_until_complete(d.stats())["handoffs_first"] == 0

    # b drains: its handoff (arrived last) is admitted before a's; a small handoff of a's that would fit in the
    # room left waits behind it too
    loop.run_until_complete(d.pull_first([b.peer_info().agent_name]))
    ids.update({f"s{i}": prompt(10 + i) for i in range(3)})
    ids["small"] = prompt(20, B + 2)
    hs = [prefill(a, "s0", ids["s0"]), prefill(a, "s1", ids["s1"]), prefill(b, "s2", ids["s2"]),
          prefill(a, "small", ids["small"])]
    seen = {}

    async def look(i):
        if i == 3:  # s0 reserved, s1 / s2 / small waiting: small was not admitted although it fits
            seen.update(await d.stats())

    done2, tokens2 = loop.run_until_complete(serve_in_order(d, [h for h, _ in hs], [f for _, f in hs], look))
    assert seen["num_requests"] == 1 and seen["waiting_for_blocks"] == 3, seen
    assert done2[0] == "s0" and done2.index("s2") < done2.index("s1"), done2
    stats = loop.run_until_complete(d.stats())
    assert stats["handoffs_first"] == 1 and stats["draining_sources"] == 1

    for rid, out in {**tokens, **tokens2}.items():
        assert out == reference.generate([ids[rid]], PARAMS)[0]["token_ids"], rid

    # forgetting the drained worker ends its priority
    loop.run_until_complete(d.remove_peers([b.peer_info().agent_name]))
    assert loop.run_until_complete(d.stats())["draining_sources"] == 0
