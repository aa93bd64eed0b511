"""A worker flips between prefill and decode in place (decode_worker/role_worker.py), in this process with real
NIXL agents: two workers swap roles and serve the same prompts with the same greedy tokens, the flipped worker's
prefix cache is kept (its first event batch under the new id is the whole cached set, and a handoff of a
prompt it held pulls nothing), and every refusal — busy, a reload needed, the same role, the other role's
method — is a clear error that changes nothing."""
from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from decode_worker.role_worker import Worker
from engine.config import EngineConfig
from engine.kv.events import AllCleared, BlockStored
from engine.request import SamplingParams
from prefill_worker.base import FlipRefusedError, WorkerBusyError, WorkerOptions, WrongRoleError
from prefill_worker.event_sinks import MemoryEventLog
from proto.kv_codec import decode_batch

B = 16
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_config(tiny_model):
    return EngineConfig(model=str(tiny_model("llama")), num_blocks=64)


def options(worker_id: str, role: str) -> WorkerOptions:
    return WorkerOptions(worker_id=worker_id, role=role, lease_timeout_s=10.0, transfer_timeout_s=5.0)


@pytest.fixture(scope="module")
def pair(engine_config, loop):
    p = Worker(engine_config, options("prefill-0", "prefill"), [MemoryEventLog()])
    d = Worker(engine_config, options("decode-0", "decode"), [MemoryEventLog()])
    loop.run_until_complete(d.add_peers([p.peer_info()]))
    yield p, d
    for w in (p, d):
        w.shutdown()


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(2 * B, 4 * B))] for _ in range(n)]


async def serve(p: Worker, d: Worker, rid: str, ids: list[int]) -> list[int]:
    first = await p.prefill(rid, ids, PARAMS)
    tokens = list(first.new_token_ids)
    async for out in d.decode(first.handoff):
        tokens += out.new_token_ids
    return tokens


def flip(loop, worker: Worker, worker_id: str, role: str, engine_config):
    """Flip once the worker is idle: a prefill worker's lease ends on the decode side's NIXL notification,
    which lands a moment after the stream ended (the pool manager waits for idle the same way)."""
    async def wait_idle_then_flip():
        for _ in range(250):
            stats = await worker.stats()
            if not any(stats.get(k) for k in ("num_requests", "num_held", "leases_held", "waiting_for_blocks")):
                return await worker.flip_role(options(worker_id, role), engine_config)
            await asyncio.sleep(0.02)
        raise AssertionError(f"{worker.options.worker_id} never became idle: {stats}")

    return loop.run_until_complete(wait_idle_then_flip())


def test_two_workers_swap_roles_and_serve_the_same_tokens(pair, engine_config, loop):
    p, d = pair
    ps = prompts(3)
    before = [loop.run_until_complete(serve(p, d, f"before-{i}", ids)) for i, ids in enumerate(ps)]
    prefill_agent = p.peer_info().agent_name
    held = set(p.engine.hasher(ps[0]))

    new_d = flip(loop, p, "decode-1", "decode", engine_config)
    new_p = flip(loop, d, "prefill-1", "prefill", engine_config)
    assert (new_d.worker_id, new_d.role, new_p.worker_id, new_p.role) == ("decode-1", "decode", "prefill-1", "prefill")
    # the peer each reports is its new role's: the decode side's reading agent, a fresh prefill agent
    assert new_d.peer.agent_name == p.puller.peer_info.agent_name != prefill_agent
    assert new_p.peer.agent_name not in (d.puller.peer_info.agent_name, prefill_agent)
    assert p.puller.num_peers == 0 == d.puller.num_peers  # the flip forgot the old role's peers

    # the event plane starts over under the new id with the whole cached set: the prefix cache was kept
    batches, _, truncated = loop.run_until_complete(p.read_events(0))
    first = decode_batch(batches[0])
    assert not truncated and (first.worker, first.seq) == ("decode-1", 1)
    assert isinstance(first.events[0], AllCleared) and first.load.role == "decode"
    stored = {h for e in first.events if isinstance(e, BlockStored) for h in e.block_hashes}
    assert held <= stored

    loop.run_until_complete(p.add_peers([new_p.peer]))  # the handshake a decode worker gets
    hits_before = p.engine.stats.num_remote_prefix_hit_blocks
    after = [loop.run_until_complete(serve(d, p, f"after-{i}", ids)) for i, ids in enumerate(ps)]
    assert after == before
    # every full prompt block the old prefill worker computed is a prefix hit on it as a decode worker: not pulled
    assert p.engine.stats.num_remote_prefix_hit_blocks - hits_before == sum(len(ids) // B for ids in ps)

    # and back: both flip again, same tokens
    flip(loop, p, "prefill-2", "prefill", engine_config)
    back_d = flip(loop, d, "decode-2", "decode", engine_config)
    loop.run_until_complete(d.add_peers([p.peer_info()]))
    assert back_d.peer.agent_name == d.puller.peer_info.agent_name
    again = [loop.run_until_complete(serve(p, d, f"again-{i}", ids)) for i, ids in enumerate(ps)]
    assert again == before


def test_refusals_are_clear_and_change_nothing(pair, engine_config, loop):
    p, d = pair
    if p.options.role != "prefill":
        p, d = d, p
    name = p.options.worker_id
    ids = prompts(1)[0]
    first = loop.run_until_complete(p.prefill("busy-1", ids, PARAMS))  # its blocks now wait, leased, for d
    with pytest.raises(WorkerBusyError, match=r"1 KV leases held.*drain it"):
        loop.run_until_complete(p.flip_role(options("decode-9", "decode"), engine_config))
    with pytest.raises(FlipRefusedError, match=r"without reloading its engine: num_blocks 64 != 128"):
        loop.run_until_complete(p.flip_role(options("decode-9", "decode"), replace(engine_config, num_blocks=128)))
    with pytest.raises(FlipRefusedError, match="already is a prefill worker"):
        loop.run_until_complete(p.flip_role(options("prefill-9", "prefill"), engine_config))
    with pytest.raises(WrongRoleError, match="is a prefill worker, not decode"):
        loop.run_until_complete(p.add_peers([]))
    assert p.options.worker_id == name and p.options.role == "prefill"
    # nothing changed: the held request still completes
    tokens = list(first.new_token_ids)

    async def rest():
        async for out in d.decode(first.handoff):
            tokens.extend(out.new_token_ids)

    loop.run_until_complete(rest())
    assert len(tokens) == PARAMS.max_tokens
