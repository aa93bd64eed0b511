"""ClusterBackend's decisions and bookkeeping with scripted workers (fast; the real path is
tests/cluster/). Refusal of workers that hash differently is checked here: the router must fail loudly
at registration, not route silently with prefix hits that can never match."""
from __future__ import annotations

import asyncio

import pytest

from engine.errors import ConfigError
from engine.kv.events import BlockStored
from engine.kv.handoff import KVHandoff
from engine.kv.hashing import BlockHasher, kv_namespace
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from router.backend import ModelCard
from router.dispatch.cluster_backend import ClusterBackend
from router.routing.policy import NoWorkersError, Role
from router.workers.client import WorkerClient, WorkerDescriptor, check_fingerprints

B = 4


class Script(WorkerClient):
    """A worker that answers from a script: prefill returns a handoff, decode yields 3 tokens."""

    def __init__(self, worker_id: str, role: Role, fingerprint=None) -> None:
        self.descriptor = WorkerDescriptor(worker_id, role, fingerprint or BlockHasher(B).fingerprint, 1024)
        self.calls: list[tuple] = []

    async def prefill(self, request_id, prompt_token_ids, params):
        self.calls.append(("prefill", request_id))
        n = len(prompt_token_ids)
        handoff = KVHandoff(request_id, tuple(prompt_token_ids), 7, None, None, params, 1, tuple(range(-(-n // B))),
                            (), n, B, source=self.worker_id, lease_id="l")
        return RequestOutput(request_id, [7], "a", True, "remote", handoff=handoff, num_prompt_tokens=n,
                             num_cached_tokens=4)

    async def decode(self, handoff):
        self.calls.append(("decode", handoff.request_id))
        for i in range(3):
            await asyncio.sleep(0)
            yield RequestOutput(handoff.request_id, [8 + i], "b", i == 2, "length" if i == 2 else None)

    async def generate(self, request_id, prompt_token_ids, params):
        self.calls.append(("generate", request_id))
        yield RequestOutput(request_id, [9], "c", True, "length")

    async def abort(self, request_id):
        self.calls.append(("abort", request_id))

    async def release(self, request_id):
        self.calls.append(("release", request_id))

    async def alive(self):
        return True


def make(prefill=("p0", "p1"), decode=("d0",), threshold=0, **fingerprints):
    ps = [Script(w, Role.PREFILL, fingerprints.get(w)) for w in prefill]
    ds = [Script(w, Role.DECODE, fingerprints.get(w)) for w in decode]
    backend = ClusterBackend(ModelCard("m", 1024, 100), tokenizer=None, hasher=BlockHasher(B), prefill=ps, decode=ds,
                             local_prefill_max_tokens=threshold)
    return backend, ps, ds


async def collect(stream):
    return [out async for out in stream]


@pytest.mark.parametrize("field,fingerprint,needle", [
    ("block size", BlockHasher(8).fingerprint, "block size 4 (router) != 8 (worker)"),
    ("seed", BlockHasher(B, hash_seed=3).fingerprint, "hash seed 0 (router) != 3 (worker)"),
    ("namespace", BlockHasher(B, namespace="lora-a").fingerprint, "hash namespace"),
    ("kv dtype", BlockHasher(B, namespace=kv_namespace("", "int8")).fingerprint,  # an int8 KV worker, an fp32 router
     "hash namespace '' (router) != '\\x1fkv_cache_dtype=int8' (worker)"),
])
def test_workers_that_hash_differently_are_refused(field, fingerprint, needle):
    with pytest.raises(ConfigError, match="p1") as e:
        make(p1=fingerprint)
    assert needle in str(e.value)
    check_fingerprints(BlockHasher(B), [WorkerDescriptor("ok", Role.DECODE, BlockHasher(B).fingerprint, 1)])


def test_a_worker_that_holds_less_context_than_the_served_card_is_refused():
    """A worker started later (a replacement, a scale-up) whose KV cache came out smaller than the card's
    max_model_len would refuse requests the router lets through: it is not routed to."""
    backend, _, _ = make()
    short = Script("d1", Role.DECODE)
    short.descriptor = WorkerDescriptor("d1", Role.DECODE, BlockHasher(B).fingerprint, 512)
    backend.registry.add("d1", Role.DECODE, 0.0)
    with pytest.raises(ConfigError, match="worker d1 holds 512 tokens of context, the model is served with 1024"):
        backend.activate(short)
    assert "d1" not in backend.decode
    longer = Script("d2", Role.DECODE)  # more than the card is fine: the card is the minimum
    longer.descriptor = WorkerDescriptor("d2", Role.DECODE, BlockHasher(B).fingerprint, 4096)
    backend.registry.add("d2", Role.DECODE, 0.0)
    backend.activate(longer)
    assert "d2" in backend.decode


async def test_disaggregated_request_streams_first_token_then_decode_and_clears_load():
    backend, (p0, p1), (d0,) = make()
    outs = await collect(backend.generate("r", list(range(1, 20)), SamplingParams(max_tokens=3)))
    assert [o.new_token_ids for o in outs] == [[7], [8], [9], [10]]
    assert not outs[0].finished and outs[0].handoff is None  # the handoff never leaks to a front door
    assert [o.num_cached_tokens for o in outs[1:]] == [4, 4, 4]  # the prefill worker's cache hits
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert backend.tracker.num_inflight() == 0
    assert ("release", "r") not in p0.calls + p1.calls  # finished normally: the lease ended by the pull
    # what it asked of decode and what it generated: the autoscaler's forecast (router/routing/demand.py)
    # (decode's share: every token but the prefill's first; the script's workers send 4 for max_tokens 3)
    assert backend.demand.counters() == {"decode_requests_arrived": 1, "output_tokens_requested": 2,
                                         "kv_block_tokens_requested": -(-(2 * 20 + 2) // (2 * B)) * 2,
                                         "output_tokens_finished": 3, "output_tokens_finished_requested": 2}


async def test_short_uncached_prompt_is_prefilled_on_the_decode_worker():
    backend, ps, (d0,) = make(threshold=8)
    outs = await collect(backend.generate("s", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1)))
    assert [o.new_token_ids for o in outs] == [[9]] and d0.calls == [("generate", "s")]
    assert all(not p.calls for p in ps) and backend.counters["local_prefill"] == 1


async def test_leaving_early_aborts_on_decode_and_releases_the_lease():
    backend, ps, (d0,) = make()
    stream = backend.generate("x", list(range(1, 20)), SamplingParams(max_tokens=3))
    assert (await anext(stream)).new_token_ids == [7]
    assert (await anext(stream)).new_token_ids == [8]
    await stream.aclose()
    await asyncio.sleep(0.01)
    assert ("abort", "x") in d0.calls
    assert backend.demand.requests == 1 and backend.demand.finished_requested == 0  # left early: no output length
    assert any(("release", "x") in p.calls for p in ps)
    assert backend.tracker.num_inflight() == 0


async def test_a_worker_fault_becomes_an_error_output():
    backend, ps, (d0,) = make()

    async def broken(handoff):
        raise RuntimeError("actor died")
        yield  # pragma: no cover

    d0.decode = broken
    outs = await collect(backend.generate("f", list(range(1, 20)), SamplingParams(max_tokens=3)))
    assert outs[-1].finish_reason == "error" and "actor died" in outs[-1].error
    assert backend.counters["errors"] == 1 and backend.tracker.num_inflight() == 0


def dead(worker: Script) -> Script:
    async def fail(*a, **k):
        raise ConnectionError("actor died")

    async def no():
        return False

    worker.prefill = fail
    worker.alive = no
    return worker


async def test_a_dead_prefill_worker_is_removed_and_the_request_placed_again():
    backend, (p0, p1), (d0,) = make()
    dead(p0)
    outs = []
    for i in range(4):  # whichever worker the policy picks first, every request completes
        outs.append(await collect(backend.generate(f"r{i}", list(range(1, 20)), SamplingParams(max_tokens=3))))
    assert all([o.new_token_ids for o in out] == [[7], [8], [9], [10]] for out in outs)
    assert list(backend.prefill) == ["p1"] and "p0" in backend.lost
    assert backend.tracker.num_inflight() == 0 and backend.health().ok


async def test_when_every_decode_worker_is_gone_requests_end_with_a_clear_error():
    backend, (p0, p1), (d0,) = make(threshold=100)  # everything prefills on D

    async def fail(*a, **k):
        raise ConnectionError("actor died")
        yield  # pragma: no cover

    async def no():
        return False

    d0.generate, d0.alive = fail, no
    with pytest.raises(NoWorkersError, match="no decode worker"):  # before any output: the doors answer 503
        await collect(backend.generate("z", [1, 2, 3], SamplingParams(max_tokens=2)))
    assert not backend.health().ok and "d0" in backend.health().detail["lost_workers"]


class Dying(Script):
    """A decode worker that streams ``k`` tokens and then dies (its actor is gone)."""

    def __init__(self, worker_id: str, k: int) -> None:
        super().__init__(worker_id, Role.DECODE)
        self.k, self.dead = k, False

    async def decode(self, handoff):
        self.calls.append(("decode", handoff.request_id))
        for i in range(self.k):
            yield RequestOutput(handoff.request_id, [20 + i], "xy", False)
        self.dead = True
        raise ConnectionError("actor died")

    async def alive(self):
        return not self.dead


class Recording(Script):
    """Records the continuation it was handed; decodes the rest (its prefill worker sampled one token)."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id, Role.DECODE)
        self.asked: list[tuple] = []

    async def decode(self, handoff):
        self.asked.append((handoff.request_id, list(handoff.prompt_token_ids), handoff.params))
        n = handoff.params.max_tokens - 1
        for i in range(n):
            yield RequestOutput(handoff.request_id, [50 + i], "z", i == n - 1, "length" if i == n - 1 else None,
                                num_prompt_tokens=len(handoff.prompt_token_ids), num_output_tokens=i + 2,
                                num_cached_tokens=len(handoff.prompt_token_ids) - 1)


async def test_a_decode_worker_dying_mid_stream_is_migrated_from_where_the_client_is():
    dying, spare = Dying("d0", k=2), Recording("d1")
    ps = [Script("p0", Role.PREFILL)]
    backend = ClusterBackend(ModelCard("m", 1024, 100), tokenizer=None, hasher=BlockHasher(B), prefill=ps,
                             decode=[dying, spare], local_prefill_max_tokens=0)
    backend.decode_policy.choose = _prefer_first(backend.decode_policy.choose)  # D = d0 first
    prompt = list(range(1, 20))
    outs = await collect(backend.generate("r", prompt, SamplingParams(max_tokens=8, temperature=0.9, min_tokens=5)))
    tokens = [t for o in outs for t in o.new_token_ids]
    # first token from the prefill worker, two from d0, then the continuation (prefilled on p0, decoded on d1)
    assert tokens == [7, 20, 21, 7, 50, 51, 52, 53] and outs[-1].finished and outs[-1].finish_reason == "length"
    (rid, asked_prompt, asked), = spare.asked
    assert rid == "r~1" and asked_prompt == prompt + [7, 20, 21]
    assert (asked.max_tokens, asked.min_tokens) == (5, 2)
    assert asked.resume.num_output_tokens == 3 and asked.resume.num_emitted_chars == len("a" + "xy" * 2)
    assert asked.seed is not None  # the router seeded it so the continuation draws the same noise
    assert (outs[-1].num_prompt_tokens, outs[-1].num_output_tokens, outs[-1].num_cached_tokens) == (19, 8, 4)
    assert backend.counters["migrated"] == 1 and "d0" in backend.lost


async def test_salted_requests_are_routed_by_their_salted_hashes():
    """The router hashes a salted prompt as the engine does (engine/kv/hashing.py): a decode worker holding the
    prompt unsalted has none of it for a salted request, which therefore goes through a prefill worker,
    until the worker reports blocks under that salt."""
    backend, ps, (d0,) = make(threshold=0)
    prompt = list(range(1, 17))  # 4 full blocks
    backend.index.apply(BlockStored("d0", tuple(BlockHasher(B)(prompt)), None))
    plain, salted = SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, cache_salt="a", tenant_salt="t")
    await collect(backend.generate("plain", prompt, plain))
    await collect(backend.generate("salted", prompt, salted))
    assert d0.calls == [("generate", "plain"), ("decode", "salted")]  # plain: whole on D, no prefill
    assert [c for p in ps for c in p.calls if c[0] == "prefill"] == [("prefill", "salted")]
    backend.index.apply(BlockStored("d0", tuple(BlockHasher(B)(prompt, ("t", "a"))), None))
    await collect(backend.generate("salted-again", prompt, salted))
    assert d0.calls[-1] == ("generate", "salted-again")


async def test_a_migrated_request_keeps_its_salts():
    dying, spare = Dying("d0", k=1), Recording("d1")
    backend = ClusterBackend(ModelCard("m", 1024, 100), tokenizer=None, hasher=BlockHasher(B),
                             prefill=[Script("p0", Role.PREFILL)], decode=[dying, spare], local_prefill_max_tokens=0)
    backend.decode_policy.choose = _prefer_first(backend.decode_policy.choose)  # D = d0 first
    params = SamplingParams(max_tokens=4, temperature=0, cache_salt="a", tenant_salt="t")
    await collect(backend.generate("r", list(range(1, 20)), params))
    (_, _, asked), = spare.asked
    assert asked.resume is not None and asked.hash_salt == ("t", "a")


async def test_migrations_are_limited():
    dyings = [Dying(f"d{i}", k=1) for i in range(4)]
    backend = ClusterBackend(ModelCard("m", 1024, 100), tokenizer=None, hasher=BlockHasher(B),
                             prefill=[Script("p0", Role.PREFILL)], decode=dyings, local_prefill_max_tokens=0)
    outs = await collect(backend.generate("r", list(range(1, 20)), SamplingParams(max_tokens=50)))
    assert outs[-1].finish_reason == "error" and "migrations" in outs[-1].error
    assert backend.counters["migrated"] == 2


def _prefer_first(choose):
    def wrapped(role, workers, *args):
        return choose(role, sorted(workers)[:1], *args)
    return wrapped


async def test_longrope_requests_are_routed_by_their_factor_sets_hashes():
    """A LongRoPE model (pre-training length 16 here): the router fixes each request's factor set from prompt +
    max_tokens before it hashes, so a decode worker holding a prompt's blocks under the short set has none of
    them for the same prompt under the long set (other K values), and vice versa."""
    backend, ps, (d0,) = make(threshold=0)
    backend.card = ModelCard("m", 1024, 100, longrope_original_len=16)
    prompt = list(range(1, 13))  # 3 full blocks; reach 12 + 4 = 16: short, 12 + 5: long
    backend.index.apply(BlockStored("d0", tuple(BlockHasher(B)(prompt)), None))  # short = the unsalted chain
    await collect(backend.generate("short", prompt, SamplingParams(max_tokens=4)))
    await collect(backend.generate("long", prompt, SamplingParams(max_tokens=5)))
    assert d0.calls == [("generate", "short"), ("decode", "long")]  # long: its blocks are nowhere, so prefilled
    (prefilled,) = [c for p in ps for c in p.calls if c[0] == "prefill"]
    assert prefilled == ("prefill", "long")
    backend.index.apply(BlockStored("d0", tuple(BlockHasher(B)(prompt, ("", "", "longrope:long"))), None))
    await collect(backend.generate("long-again", prompt, SamplingParams(max_tokens=5)))
    assert d0.calls[-1] == ("generate", "long-again")


async def test_a_migrated_request_keeps_its_longrope_factor_set():
    """Resumed with prompt + tokens sent and the rest of max_tokens (the same reach), and the set fixed at
    admission (not chosen again by whoever takes the continuation)."""
    dying, spare = Dying("d0", k=1), Recording("d1")
    backend = ClusterBackend(ModelCard("m", 1024, 100, longrope_original_len=20), tokenizer=None,
                             hasher=BlockHasher(B), prefill=[Script("p0", Role.PREFILL)], decode=[dying, spare],
                             local_prefill_max_tokens=0)
    backend.decode_policy.choose = _prefer_first(backend.decode_policy.choose)  # D = d0 first
    await collect(backend.generate("r", list(range(1, 20)), SamplingParams(max_tokens=4, temperature=0)))
    (_, _, asked), = spare.asked
    assert asked.resume is not None and asked.rope_factors == "long" and asked.hash_salt[-1] == "longrope:long"
