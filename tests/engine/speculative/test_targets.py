"""engine/speculative/targets.py: position j is processed exactly as the plain sampler processes the request with
drafts[:j] generated (bit for bit), and the grammar's per-position masks are a rebuilt matcher's, on
SmolLM2's real tokenizer, with the request's matcher left as it was."""
from __future__ import annotations

import json

import pytest
import torch

from engine.loading.checkpoint import load_tokenizer
from engine.request import ResumeState, SamplingParams, StructuredOutput
from engine.sampling.sampler import process_logits
from engine.sampling.structured import GrammarBackend
from engine.speculative.rejection import Drafts, rejection_sample
from engine.speculative.targets import grammar_position_masks, position_logits
from tests.engine.speculative.toy import EOS, extended, make_request


def test_each_position_is_the_plain_processing_of_the_request_with_the_drafts_before_it():
    gen = torch.Generator().manual_seed(0)
    vocab_size = 64
    params = SamplingParams(max_tokens=64, min_tokens=4, stop_token_ids=(9,), repetition_penalty=1.4,
                            presence_penalty=0.7, frequency_penalty=-0.4, logit_bias={3: 4.0, 9: -2.0},
                            resume=ResumeState(2, 0))
    # a resumed request: its prompt ends with 2 tokens generated before a migration (they count as generated)
    r = make_request([5, 6, 7, 11, 11], [11], params, num_prior=2)
    drafts = [EOS, 9, 11, 40, 11]
    logits = torch.randn(len(drafts) + 1, vocab_size, generator=gen) * 3
    got = position_logits(logits, [r], [drafts])
    for j in range(len(drafts) + 1):
        want = process_logits(logits[j:j + 1], [extended(r, drafts[:j])])[0]
        assert torch.equal(got[j], want), j
    assert got[:3, EOS].isinf().all() and not got[3:, EOS].isinf().any()  # min_tokens counts the drafts
    assert not torch.equal(got[2] - logits[2], got[0] - logits[0])  # the drafts moved the penalties


def test_untouched_logits_are_not_copied():
    r = make_request([5, 6], [], SamplingParams(temperature=0.5, top_k=3))
    logits = torch.randn(3, 16)
    assert position_logits(logits, [r], [[1, 2]]) is logits


def test_an_explicit_mask_applies_per_position_last():
    r = make_request([5, 6], [], SamplingParams(logit_bias={2: 100.0}, max_tokens=8))
    allowed = torch.ones(3, 8, dtype=torch.bool)
    allowed[1, 2] = False
    got = position_logits(torch.zeros(3, 8), [r], [[4, 5]], [allowed])
    assert got[0, 2] == 100 and got[1, 2] == float("-inf") and got[2, 2] == 100
    with pytest.raises(ValueError, match="mask shape"):
        position_logits(torch.zeros(3, 8), [r], [[4, 5]], [allowed[:2]])


# ---- grammar ---------------------------------------------------------------------------------------------

SCHEMA = StructuredOutput("json_schema", json.dumps({
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
    "required": ["a", "b"], "additionalProperties": False}))


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    return load_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def document(tokenizer) -> list[int]:
    """A valid output: the JSON text's tokens then EOS."""
    return tokenizer.encode('{"a":1234,"b":true}', add_special_tokens=False) + [min(tokenizer.eos_token_ids)]


def allowed_after(backend, tokens) -> set[int]:
    return set(backend.matcher(SCHEMA, tokens).allowed_token_ids())


@pytest.mark.parametrize("corrupt_at", [None, 0, 2])
def test_grammar_masks_are_a_rebuilt_matchers_and_the_matcher_is_left_alone(tokenizer, backend, corrupt_at):
    doc = document(tokenizer)
    outputs, drafts = doc[:2], doc[2:]
    if corrupt_at is not None:
        drafts[corrupt_at] = tokenizer.encode("zz", add_special_tokens=False)[0]  # never valid JSON here
    matcher = backend.matcher(SCHEMA, outputs)
    before = matcher.allowed_token_ids()
    masks = grammar_position_masks(matcher, drafts, backend.vocab_size)
    assert matcher.allowed_token_ids() == before
    # rows after a refused draft, or after the EOS draft that ends the document, are never sampled
    reachable = len(drafts) - 1 if corrupt_at is None else corrupt_at
    for j in range(reachable + 1):
        assert set(masks[j].nonzero().flatten().tolist()) == allowed_after(backend, outputs + drafts[:j]), j
    assert masks[reachable + 1:].all()
    for t in drafts[:reachable]:  # the matcher still follows the real continuation
        matcher.accept(t)


@pytest.mark.parametrize("greedy", [True, False])
def test_a_grammar_request_rejects_a_draft_the_grammar_refuses(tokenizer, backend, greedy):
    doc = document(tokenizer)
    outputs, drafts = doc[:2], doc[2:7]
    bad = tokenizer.encode("zz", add_special_tokens=False)[0]
    params = SamplingParams(temperature=0 if greedy else 1.0, max_tokens=32)
    for seed in range(8):
        for corrupt in (False, True):
            proposal = drafts[:3] + [bad] + drafts[4:] if corrupt else drafts
            r = make_request([1, 2], outputs, params, seed=seed)
            r.eos_token_ids = frozenset(tokenizer.eos_token_ids)
            r.grammar = backend.matcher(SCHEMA, outputs)
            logits = torch.randn(len(proposal) + 1, backend.vocab_size, generator=torch.Generator().manual_seed(seed))
            logits[torch.arange(len(proposal)), torch.tensor(proposal)] += 40.0  # the target likes every draft
            got = rejection_sample(logits, [r], [Drafts(proposal)])
            assert got.num_accepted == [3 if corrupt else len(proposal)]
            emitted = got.token_ids[0]
            assert emitted[-1] in allowed_after(backend, outputs + emitted[:-1])
            assert r.grammar.allowed_token_ids() == backend.matcher(SCHEMA, outputs).allowed_token_ids()
