"""Speculative decoding with a draft model (engine/speculative/draft.py) through the engine: the same outputs as without
speculation — token for token for greedy requests, in distribution for sampled ones (q not one-hot) — with the
draft's KV in blocks indexed like the target's, kept across steps, recomputed after a preemption and on a decode
engine that received only the target's prompt KV; a draft of another vocabulary or tokenizer refused by name."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ConfigError
from engine.loading.tiny_draft import derive_draft
from engine.request import SamplingParams
from engine.speculative.draft import DraftModel
from tests.engine.speculative.test_engine_spec import (
    PARAMS,
    assert_same_distribution,
    cached_hashes,
    check_drained,
    make_engine,
    model_dir,  # noqa: F401 (a fixture)
    plain_outputs,  # noqa: F401 (a fixture)
    prompts,
    run,
)


def draft_spec(path, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def near_draft(model_dir, tmp_path_factory):
    """The target's weights plus 5 % noise: about half its greedy drafts are accepted."""
    return derive_draft(model_dir, tmp_path_factory.mktemp("near-draft"), noise=0.05)


def count_catch_up(engine: Engine) -> list[int]:
    """Tokens each draft catch-up ran (appended per call), recorded by wrapping the engine's draft model."""
    draft, seen = engine.spec.draft, []
    inner = draft._catch_up

    def counting(requests, starts):
        seen.append(sum(r.num_tokens - s for r, s in zip(requests, starts)))
        return inner(requests, starts)

    draft._catch_up = counting
    return seen


def test_draft_equal_to_target_has_every_draft_accepted(model_dir, plain_outputs):
    """The target as its own draft: its processed argmax is the target's at every position, so every greedy
    draft is accepted, over every sampling feature and grammar; and the draft's KV is kept across steps (each
    token goes through the draft once: no catch-up recomputes what an earlier step computed)."""
    cases, want, _ = plain_outputs
    engine = make_engine(model_dir, draft_spec(model_dir))
    catch_up = count_catch_up(engine)
    got = run(engine, cases)
    assert [(g["tokens"], g["finish"]) for g in got] == [(w["tokens"], w["finish"]) for w in want]
    st = engine.spec.stats
    assert st.num_draft_tokens > 500 and st.num_accepted_tokens == st.num_draft_tokens, st
    assert sum(catch_up) <= sum(len(p) + len(w["tokens"]) for (p, _), w in zip(cases, want))
    check_drained(engine)
    assert not engine.spec._known and not engine.spec.draft._states


def test_greedy_outputs_equal_without_speculation(model_dir, plain_outputs, near_draft):
    cases, want, want_hashes = plain_outputs
    engine = make_engine(model_dir, draft_spec(near_draft))
    got = run(engine, cases)
    for (p, sp), g, w in zip(cases, got, want):
        assert (g["tokens"], g["text"], g["finish"]) == (w["tokens"], w["text"], w["finish"]), (p, sp)
        assert len(g["logprobs"]) == len(w["logprobs"])
    st = engine.spec.stats
    assert st.num_accepted_tokens > 300 and st.accepted_per_pos[-1] > 20, st  # drafts accepted ...
    assert st.num_draft_tokens > 1.5 * st.num_accepted_tokens  # ... and rejected
    assert engine.stats.num_generated_tokens == sum(len(w["tokens"]) for w in want)
    check_drained(engine)
    assert cached_hashes(engine) == want_hashes  # only accepted tokens' blocks were cached
    assert not engine.spec._known and not engine.spec.draft._states


def test_sampled_outputs_distributed_as_without_speculation(model_dir, near_draft):
    """A two-sample chi-square test, as tests/engine/speculative/test_engine_spec.py's, with the draft model's drafts
    drawn from its own distribution q (not one-hot): accepted at min(1, p / q), the residual drawn otherwise."""
    prompt = prompts()[10]
    n = 1000
    sp = dict(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
    plain = run(make_engine(model_dir), [(prompt, SamplingParams(seed=s, **sp)) for s in range(n)])
    engine = make_engine(model_dir, draft_spec(near_draft, k=2))
    spec = run(engine, [(prompt, SamplingParams(seed=10_000 + s, **sp)) for s in range(n)])
    st = engine.spec.stats
    assert st.num_draft_tokens > n and 0.2 * st.num_draft_tokens < st.num_accepted_tokens < st.num_draft_tokens, st
    assert_same_distribution(plain, spec)


def test_seeded_sampled_request_reproduces_its_tokens(model_dir, near_draft):
    """Draws are stateless per output index (the draft's with draft_step_seed): the same seed, the same tokens,
    alone or in another batch."""
    sp = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    alone = run(make_engine(model_dir, draft_spec(near_draft)), [(prompts()[4], sp)])
    batch = run(make_engine(model_dir, draft_spec(near_draft)), [(p, sp) for p in prompts()[:6]])
    assert alone[0]["tokens"] == batch[4]["tokens"]


def test_preemption_and_small_budget_keep_outputs(model_dir, near_draft):
    """Few blocks (drafts cut, sequences preempted: new blocks, the draft's KV recomputed) and a token budget
    under the prompts' length (the catch-up runs in several forwards): the same tokens."""
    cases = [(p, PARAMS["repeat"]) for p in prompts()]
    want = run(make_engine(model_dir, num_blocks=64), cases)
    engine = make_engine(model_dir, draft_spec(near_draft), num_blocks=14, max_num_batched_tokens=32,
                         max_num_seqs=8)
    catch_up = count_catch_up(engine)
    got = run(engine, cases)
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    assert engine.scheduler.num_preemptions > 0 and engine.spec.stats.num_accepted_tokens > 0
    assert max(catch_up) > 32  # a catch-up longer than the budget: split into forwards of <= 32 tokens
    check_drained(engine)
    assert not engine.spec.draft._states


def test_abort_mid_speculation_frees_everything(model_dir, near_draft):
    engine = make_engine(model_dir, draft_spec(near_draft))
    ids = [engine.add_request(prompt_token_ids=p, params=PARAMS["greedy"]).request_id for p in prompts()[:6]]
    for _ in range(4):
        engine.step()
    assert engine.spec.stats.num_draft_tokens > 0 and engine.spec.draft._states
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    check_drained(engine)
    assert not engine.spec._known and not engine.spec.draft._states


def test_decode_engine_computes_the_prompts_draft_kv(model_dir, near_draft):
    """Disaggregated: the prefill engine hands off only the target's prompt KV; the decode engine's first draft
    step runs the prompt through the draft (the catch-up). Its greedy requests' tokens equal one engine's without
    speculation. (The seeded sampled request is only equal in distribution: which drafts a step verifies — here
    none on the decode engine's first step, where the request joins from the queue — changes which draws decide.)"""
    from tests.engine.test_engine_handoff import run_disagg, workload

    prompts_, params = workload()
    plain = [r["token_ids"] for r in make_engine(model_dir, num_blocks=128).generate(prompts_, params)]
    P = make_engine(model_dir, num_blocks=128)
    D = make_engine(model_dir, draft_spec(near_draft), num_blocks=128)
    catch_up = count_catch_up(D)
    got = run_disagg(P, D, prompts_, params)
    assert [g for g, sp in zip(got, params) if sp.greedy] == [w for w, sp in zip(plain, params) if sp.greedy]
    assert D.stats.num_remote_kv_received > 0 and D.spec.stats.num_accepted_tokens > 0
    assert max(catch_up) >= max(len(p) for p in prompts_)  # a whole prompt (+ its first token) through the draft


def test_draft_config_is_checked_against_the_target(model_dir, tiny_model, tmp_path):
    other_vocab = tiny_model("llama", vocab_size=600)
    with pytest.raises(ConfigError, match=f"draft model {other_vocab} .* target {model_dir}: vocab_size 600 != 512"):
        make_engine(model_dir, draft_spec(other_vocab))
    other_tokenizer = tiny_model("mistral")  # same vocab size, another tokenizer
    with pytest.raises(ConfigError, match="tokenizers differ at token id"):
        make_engine(model_dir, draft_spec(other_tokenizer))
    short = tiny_model("llama", max_position_embeddings=128)
    with pytest.raises(ConfigError, match="max_position_embeddings 128 is below the engine's max_model_len 1024"):
        make_engine(model_dir, draft_spec(short))
    engine = make_engine(model_dir, draft_spec(short), max_model_len=128)  # fits once the context is cut
    assert isinstance(engine.spec.draft, DraftModel)
    assert engine.spec.draft.runner.kv_cache.shape[0] == engine.runner.num_blocks


def test_target_cache_is_sized_for_both(model_dir, near_draft):
    """kv_cache_bytes covers the target's and the draft's cache: the same bytes hold fewer blocks."""
    budget = 1 << 20
    plain = Engine(EngineConfig(model=str(model_dir), kv_cache_bytes=budget))
    spec = Engine(EngineConfig(model=str(model_dir), kv_cache_bytes=budget, speculative_config=draft_spec(near_draft)))
    both = spec.runner.bytes_per_block + spec.spec.draft.bytes_per_block
    assert spec.runner.num_blocks == budget // both < plain.runner.num_blocks
    assert spec.spec.draft.runner.kv_cache.shape[0] == spec.runner.num_blocks


def test_turned_down_speculation_still_measures_acceptance(model_dir, near_draft):
    """A cost model under which no draft pays: nothing is verified, but each decoding sequence's first draft is
    still made (shadow trials keep measuring acceptance, so speculation can come back) and the draft's KV
    keeps up, one token a step."""
    cases = [(p, PARAMS["greedy"]) for p in prompts()[:6]]
    want = run(make_engine(model_dir), cases)
    engine = make_engine(model_dir, draft_spec(near_draft), always=False)
    engine.spec.cost.fit = lambda: (0.0, 1.0)  # every token costs the same: a draft never pays
    catch_up = count_catch_up(engine)
    worker_trials = engine.spec.acceptance.worker.tried
    assert [g["tokens"] for g in run(engine, cases)] == [w["tokens"] for w in want]
    assert engine.spec.stats.num_draft_tokens == 0
    assert engine.spec.acceptance.worker.tried > worker_trials + 50
    assert sum(catch_up) <= sum(len(p) + len(w["tokens"]) for (p, _), w in zip(cases, want))


def test_tensor_parallel_engine_with_a_draft_speculates_the_same_tokens(model_dir, near_draft):
    """The draft runs whole on rank 0 (its KV indexed by the split target's block ids); the other ranks only
    run the target's verification forwards: the tokens of one rank without speculation."""
    from tests.engine.tp_engines import tp_engine

    cases = [(p, PARAMS["repeat"]) for p in prompts()[:8]]
    want = run(make_engine(model_dir), cases)
    config = EngineConfig(model=str(model_dir), num_blocks=256, speculative_config=draft_spec(near_draft),
                          tensor_parallel_size=2)
    with tp_engine(config, 2) as engine:
        engine.spec.cost.fit = lambda: None
        got = run(engine, cases)
        assert engine.spec.stats.num_accepted_tokens > 20, engine.spec.stats
        assert engine.spec.draft.runner.kv_cache.shape[0] == engine.runner.num_blocks
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
