"""Engine-level disaggregation: prefill engine → (block copy) → decode engine equals one engine.

The KV blocks move here by a direct tensor copy between two in-process engines — a fast check of the
engine hooks alone. The real path (separate processes, NIXL) is tested in tests/kvtransfer and the
worker tests.
"""
from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.kv.hashing import BlockHasher
from engine.request import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


def engine(model_dir, **kw):
    kw.setdefault("num_blocks", 128)
    return Engine(EngineConfig(model=str(model_dir), **kw))


def copy_blocks(src: Engine, dst: Engine, plan):
    for r, l in zip(plan.remote_block_ids, plan.local_block_ids):
        dst.runner.kv_cache[l].copy_(src.runner.kv_cache[r])


def run_disagg(P: Engine, D: Engine, prompts, params_list, copy=copy_blocks):
    """Prefill each prompt on P, hand off (``copy(P, D, plan)`` moves the blocks), decode on D. Returns token lists
    (first token included)."""
    results = {}
    for i, (p, sp) in enumerate(zip(prompts, params_list)):
        P.add_request(f"r{i}", prompt_token_ids=p, params=sp, remote_decode=True)
    while P.has_unfinished_requests():
        for out in P.step():
            results[out.request_id] = list(out.new_token_ids)
            if out.handoff is not None:
                plan = D.reserve_remote(out.handoff)
                assert plan is not None
                copy(P, D, plan)
                assert P.release_held(out.request_id)
                assert D.commit_remote(out.request_id)
    while D.has_unfinished_requests():
        for out in D.step():
            results[out.request_id] += out.new_token_ids
    for e in (P, D):
        e.pool.check()
        assert e.pool.num_used_blocks == 0 and not e.held and not e.remote_pending
    return [results[f"r{i}"] for i in range(len(prompts))]


def workload(seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 16, 33, 90)]
    prompts += [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (5, 17)]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True) for _ in prompts]
    params[2] = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    params[4] = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)  # ends on the prefill side
    return prompts, params


def test_disaggregated_equals_colocated_cold_and_warm(model_dir):
    prompts, params = workload()
    colocated = [r["token_ids"] for r in engine(model_dir).generate(prompts, params)]
    P, D = engine(model_dir), engine(model_dir)
    assert run_disagg(P, D, prompts, params) == colocated  # cold caches
    received = D.stats.num_remote_blocks_received
    assert run_disagg(P, D, prompts, params) == colocated  # both caches warm
    assert D.stats.num_remote_prefix_hit_blocks > 0
    # warm D fetched only the partial last blocks (partial blocks are never cached)
    handed_off = [p for p, sp in zip(prompts, params) if sp.max_tokens > 1]
    assert D.stats.num_remote_blocks_received - received == sum(1 for p in handed_off if len(p) % 16) < received
    assert P.stats.num_handoffs == 2 * (len(prompts) - 1)


def test_salted_handoff_is_rehashed_with_the_salt_on_the_decode_side(model_dir):
    """The decode engine hashes a handed-off prompt with the request's salts (they travel in the params):
    its hashes equal the prefill engine's, it reuses its own blocks only under the same salts, and the
    tokens equal an unsalted colocated run."""
    rng = random.Random(3)
    prompt = [rng.randrange(3, 500) for _ in range(50)]  # 3 full blocks
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    salted = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, cache_salt="s", tenant_salt="t")
    other = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, cache_salt="s2", tenant_salt="t")
    want = engine(model_dir).generate([prompt], plain)[0]["token_ids"]
    P, D = engine(model_dir), engine(model_dir)
    assert run_disagg(P, D, [prompt], [plain]) == [want]
    hits = D.stats.num_remote_prefix_hit_blocks
    assert run_disagg(P, D, [prompt], [salted]) == [want]
    assert D.stats.num_remote_prefix_hit_blocks == hits  # D held the prompt, but unsalted
    P.add_request("h", prompt_token_ids=prompt, params=salted, remote_decode=True)
    handoff = next(o.handoff for o in P.step() if o.handoff)
    assert handoff.params.hash_salt == ("t", "s")
    assert list(handoff.block_hashes) == BlockHasher(16)(prompt, ("t", "s"))
    plan = D.reserve_remote(handoff)
    assert D.requests["h"].block_hashes[:3] == list(handoff.block_hashes)
    assert plan.num_local_hit_blocks == 3  # its own salted blocks, reused
    copy_blocks(P, D, plan)
    assert P.release_held("h") and D.commit_remote("h")
    tokens = [handoff.first_token_id]
    while D.has_unfinished_requests():
        tokens += sum((o.new_token_ids for o in D.step()), [])
    assert tokens == want
    assert run_disagg(P, D, [prompt], [other]) == [want]
    assert D.stats.num_remote_prefix_hit_blocks == hits + 3  # only the same-salt handoff hit


def test_failed_transfer_recompute_or_error(model_dir):
    P, D = engine(model_dir), engine(model_dir)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = list(range(3, 40))
    want = engine(model_dir).generate([prompt], sp)[0]["token_ids"]
    P.add_request("a", prompt_token_ids=prompt, params=sp, remote_decode=True)
    P.add_request("b", prompt_token_ids=prompt[:20], params=sp, remote_decode=True)
    handoffs = {}
    while P.has_unfinished_requests():
        handoffs.update({o.request_id: o.handoff for o in P.step() if o.handoff})
    for rid in handoffs:
        P.release_held(rid)
    assert P.pool.num_used_blocks == 0
    assert D.reserve_remote(handoffs["a"]) is not None
    D.fail_remote("a", "peer died", recompute=True)  # KV never arrived: recompute locally
    assert D.reserve_remote(handoffs["b"]) is not None
    D.fail_remote("b", "peer died", recompute=False)
    outs = {}
    while D.has_unfinished_requests():
        for o in D.step():
            outs.setdefault(o.request_id, []).append(o)
    assert [handoffs["a"].first_token_id] + sum((o.new_token_ids for o in outs["a"]), []) == want
    assert outs["b"][-1].finish_reason == "error" and outs["b"][-1].error == "peer died"
    assert D.stats.num_remote_recomputes == 1 and D.stats.num_remote_failures == 1
    D.pool.check()
    assert D.pool.num_used_blocks == 0


def test_abort_while_kv_in_flight_frees_only_after_transfer(model_dir):
    P, D = engine(model_dir), engine(model_dir)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    P.add_request("a", prompt_token_ids=list(range(3, 60)), params=sp, remote_decode=True)
    handoff = next(o.handoff for o in P.step() if o.handoff)
    plan = D.reserve_remote(handoff)
    assert D.abort_request("a")
    assert D.pool.num_used_blocks == len(plan.local_block_ids)  # still the transfer's target
    assert not D.commit_remote("a")
    assert D.pool.num_used_blocks == 0
    P.release_held("a")
    for e in (P, D):
        e.pool.check()


def test_reserve_remote_refuses_mismatch_and_full_pool(model_dir):
    P = engine(model_dir)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    P.add_request("a", prompt_token_ids=list(range(3, 80)), params=sp, remote_decode=True)
    handoff = next(o.handoff for o in P.step() if o.handoff)
    with pytest.raises(InvalidRequestError, match="block size"):
        engine(model_dir, block_size=32).reserve_remote(handoff)
    small = engine(model_dir, num_blocks=8)
    small.add_request("hog", prompt_token_ids=list(range(100, 157)), params=sp)  # 4 of 8 blocks
    small.step()
    assert small.reserve_remote(handoff) is None  # no room now; the caller retries later
    assert "a" not in small.requests


def test_received_kv_filling_the_pool_cannot_deadlock_the_decode_engine(model_dir):
    """Two handed-off prompts of exactly 3 blocks fill a 6-block decode pool; each needs a 4th block to
    decode. Nothing runs, nothing fits: the newest gives its blocks back and recomputes (a preemption),
    the other runs — both finish with the colocated tokens instead of the engine waiting forever."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(48)] for _ in range(2)]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)] * 2
    colocated = [r["token_ids"] for r in engine(model_dir).generate(prompts, params)]
    P, D = engine(model_dir), engine(model_dir, num_blocks=6)
    first = {}
    for i, p in enumerate(prompts):
        P.add_request(f"r{i}", prompt_token_ids=p, params=params[i], remote_decode=True)
    while P.has_unfinished_requests():
        for out in P.step():
            first[out.request_id] = list(out.new_token_ids)
            plan = D.reserve_remote(out.handoff)
            assert plan is not None
            copy_blocks(P, D, plan)
            P.release_held(out.request_id)
            D.commit_remote(out.request_id)
    assert D.pool.num_used_blocks == 6 and len(D.scheduler.waiting) == 2  # full, and nothing can run as it is
    steps = 0
    while D.has_unfinished_requests():
        for out in D.step():
            first[out.request_id] += out.new_token_ids
        steps += 1
        assert steps < 200, "the decode engine made no progress"
    assert [first["r0"], first["r1"]] == colocated
    assert D.scheduler.num_preemptions >= 1
    D.pool.check()
    assert D.pool.num_used_blocks == 0


def test_a_decode_engine_keeps_room_for_its_running_sequences_to_grow(model_dir):
    """The handoff watermark (kv_handoff_reserve_tokens): a full decode worker stops admitting instead of
    admitting and then preempting a running sequence (which recomputes its whole prompt)."""
    P = engine(model_dir)
    sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    P.add_request("a", prompt_token_ids=list(range(3, 80)), params=sp, remote_decode=True)  # 77 tokens: 5 blocks
    handoff = next(o.handoff for o in P.step() if o.handoff)

    def decode_engine(reserve: int, hog: bool) -> Engine:
        D = engine(model_dir, num_blocks=15, kv_handoff_reserve_tokens=reserve)
        if hog:  # 40 tokens (3 blocks) that will grow to 104 (7 blocks): 4 more
            D.add_request("hog", prompt_token_ids=list(range(100, 140)), params=sp)
            D.step()
            assert D.scheduler.running
        return D

    # 12 blocks free; the handoff takes 5 and both sequences may grow by 64 tokens: 4 + 4 more
    assert decode_engine(0, hog=True).reserve_remote(handoff) is not None  # no reserve: 5 <= 12
    assert decode_engine(64, hog=True).reserve_remote(handoff) is None  # 5 + 8 > 12: wait for room
    assert decode_engine(32, hog=True).reserve_remote(handoff) is not None  # 5 + 2 + 2 <= 12
    assert decode_engine(64, hog=False).reserve_remote(handoff) is not None  # alone: admitted when its prompt fits
    with pytest.raises(Exception, match="kv_handoff_reserve_tokens"):
        engine(model_dir, kv_handoff_reserve_tokens=-1)


def test_the_first_token_carries_its_queue_and_compute_time_and_engine_counts_its_work(model_dir):
    P, D = engine(model_dir), engine(model_dir)
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    P.add_request("a", prompt_token_ids=list(range(3, 80)), params=sp, remote_decode=True)
    first = next(o for o in P.step() if o.handoff)
    parts = first.ttft_parts
    assert parts is not None and parts["queue_s"] >= 0 and parts["compute_s"] > 0
    assert P.stats.busy_s >= parts["compute_s"] * 0.5 and P.stats.num_prefill_tokens_computed == 77
    plan = D.reserve_remote(first.handoff)
    copy_blocks(P, D, plan)
    assert D.commit_remote("a")
    outs = [o for _ in range(4) for o in D.step()]
    assert outs and all(o.ttft_parts is None for o in outs)  # arrived with its KV: no first token here
    assert D.stats.num_decode_steps == 2 and D.stats.num_decode_tokens == 2 and D.stats.num_prefill_tokens_computed == 0
