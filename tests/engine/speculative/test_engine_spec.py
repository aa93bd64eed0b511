"""Speculative decoding through the engine (engine/speculative/decoder.py, the scheduler's drafts, the runner's k + 1
rows, engine/engine_emit.py): the same outputs as without it, token for token for greedy requests and in
distribution for sampled ones, with the KV of rejected drafts never cached, under preemption, aborts, budgets
and tensor parallelism."""
from __future__ import annotations

import collections
import json

import pytest
import torch
from scipy.stats import chi2_contingency

from engine.config import EngineConfig, SpeculativeConfig
from engine.engine import Engine
from engine.errors import ConfigError
from engine.request import SamplingParams, StructuredOutput

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0}
METHODS = {"ngram": NGRAM, "suffix": SUFFIX}


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


def make_engine(model_dir, spec=None, always=True, **kw) -> Engine:
    """An engine with ``spec`` (a --speculative-config object); ``always``: every draft proposed is verified
    (the cost model switched off), so the tests exercise verification wherever the proposer has drafts."""
    kw.setdefault("num_blocks", 1024)  # no eviction: the cached blocks compare as sets
    engine = Engine(EngineConfig(model=str(model_dir), speculative_config=spec, **kw))
    if spec is not None and always:
        engine.spec.cost.fit = lambda: None
    return engine


def prompts() -> list[list[int]]:
    """Token prompts with repeats (so the proposers find matches) and without."""
    g = torch.Generator().manual_seed(7)
    out = []
    for n in (5, 12, 23, 40):
        body = torch.randint(3, 400, (n,), generator=g).tolist()
        out += [body, body + body[: n // 2], (body[:4] * 6)[:n]]
    return out


PARAMS = {
    "greedy": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    "logprobs": SamplingParams(max_tokens=20, temperature=0, logprobs=3, ignore_eos=True),
    "penalties": SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3, frequency_penalty=0.4,
                                presence_penalty=0.3, ignore_eos=True),
    "logit_bias": SamplingParams(max_tokens=20, temperature=0, logit_bias={7: 8.0, 11: -50.0}, ignore_eos=True),
    "min_tokens": SamplingParams(max_tokens=20, temperature=0, min_tokens=12),
    "stop_ids": SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(17, 99, 250), ignore_eos=True),
    "max_tokens_2": SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
    "json": SamplingParams(max_tokens=24, temperature=0, structured=StructuredOutput("json_object")),
    # a repetition penalty below 1 rewards repeats: the random model's outputs then repeat the context, the
    # proposers' drafts are accepted, several in a row, and requests end inside an accepted run
    "repeat": SamplingParams(max_tokens=40, temperature=0, repetition_penalty=0.6, ignore_eos=True),
    "repeat_logprobs": SamplingParams(max_tokens=40, temperature=0, repetition_penalty=0.6, logprobs=2,
                                      ignore_eos=True),
    "repeat_stop_ids": SamplingParams(max_tokens=40, temperature=0, repetition_penalty=0.6, min_tokens=6,
                                      stop_token_ids=(253, 335, 250, 307), ignore_eos=True),
    "repeat_json": SamplingParams(max_tokens=24, temperature=0, repetition_penalty=0.6,
                                  structured=StructuredOutput("json_object")),
}


def run(engine: Engine, cases: list[tuple[list[int], SamplingParams]]) -> list[dict]:
    ids = [engine.add_request(prompt_token_ids=p, params=sp).request_id for p, sp in cases]
    res = {i: {"tokens": [], "text": "", "logprobs": [], "finish": None} for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            r = res[out.request_id]
            r["tokens"] += out.new_token_ids
            r["text"] += out.new_text
            r["logprobs"] += out.new_logprobs
            if out.finished:
                r["finish"] = out.finish_reason
    return [res[i] for i in ids]


def cached_hashes(engine: Engine) -> set[int]:
    return {b.block_hash for b in engine.pool.blocks if b.block_hash is not None}


def check_drained(engine: Engine) -> None:
    engine.pool.check()
    assert engine.pool.num_used_blocks == 0
    assert not engine.requests


@pytest.fixture(scope="module")
def plain_outputs(model_dir):
    """Without speculation: outputs of every (prompt, params) case, and the cached block hashes after."""
    cases = [(p, sp) for sp in PARAMS.values() for p in prompts()]
    engine = make_engine(model_dir)
    outs = run(engine, cases)
    check_drained(engine)
    return cases, outs, cached_hashes(engine)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_outputs_equal_without_speculation(model_dir, plain_outputs, method):
    cases, want, want_hashes = plain_outputs
    engine = make_engine(model_dir, METHODS[method])
    got = run(engine, cases)
    if method == "suffix":  # again: now the worker's cache of finished outputs proposes whole continuations
        got = run(engine, cases)
    for (p, sp), g, w in zip(cases, got, want):
        assert (g["tokens"], g["text"], g["finish"]) == (w["tokens"], w["text"], w["finish"]), (p, sp)
        assert len(g["logprobs"]) == len(w["logprobs"])
        if w["logprobs"]:  # verification rows run the chunked-prefill path, plain decode the decode path
            torch.testing.assert_close(torch.tensor(g["logprobs"]), torch.tensor(w["logprobs"]), atol=1e-4, rtol=0)
    st = engine.spec.stats
    assert st.num_accepted_tokens > 100 and st.accepted_per_pos[-1] > 5, st  # speculation ran and paid ...
    assert st.num_draft_tokens > st.num_accepted_tokens  # ... and drafts were rejected, their KV rolled back
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens
    assert st.accepted_per_pos == sorted(st.accepted_per_pos, reverse=True)  # j accepted only after j - 1
    rounds = 2 if method == "suffix" else 1
    assert engine.stats.num_generated_tokens == rounds * sum(len(w["tokens"]) for w in want)
    assert engine.stats.num_steps < rounds * make_steps(model_dir, cases)  # fewer steps than tokens per sequence
    check_drained(engine)
    # only accepted tokens' blocks were hashed and cached: the very blocks the plain run cached
    assert cached_hashes(engine) == want_hashes
    assert not engine.spec._known  # every finished request's proposer state is gone


_STEPS: dict = {}


def make_steps(model_dir, cases) -> int:
    if "plain" not in _STEPS:
        engine = make_engine(model_dir)
        run(engine, cases)
        _STEPS["plain"] = engine.stats.num_steps
    return _STEPS["plain"]


def test_preemption_and_small_budget_keep_outputs(model_dir):
    """Few blocks (drafts cut to what is free, sequences preempted and recomputed) and a token budget that
    cuts drafts: the same tokens."""
    cases = [(p, PARAMS["greedy"]) for p in prompts()]
    want = run(make_engine(model_dir, num_blocks=64), cases)
    engine = make_engine(model_dir, NGRAM, num_blocks=14, max_num_batched_tokens=32, max_num_seqs=8)
    got = run(engine, cases)
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    assert engine.scheduler.num_preemptions > 0 and engine.spec.stats.num_accepted_tokens > 0
    check_drained(engine)


def test_abort_mid_speculation_frees_everything(model_dir):
    engine = make_engine(model_dir, SUFFIX)
    ids = [engine.add_request(prompt_token_ids=p, params=PARAMS["greedy"]).request_id for p in prompts()[:6]]
    for _ in range(6):
        engine.step()
    assert engine.spec.stats.num_draft_tokens > 0
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    check_drained(engine)
    assert not engine.spec._known and not engine.spec.acceptance.requests


def test_sampled_outputs_distributed_as_without_speculation(model_dir):
    """Must-show 1b: a two-sample chi-square test of sampled outputs (four tokens, top-k 3 so the outcomes are
    few; the last three come from one verification of two drafts) with and without speculation. Different seeds on each
    side: independent samples. The suffix proposer, in waves of 50 requests, drafts from the earlier waves' outputs:
    drafts accepted and rejected at their sampled rates."""
    prompt = prompts()[10]
    n, wave = 1000, 50
    sp = dict(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
    plain = run(make_engine(model_dir), [(prompt, SamplingParams(seed=s, **sp)) for s in range(n)])
    spec_engine = make_engine(model_dir, {**SUFFIX, "num_speculative_tokens": 2})
    spec = []
    for w in range(0, n, wave):
        spec += run(spec_engine, [(prompt, SamplingParams(seed=10_000 + s, **sp)) for s in range(w, w + wave)])
    st = spec_engine.spec.stats
    assert st.num_draft_tokens > n and 0 < st.num_accepted_tokens < st.num_draft_tokens, st
    assert_same_distribution(plain, spec)


def assert_same_distribution(plain: list[dict], spec: list[dict]) -> None:
    """A two-sample chi-square test of the output token sequences (outcomes seen < 10 times pooled into one
    cell): p > 0.001."""
    a = collections.Counter(tuple(o["tokens"]) for o in plain)
    b = collections.Counter(tuple(o["tokens"]) for o in spec)
    keys = sorted(set(a) | set(b))
    common = [k for k in keys if a[k] + b[k] >= 10]  # pool the rare outcomes into one cell
    table = [[a[k] for k in common] + [sum(a[k] for k in keys if k not in common)],
             [b[k] for k in common] + [sum(b[k] for k in keys if k not in common)]]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    assert len(table[0]) >= 4
    p_value = chi2_contingency(table).pvalue
    assert p_value > 0.001, (p_value, table)


def test_speculative_config_in_engine_config():
    cfg = EngineConfig(model="m", speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 3}))
    assert cfg.speculative_config == SpeculativeConfig("ngram", 3, prompt_lookup_min=5, prompt_lookup_max=5)
    assert EngineConfig(model="m", speculative_config={"method": "suffix"}).speculative_config.method == "suffix"
    with pytest.raises(ConfigError, match="unknown key 'num_spec_tokens'"):
        EngineConfig(model="m", speculative_config={"method": "ngram", "num_spec_tokens": 3})
    draft = EngineConfig(model="m", speculative_config={"method": "draft_model", "model": "d", "num_speculative_tokens": 2})
    assert draft.speculative_config == SpeculativeConfig("draft_model", 2, model="d")
    with pytest.raises(ConfigError, match="not valid JSON"):
        EngineConfig(model="m", speculative_config="{method: ngram")


def test_tensor_parallel_engine_speculates_the_same_tokens(tiny_model):
    """Rank 0 proposes and verifies; every rank runs the verification forward (k + 1 rows per sequence) on its
    shard: the tokens of one rank without speculation."""
    from tests.engine.tp_engines import tp_engine

    model = tiny_model("llama")
    cases = [(p, PARAMS["repeat"]) for p in prompts()[:8]]
    want = run(make_engine(model), cases)
    config = EngineConfig(model=str(model), num_blocks=256, speculative_config=NGRAM, tensor_parallel_size=2)
    with tp_engine(config, 2) as engine:
        engine.spec.cost.fit = lambda: None
        got = run(engine, cases)
        assert engine.spec.stats.num_accepted_tokens > 20, engine.spec.stats
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]


def test_resumed_request_speculates_from_its_tokens(model_dir):
    """A migrated request (prompt + the k tokens generated elsewhere, ResumeState): its proposer state is built
    from those tokens and the generated tail counts as output — the original's remaining tokens exactly."""
    import dataclasses

    from engine.request import ResumeState

    params = PARAMS["repeat"]
    prompt = prompts()[7]
    full = run(make_engine(model_dir), [(prompt, params)])[0]
    k = 9
    engine = make_engine(model_dir, NGRAM)
    cont = dataclasses.replace(params, max_tokens=params.max_tokens - k, resume=ResumeState(k, 0))
    got = run(engine, [(prompt + full["tokens"][:k], cont)])[0]
    assert got["tokens"] == full["tokens"][k:]
    assert engine.spec.stats.num_accepted_tokens > 0


def test_host_tier_receives_only_accepted_blocks(model_dir):
    """With a host KV tier, what is written through is what the plain engine caches: blocks of accepted
    tokens only; a second round loads them back and gives the same tokens."""
    cases = [(p, PARAMS["repeat"]) for p in prompts()[6:]]
    plain = make_engine(model_dir, num_blocks=20, max_num_seqs=2)
    want = run(plain, cases)
    bpb = plain.runner.bytes_per_block
    # a device cache smaller than the working set: the second round loads blocks back from the host tier
    engine = make_engine(model_dir, NGRAM, num_blocks=20, max_num_seqs=2, kv_host_bytes=256 * bpb)
    assert [g["tokens"] for g in run(engine, cases)] == [w["tokens"] for w in want]
    engine.sync_tiers(wait_s=0.5)
    host = set(engine.tiers.host.hashes())
    assert host and host <= hashes_of_plain_run(model_dir, cases)
    assert [g["tokens"] for g in run(engine, cases)] == [w["tokens"] for w in want]
    assert engine.tiers.stats.loaded_blocks["host"] > 0 and engine.spec.stats.num_accepted_tokens > 0


def hashes_of_plain_run(model_dir, cases) -> set[int]:
    """Every block hash a plain engine with room for all caches running ``cases``."""
    engine = make_engine(model_dir)
    run(engine, cases)
    return cached_hashes(engine)


@pytest.mark.slow
def test_triton_backend_verifies_the_same_tokens(model_dir):
    """The verification rows through the Triton kernels (the interpreter here): the torch path's tokens."""
    cases = [(prompts()[i], SamplingParams(max_tokens=8, temperature=0, repetition_penalty=0.6, ignore_eos=True))
             for i in (0, 5)]  # short prompts whose outputs repeat early
    want = run(make_engine(model_dir, kernels="torch"), cases)
    engine = make_engine(model_dir, NGRAM, kernels="triton")
    assert [g["tokens"] for g in run(engine, cases)] == [w["tokens"] for w in want]
    assert engine.spec.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampled_outputs_are_the_plain_samplers_token_for_token(model_dir, method):
    """One-hot drafts (n-gram, suffix) are accepted while they equal the plain sampler's own draw at their output
    index, so a seeded request gives exactly its tokens without speculation, however many drafts each step had."""
    cases = [(p, SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, repetition_penalty=0.6, seed=100 + i,
                                ignore_eos=True)) for i, p in enumerate(prompts())]
    want = run(make_engine(model_dir), cases)
    engine = make_engine(model_dir, METHODS[method])
    got = run(engine, cases)
    if method == "suffix":
        got = run(engine, cases)
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    st = engine.spec.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, st
