"""Engine behaviour: prefix caching, preemption and chunked prefill leave outputs unchanged, exact block
accounting, bad input, sampling semantics."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.kv.events import BlockStored
from engine.kv.hashing import BlockHasher
from engine.request import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompts_with_shared_prefix(n=6, prefix_len=256, seed=1):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def run(engine, prompts, params=GREEDY):
    res = engine.generate(prompts, params)
    engine.pool.check()
    assert engine.pool.num_used_blocks == 0
    return [r["token_ids"] for r in res]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


def make_engine(model_dir, **kw):
    kw.setdefault("num_blocks", 256)
    return Engine(EngineConfig(model=str(model_dir), **kw))


def test_prefix_cache_on_off_same_outputs(model_dir):
    prompts = prompts_with_shared_prefix()
    on = run(make_engine(model_dir), prompts)
    off = run(make_engine(model_dir, enable_prefix_caching=False), prompts)
    assert on == off


def test_shared_prefix_computes_only_new_tokens(model_dir):
    engine = make_engine(model_dir)
    first, second = prompts_with_shared_prefix(n=2)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    run(engine, [first], params)
    before = engine.stats.num_computed_tokens
    req = engine.add_request(prompt_token_ids=second, params=params)
    while engine.has_unfinished_requests():
        engine.step()
    assert req.num_cached_prompt_tokens == 256
    assert engine.stats.num_computed_tokens - before == len(second) - 256
    # without the cache every prompt token is computed
    cold = make_engine(model_dir, enable_prefix_caching=False)
    run(cold, [second], params)
    assert cold.stats.num_computed_tokens == len(second)


def test_preemption_and_chunked_prefill_do_not_change_outputs(model_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 70, 130, 33, 200, 9, 64, 100)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    base = run(make_engine(model_dir, num_blocks=512, max_num_batched_tokens=2048), prompts, params)
    tight = make_engine(model_dir, num_blocks=24, max_num_batched_tokens=48, enable_prefix_caching=False)
    assert run(tight, prompts, params) == base
    assert tight.scheduler.num_preemptions > 0
    chunked = make_engine(model_dir, max_num_batched_tokens=16)
    assert run(chunked, prompts, params) == base
    assert chunked.stats.num_steps > len(prompts)


def test_seeded_sampling_is_batch_invariant(model_dir):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    alone = run(make_engine(model_dir), [prompt], params)[0]
    others = [[11, 12, 13], list(range(20, 90))]
    batched = run(make_engine(model_dir), [others[0], prompt, others[1]],
                  [SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True), params,
                   SamplingParams(max_tokens=5, temperature=0.5, ignore_eos=True)])[1]
    assert alone == batched
    other_seed = run(make_engine(model_dir), [prompt], SamplingParams(max_tokens=20, temperature=0.8, seed=99,
                                                                      ignore_eos=True))[0]
    assert other_seed != alone


def test_top_k_1_and_tiny_top_p_are_greedy(model_dir):
    prompt = [[7, 8, 9, 10]]
    greedy = run(make_engine(model_dir), prompt)[0]
    assert run(make_engine(model_dir), prompt, SamplingParams(max_tokens=24, temperature=1.5, top_k=1, seed=3,
                                                              ignore_eos=True))[0] == greedy
    assert run(make_engine(model_dir), prompt, SamplingParams(max_tokens=24, temperature=1.5, top_p=1e-6, seed=3,
                                                              ignore_eos=True))[0] == greedy


def test_sampling_distribution_matches_softmax(model_dir):
    """The empirical first-token distribution at temperature 1 matches softmax(logits) (chi-square-ish)."""
    engine = make_engine(model_dir)
    prompt = [40, 41, 42]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        hf_logits = hf(torch.tensor([prompt])).logits[0, -1]
    probs = torch.softmax(hf_logits / 2.0, dim=-1)  # temperature 2 spreads the mass
    n = 400
    for i in range(n):
        engine.add_request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=1, temperature=2.0, seed=i))
    counts = torch.zeros_like(probs)
    while engine.has_unfinished_requests():
        for out in engine.step():
            for t in out.new_token_ids:
                counts[t] += 1
    top = probs.topk(3).indices
    for t in top:  # the most likely tokens appear about as often as softmax says
        expected = float(probs[t]) * n
        assert abs(counts[t] - expected) < 4 * (expected ** 0.5) + 3
    assert counts.sum() == n


def test_logprobs_match_transformers(model_dir):
    from transformers import AutoModelForCausalLM

    prompt = [3, 14, 15, 92, 65]
    engine = make_engine(model_dir)
    req = engine.add_request(prompt_token_ids=prompt,
                             params=SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + req.output_token_ids[:-1]])).logits[0, len(prompt) - 1:]
    ref = torch.log_softmax(logits, dim=-1)
    for i, t in enumerate(req.output_token_ids):
        assert req.output_logprobs[i] == pytest.approx(float(ref[i, t]), abs=1e-4)
        assert set(req.output_top_logprobs[i]) == set(ref[i].topk(2).indices.tolist())


def test_stop_token_ids_and_max_tokens(model_dir):
    engine = make_engine(model_dir)
    full = run(engine, [[9, 9, 9]])[0]
    stop_at = full[5]
    first = full.index(stop_at)
    res = engine.generate([[9, 9, 9]], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop_at,),
                                                      ignore_eos=True))[0]
    assert res["token_ids"] == full[: first + 1] and res["finish_reason"] == "stop"
    res = engine.generate([[9, 9, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert res["token_ids"] == full[:4] and res["finish_reason"] == "length"


def test_stop_string_cuts_text_and_never_streams_it(model_dir):
    engine = make_engine(model_dir)
    prompt = engine.tokenizer.encode("the river and the mountain")
    full = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    text = full["text"]
    assert len(text) > 12
    stop = text[8:11]
    engine.add_request(prompt_token_ids=prompt,
                       params=SamplingParams(max_tokens=40, temperature=0, stop=(stop,), ignore_eos=True))
    streamed = ""
    finish = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.new_text
            assert stop not in streamed
            finish = out.finish_reason or finish
            stop_reason = out.stop_reason
    assert streamed == text[: text.index(stop)]
    assert finish == "stop" and stop_reason == stop


def run_one(engine, prompt, params):
    """(request, its last output) after running ``prompt`` alone to the end."""
    req = engine.add_request(prompt_token_ids=prompt, params=params)
    last = None
    while engine.has_unfinished_requests():
        last = next((o for o in engine.step() if o.request_id == req.request_id), last)
    return req, last


def test_cache_salt_isolates_prefix_hits(model_dir):
    """Tenant isolation: the same prompt hits the prefix cache only under the same salts; the output does
    not depend on them."""
    engine = make_engine(model_dir)
    prompt = [random.Random(5).randrange(3, 500) for _ in range(70)]  # 4 full blocks: 64 tokens to hit
    hashes = BlockHasher(16)  # the router's: hash_seed 0, no namespace, as the engine's config here
    plain_req, plain = run_one(engine, prompt, GREEDY)
    assert plain_req.block_hashes[: len(prompt) // 16] == hashes(prompt)
    outputs = []
    for salts, cached in [(dict(cache_salt="a"), 0), (dict(cache_salt="b"), 0), (dict(cache_salt="a"), 64),
                          (dict(tenant_salt="a"), 0), (dict(tenant_salt="t", cache_salt="a"), 0),
                          (dict(tenant_salt="t", cache_salt="a"), 64), (dict(), 64)]:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **salts)
        req, last = run_one(engine, prompt, params)
        assert (req.num_cached_prompt_tokens, last.num_cached_tokens) == (cached, cached), salts
        # every full block, those filled while decoding too, is hashed with the salts, as the router does
        assert req.block_hashes == hashes(req.all_token_ids, params.hash_salt), salts
        assert not set(req.block_hashes) & set(plain_req.block_hashes) or not salts
        outputs.append(req.output_token_ids)
    assert outputs == [plain_req.output_token_ids] * len(outputs)
    engine.pool.check()


def test_kv_events_of_a_salted_request_carry_the_routers_hashes(model_dir):
    engine = make_engine(model_dir)
    engine.take_events()
    prompt = list(range(3, 3 + 40))  # shorter than the output: blocks also fill while decoding
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, cache_salt="tenant-a")
    req, _ = run_one(engine, prompt, params)
    stored = [h for e in engine.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored and stored == BlockHasher(16)(req.all_token_ids, ("", "tenant-a"))[: len(stored)]
    assert not set(stored) & set(BlockHasher(16)(req.all_token_ids))


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_token_ids=[]), "empty"),
    (dict(prompt=""), "empty"),
    (dict(prompt_token_ids=[1, 2, 10**6]), "out of range"),
    (dict(prompt_token_ids=[1, -1]), "out of range"),
    (dict(prompt_token_ids=[1] * 1020, params=SamplingParams(max_tokens=16)), "maximum context length"),
])
def test_bad_input_is_refused_and_engine_keeps_serving(model_dir, kwargs, match):
    engine = make_engine(model_dir)
    good = engine.add_request(prompt_token_ids=[5, 6, 7], params=GREEDY)
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(**kwargs)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(good.output_token_ids) == GREEDY.max_tokens
    engine.pool.check()


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(temperature=-1), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_k=-2), "top_k"), (dict(logprobs=99), "logprobs"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_duplicate_request_id_refused(model_dir):
    engine = make_engine(model_dir)
    engine.add_request("x", prompt_token_ids=[1, 2], params=GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("x", prompt_token_ids=[1, 2], params=GREEDY)


def test_abort_frees_blocks(model_dir):
    engine = make_engine(model_dir)
    a = engine.add_request(prompt_token_ids=list(range(3, 100)), params=GREEDY)
    engine.add_request(prompt_token_ids=list(range(3, 50)), params=GREEDY)
    engine.step()
    assert engine.pool.num_used_blocks > 0
    assert engine.abort_request(a.request_id)
    outs = {o.request_id: o for o in engine.step()}
    assert outs[a.request_id].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    engine.pool.check()
    assert engine.pool.num_used_blocks == 0


def test_async_engine_streams_and_cancellation_frees_blocks(model_dir):
    engine = make_engine(model_dir)
    aengine = AsyncEngine(engine)

    async def consume(prompt, n_max=None):
        toks = []
        async for out in aengine.generate(prompt_token_ids=prompt, params=GREEDY):
            toks += out.new_token_ids
            if n_max and len(toks) >= n_max:
                break  # the caller walks away: the request must be aborted
        return toks

    async def main():
        return await asyncio.gather(consume([5, 6, 7]), consume(list(range(3, 80)), n_max=3), consume([8, 9]))

    try:
        full, cut, other = asyncio.run(main())
        assert len(full) == GREEDY.max_tokens and len(other) == GREEDY.max_tokens and len(cut) == 3
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            import time
            time.sleep(0.05)
        assert engine.pool.num_used_blocks == 0
        sync = run(make_engine(model_dir), [[5, 6, 7]])[0]
        assert full == sync

        async def bad():
            async for _ in aengine.generate(prompt_token_ids=[], params=GREEDY):
                pass
        with pytest.raises(InvalidRequestError):
            asyncio.run(bad())
    finally:
        aengine.shutdown()
