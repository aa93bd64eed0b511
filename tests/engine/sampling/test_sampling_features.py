"""Penalties, logit_bias, prompt logprobs and max_tokens=0 in the engine.

References: transformers' logits processors (RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)
and its forward pass (prompt log-probabilities); OpenAI's published formula for presence/frequency penalties
(transformers has no processor for them). The disaggregated path (prefill engine → block copy → decode
engine) must give the same tokens as one engine with every feature on.
"""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.request import Request, SamplingParams
from engine.sampling.sampler import process_logits
from tests.engine.test_engine_handoff import run_disagg


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def engine(model_dir, **kw):
    kw.setdefault("num_blocks", 128)
    return Engine(EngineConfig(model=str(model_dir), **kw))


def request_with(prompt, outputs, **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(**params), seed=0)
    for t in outputs:
        r.append_output_token(t)
    return r


# ---- each processor against its reference, on fixed logits -------------------------------------------


def test_repetition_penalty_equals_transformers_processor():
    torch.manual_seed(0)
    logits = torch.randn(1, 64) * 3
    prompt, outputs = [3, 5, 9, 9], [12, 5, 40]
    got = process_logits(logits, [request_with(prompt, outputs, repetition_penalty=1.7)])
    ref = transformers.RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + outputs]), logits.clone())
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert not torch.equal(got, logits)  # it did something (both signs are hit with this seed)


def test_logit_bias_equals_transformers_sequence_bias():
    torch.manual_seed(1)
    logits = torch.randn(1, 64)
    bias = {7: 5.0, 20: -100.0, 63: 0.5}
    got = process_logits(logits, [request_with([1, 2], [], logit_bias=bias)])
    proc = transformers.SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in bias.items()])
    ref = proc(torch.tensor([[1, 2]]), logits.clone())
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_presence_and_frequency_follow_openai_formula_over_generated_tokens_only():
    torch.manual_seed(2)
    logits = torch.randn(1, 32)
    prompt, outputs = [4, 4, 4, 9], [9, 9, 11, 4]  # the prompt's repeats must not count
    got = process_logits(logits, [request_with(prompt, outputs, presence_penalty=0.6, frequency_penalty=1.3)])
    want = logits.clone()
    for t in set(outputs):  # mu[j] -= c[j] * alpha_frequency + float(c[j] > 0) * alpha_presence
        want[0, t] -= outputs.count(t) * 1.3 + 0.6
    torch.testing.assert_close(got, want)


def test_penalties_count_tokens_generated_before_a_migration():
    from engine.request import ResumeState

    logits = torch.zeros(1, 16)
    # a resumed request: prompt = original [1, 2] + 2 tokens generated before the move
    r = Request("r", [1, 2, 7, 7], SamplingParams(frequency_penalty=1.0, resume=ResumeState(2, 0)), seed=0)
    r.num_prior_output_tokens = 2
    r.append_output_token(7)
    assert process_logits(logits, [r])[0, 7] == -3.0
    assert process_logits(logits, [r])[0, 1] == 0.0


def test_bad_penalty_values_are_refused():
    for kw, match in [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("nan")}, "frequency"),
                      ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {3: 101}}, "logit_bias"),
                      ({"logit_bias": {-1: 1}}, "logit_bias"), ({"prompt_logprobs": 21}, "prompt_logprobs")]:
        with pytest.raises(InvalidRequestError, match=match):
            SamplingParams(**kw)


def test_logit_bias_token_outside_vocab_is_refused(model_dir):
    e = engine(model_dir)
    with pytest.raises(InvalidRequestError, match="logit_bias token ids out of range"):
        e.make_request(prompt_token_ids=[3, 4], params=SamplingParams(logit_bias={e.model_config.vocab_size: 1.0}))


# ---- the engine: effects, transformers' generate, disaggregation ------------------------------------


def test_greedy_with_repetition_penalty_equals_transformers_generate(model_dir, hf_model):
    e = engine(model_dir)
    prompt = [5, 9, 14, 9, 30, 31]
    got = e.generate([prompt], SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.5,
                                              ignore_eos=True))[0]["token_ids"]
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                            repetition_penalty=1.5, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert got == out[0, len(prompt):].tolist()
    plain = e.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]["token_ids"]
    assert plain != got  # the penalty changed the continuation of this prompt


def test_logit_bias_forces_and_bans_tokens(model_dir):
    e = engine(model_dir)
    prompt = [5, 9, 14]
    forced = e.generate([prompt], SamplingParams(max_tokens=6, temperature=0.8, seed=3, logit_bias={77: 100},
                                                 ignore_eos=True))[0]["token_ids"]
    assert forced == [77] * 6
    plain = e.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]["token_ids"]
    banned = e.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                 logit_bias={t: -100 for t in set(plain)}))[0]["token_ids"]
    assert not set(banned) & set(plain)


def test_frequency_penalty_reduces_repetition(model_dir):
    e = engine(model_dir)
    prompt = [5, 9, 14]
    def distinct(**kw):
        ids = e.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, **kw))[0]["token_ids"]
        return len(set(ids))
    assert distinct(frequency_penalty=2.0) > distinct()
    assert distinct(presence_penalty=2.0) > distinct()


def test_penalties_bias_and_seed_disaggregated_equal_colocated(model_dir):
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 40, 70)]
    params = [
        SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, seed=11, frequency_penalty=0.8, presence_penalty=0.5,
                       ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=5, logit_bias={17: 3.0, 18: -100},
                       repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=2, frequency_penalty=-0.5, ignore_eos=True),
    ]
    colocated = [r["token_ids"] for r in engine(model_dir).generate(prompts, params)]
    plain = [r["token_ids"] for r in engine(model_dir).generate(
        prompts, [SamplingParams(max_tokens=24, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
                                 ignore_eos=True) for p in params])]
    assert all(a != b for a, b in zip(colocated, plain))  # every request's processing changed its tokens
    assert run_disagg(engine(model_dir), engine(model_dir), prompts, params) == colocated


# ---- prompt logprobs and max_tokens=0 ---------------------------------------------------------------


def reference_prompt_logprobs(hf_model, prompt, k):
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    chosen = [None] + [float(lp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    top = lp[:-1].topk(k, dim=-1)
    return chosen, [None] + [dict(zip(i.tolist(), v.tolist())) for i, v in zip(top.indices, top.values)]


@pytest.mark.parametrize("chunk", [None, 16])  # whole prompt in one step / chunked prefill
def test_prompt_logprobs_equal_transformers_log_softmax(model_dir, hf_model, chunk):
    e = engine(model_dir, **({"max_num_batched_tokens": chunk} if chunk else {}))
    rng = random.Random(8)
    prompt = [rng.randrange(3, 500) for _ in range(45)]
    want, want_top = reference_prompt_logprobs(hf_model, prompt, 3)
    for attempt in range(2):  # the second time the prompt's blocks are cached: logits are still computed
        e.add_request(f"r{attempt}", prompt_token_ids=prompt, params=SamplingParams(
            max_tokens=0, prompt_logprobs=3))
        outs = []
        while e.has_unfinished_requests():
            outs += e.step()
        assert len(outs) == 1
        out = outs[0]
        assert out.finished and out.finish_reason == "length" and out.new_token_ids == []
        assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
        torch.testing.assert_close(out.prompt_logprobs[1:], want[1:], rtol=0, atol=2e-5)
        for got_top, ref_top in zip(out.prompt_top_logprobs[1:], want_top[1:]):
            assert list(got_top) == list(ref_top)
    e.pool.check()
    assert e.pool.num_used_blocks == 0


def test_prompt_logprobs_arrive_once_with_the_first_token_and_survive_the_handoff(model_dir, hf_model):
    prompt = list(range(3, 60))
    want, _ = reference_prompt_logprobs(hf_model, prompt, 1)
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    P, D = engine(model_dir), engine(model_dir)
    P.add_request("a", prompt_token_ids=prompt, params=sp, remote_decode=True)
    first = [o for o in P.step()]
    assert len(first) == 1 and first[0].handoff is not None
    torch.testing.assert_close(first[0].prompt_logprobs[1:], want[1:], rtol=0, atol=2e-5)
    assert first[0].prompt_top_logprobs[1:] == [{}] * (len(prompt) - 1)
    plan = D.reserve_remote(first[0].handoff)
    for r, l in zip(plan.remote_block_ids, plan.local_block_ids):
        D.runner.kv_cache[l].copy_(P.runner.kv_cache[r])
    P.release_held("a")
    D.commit_remote("a")
    rest = []
    while D.has_unfinished_requests():
        rest += D.step()
    assert all(o.prompt_logprobs is None for o in rest) and sum(len(o.new_token_ids) for o in rest) == 4
    # the decode side recomputing the prompt (failed transfer) does not send them a second time
    P.add_request("b", prompt_token_ids=prompt, params=sp, remote_decode=True)
    handoff = next(o.handoff for o in P.step() if o.handoff)
    P.release_held("b")
    D.reserve_remote(handoff)
    D.fail_remote("b", "peer died", recompute=True)
    rest = []
    while D.has_unfinished_requests():
        rest += D.step()
    assert all(o.prompt_logprobs is None for o in rest) and rest[-1].finish_reason == "length"


def test_max_tokens_zero_without_logprobs_and_mixed_with_generation(model_dir):
    e = engine(model_dir)
    e.add_request("zero", prompt_token_ids=[4, 5, 6], params=SamplingParams(max_tokens=0))
    e.add_request("gen", prompt_token_ids=[4, 5, 7], params=SamplingParams(max_tokens=3, temperature=0,
                                                                          ignore_eos=True))
    outs = {}
    while e.has_unfinished_requests():
        for o in e.step():
            outs.setdefault(o.request_id, []).append(o)
    assert [(o.new_token_ids, o.finish_reason) for o in outs["zero"]] == [([], "length")]
    assert outs["zero"][0].prompt_logprobs is None
    assert sum(len(o.new_token_ids) for o in outs["gen"]) == 3
    assert e.pool.num_used_blocks == 0
