"""Resuming a request elsewhere (engine side of the router's migration): prompt + the k tokens generated so
far, ``ResumeState(k, characters already emitted)``, the remaining max_tokens. The resumed request must
produce exactly the original's remaining tokens and the original's remaining text — with seeded sampling,
stop strings held across the cut, and UTF-8 characters split across tokens."""
from __future__ import annotations

import dataclasses
import random

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.request import ResumeState, SamplingParams, StructuredOutput
from tests.engine.test_engine_handoff import copy_blocks


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(EngineConfig(model=str(tiny_model("llama")), num_blocks=256))


def run(engine: Engine, ids, params) -> list[tuple[list[int], str]]:
    """Per output: (new token ids, new text)."""
    rid = engine.add_request(prompt_token_ids=ids, params=params).request_id
    outs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            outs.append((list(out.new_token_ids), out.new_text))
    return outs


def resumed(params: SamplingParams, outs, k: int) -> tuple[SamplingParams, int]:
    emitted = sum(len(text) for _, text in outs[:k])
    return dataclasses.replace(params, max_tokens=params.max_tokens - k, min_tokens=max(0, params.min_tokens - k),
                               resume=ResumeState(k, emitted)), emitted


def prompt(seed: int, n: int = 30) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


CASES = {
    "greedy": SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    "seeded-sampling": SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True),
    "min-tokens": SamplingParams(max_tokens=30, temperature=0.8, seed=7, min_tokens=20),
    # frequency/presence count the tokens generated before the cut (now the prompt's tail)
    "penalties-and-bias": SamplingParams(max_tokens=40, temperature=0.9, seed=5, frequency_penalty=1.5,
                                         presence_penalty=0.5, repetition_penalty=1.2, logit_bias={9: 2.0},
                                         ignore_eos=True),
    # the grammar is advanced over the prompt's tail: the resumed request completes the same JSON
    "json-schema": SamplingParams(max_tokens=120, temperature=1.0, seed=3, structured=StructuredOutput(
        "json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]}},'
                       ' "required": ["a", "b"], "additionalProperties": false}')),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resuming_at_every_token_continues_exactly(engine, case):
    params, ids = CASES[case], prompt(1)
    outs = run(engine, ids, params)
    tokens = [t for new, _ in outs for t in new]
    text = "".join(t for _, t in outs)
    for k in range(1, len(outs)):
        p, emitted = resumed(params, outs, k)
        rest = run(engine, ids + tokens[:k], p)
        assert [t for new, _ in rest for t in new] == tokens[k:], k
        assert "".join(t for _, t in rest) == text[emitted:], k


def test_a_stop_string_and_split_characters_across_the_cut(engine):
    """Stop strings taken from the original text: text that could begin one is held back, so at the cut
    some generated text was never sent; the resumed request sends it, once, and stops where the original did."""
    ids = prompt(2)
    free = run(engine, ids, SamplingParams(max_tokens=48, temperature=0.7, seed=99, ignore_eos=True))
    full = "".join(t for _, t in free)
    assert any("\ufffd" in t or len(t.encode()) > len(t) for _, t in free)  # multi-byte characters occur
    stop = full[len(full) // 2: len(full) // 2 + 3]
    params = SamplingParams(max_tokens=48, temperature=0.7, seed=99, ignore_eos=True, stop=(stop,))
    outs = run(engine, ids, params)
    tokens = [t for new, _ in outs for t in new]
    text = "".join(t for _, t in outs)
    assert stop not in text and len(tokens) < 48  # it did stop on the string
    held_somewhere = False
    for k in range(1, len(outs)):
        p, emitted = resumed(params, outs, k)
        held_somewhere |= emitted < len(engine.tokenizer.decode(tokens[:k]))
        rest = run(engine, ids + tokens[:k], p)
        assert [t for new, _ in rest for t in new] == tokens[k:], k
        assert "".join(t for _, t in rest) == text[emitted:], k
    assert held_somewhere  # some cut fell where text was held back


def test_resume_through_a_prefill_handoff(tiny_model, engine):
    """The resumed request prefilled on one engine and decoded on another (the disaggregated path)."""
    params, ids = CASES["seeded-sampling"], prompt(3)
    outs = run(engine, ids, params)
    tokens = [t for new, _ in outs for t in new]
    text = "".join(t for _, t in outs)
    k = 11
    p, emitted = resumed(params, outs, k)
    P = Engine(EngineConfig(model=str(tiny_model("llama")), num_blocks=128))
    D = Engine(EngineConfig(model=str(tiny_model("llama")), num_blocks=128))
    P.add_request("r", prompt_token_ids=ids + tokens[:k], params=p, remote_decode=True)
    got, got_text = [], ""
    while P.has_unfinished_requests():
        for out in P.step():
            got += out.new_token_ids
            got_text += out.new_text
            plan = D.reserve_remote(out.handoff)
            copy_blocks(P, D, plan)
            P.release_held("r")
            D.commit_remote("r")
    while D.has_unfinished_requests():
        for out in D.step():
            got += out.new_token_ids
            got_text += out.new_text
    assert got == tokens[k:] and got_text == text[emitted:]


def test_bad_resume_states_are_refused(engine):
    with pytest.raises(InvalidRequestError, match="num_output_tokens >= 1"):
        SamplingParams(resume=ResumeState(0, 0))
    with pytest.raises(InvalidRequestError, match="leave no original prompt"):
        engine.add_request(prompt_token_ids=[5, 6], params=SamplingParams(resume=ResumeState(2, 0)))
    with pytest.raises(InvalidRequestError, match="characters emitted"):
        engine.add_request(prompt_token_ids=[5, 6, 7, 8], params=SamplingParams(resume=ResumeState(1, 10_000)))
    assert not engine.has_unfinished_requests()
