"""engine/sampling/structured.py on SmolLM2's real tokenizer: sampling from random logits under the mask always gives
JSON that validates against the schema; a matcher rebuilt from the output tokens is in the same state; bad
schemas are refused with the problem named, without importing torch."""

import json
import subprocess
import sys

import jsonschema
import numpy as np
import pytest
import torch

from engine.errors import InvalidRequestError
from engine.loading.checkpoint import load_tokenizer
from engine.request import StructuredOutput
from engine.sampling.structured import (
    GrammarBackend,
    apply_token_bitmask_,
    check_structured_output,
    mask_logits_batch,
    structured_output,
)

NUM_PADDING_IDS = 64  # lm_head rows past the tokenizer's vocabulary: never allowed

SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}, "floor": {"type": "integer"}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["name", "address", "active"],
        "additionalProperties": False,
    },
    "array_of_objects_with_enum": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"status": {"enum": ["pending", "shipped", 3, None]}, "id": {"type": "integer"}},
            "required": ["status", "id"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 4,
    },
    "number_bounds": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 120},
            "delta": {"type": "integer", "exclusiveMinimum": -10, "exclusiveMaximum": 10},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["age", "delta", "ratio"],
        "additionalProperties": False,
    },
    "required_and_optional": {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 5},
            "b": {"type": "integer"},
            "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
            "d": {"type": ["string", "null"], "maxLength": 4},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "string_pattern": {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
            "email": {"type": "string", "format": "email", "maxLength": 30},
        },
        "required": ["sku", "email"],
        "additionalProperties": False,
    },
}
SEEDS = range(4)


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    return load_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, tokenizer.vocab_size + NUM_PADDING_IDS, tokenizer.eos_token_ids)


@pytest.fixture(scope="module")
def closing_bias(tokenizer, backend):
    """+4 on tokens holding ``"``, ``}`` or ``]`` and on EOS: free JSON from random logits then ends in a few
    dozen tokens instead of growing one endless string."""
    bias = torch.zeros(backend.vocab_size)
    for i, spelling in enumerate(tokenizer.token_bytes()):
        if any(c in spelling for c in b'"}]'):
            bias[i] = 4.0
    bias[list(tokenizer.eos_token_ids)] = 4.0
    return bias


def json_schema(name: str) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(SCHEMAS[name]))


def sample(backend, spec, seed, bias=None, max_tokens=300, record_masks_at=()):
    """Random logits, masked, argmax (uniform over the allowed tokens); stops on EOS. Returns the ids before
    EOS, the matcher, and the -inf pattern of the masks at the steps asked for."""
    generator = torch.Generator().manual_seed(seed)
    matcher = backend.matcher(spec)
    output_ids, masks = [], {}
    for step in range(max_tokens):
        logits = torch.randn(backend.vocab_size, generator=generator)
        if bias is not None:
            logits += bias
        matcher.mask_logits(logits)
        assert torch.isinf(logits[-NUM_PADDING_IDS:]).all()
        if step in record_masks_at:
            masks[step] = torch.isinf(logits)
        token_id = int(logits.argmax())
        matcher.accept(token_id)
        if token_id in backend.eos_token_ids:
            return output_ids, matcher, masks
        output_ids.append(token_id)
    raise AssertionError(f"no EOS after {max_tokens} tokens: {output_ids}")


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_sampling_gives_valid_json(tokenizer, backend, name):
    check_structured_output(json_schema(name))
    for seed in SEEDS:
        output_ids, matcher, _ = sample(backend, json_schema(name), seed)
        text = tokenizer.decode(output_ids)
        jsonschema.validate(json.loads(text), SCHEMAS[name], format_checker=jsonschema.FormatChecker())
        assert matcher.is_terminated


def test_json_object_mode_gives_json_objects(tokenizer, backend, closing_bias):
    spec = StructuredOutput("json_object")
    check_structured_output(spec)
    for seed in SEEDS:
        output_ids, _, _ = sample(backend, spec, seed, bias=closing_bias)
        assert isinstance(json.loads(tokenizer.decode(output_ids)), dict)


def test_whitespace_is_compact(tokenizer, backend):
    token_bytes = tokenizer.token_bytes()
    spec = json_schema("number_bounds")
    matcher = backend.matcher(spec)
    assert {token_bytes[i][:1] for i in matcher.allowed_token_ids()} == {b"{"}  # no leading whitespace
    matcher = backend.matcher(spec, tokenizer.encode('{"age":', add_special_tokens=False))
    assert all(token_bytes[i][:1] in b"123456789" for i in matcher.allowed_token_ids())


def test_special_tokens_never_spell_text(tokenizer, backend):
    """Inside a free string every byte sequence is allowed, yet no special token (it would be dropped from
    the decoded text) and no padding id; EOS neither, until the document is complete."""
    matcher = backend.matcher(StructuredOutput("json_object"), tokenizer.encode('{"', add_special_tokens=False))
    allowed = set(matcher.allowed_token_ids())
    assert len(allowed) > 40_000
    assert not allowed & (tokenizer.special_token_ids | tokenizer.eos_token_ids)
    assert max(allowed) < tokenizer.vocab_size


def test_complete_document_allows_only_eos(tokenizer, backend):
    spec = json_schema("number_bounds")
    almost = backend.matcher(spec, tokenizer.encode('{"age":30,"delta":-9,"ratio":0.5', add_special_tokens=False))
    assert not almost.is_terminated and not set(almost.allowed_token_ids()) & tokenizer.eos_token_ids
    done = backend.matcher(spec, tokenizer.encode('{"age":30,"delta":-9,"ratio":0.5}', add_special_tokens=False))
    assert done.is_terminated and done.allowed_token_ids() == sorted(tokenizer.eos_token_ids)
    done.accept(min(tokenizer.eos_token_ids))
    assert done.is_terminated


def test_rebuilt_matcher_has_the_same_mask(tokenizer, backend):
    """What the decode worker does after a handoff: a new backend, the output tokens fed in again."""
    steps = (0, 1, 3, 7, 12, 20)
    spec = json_schema("nested_object")
    output_ids, _, masks = sample(backend, spec, seed=11, record_masks_at=steps)
    assert len(output_ids) >= steps[-1]
    other_backend = GrammarBackend(tokenizer, backend.vocab_size, tokenizer.eos_token_ids)
    for step in steps:
        logits = torch.zeros(backend.vocab_size)
        other_backend.matcher(spec, output_ids[:step]).mask_logits(logits)
        assert torch.equal(torch.isinf(logits), masks[step]), step


@pytest.mark.parametrize("parallel", [False, True])
def test_batch_masks_equal_row_by_row(tokenizer, backend, monkeypatch, parallel):
    monkeypatch.setattr("engine.sampling.structured._MIN_CPUS_FOR_PARALLEL_MASKS", 1 if parallel else 10**6)
    specs = [json_schema("nested_object"), StructuredOutput("json_object"), json_schema("string_pattern")]
    prefixes = ['{"name":"Bo', "{", '{"sku":"AB']
    matchers = [backend.matcher(s, tokenizer.encode(p, add_special_tokens=False)) for s, p in zip(specs, prefixes)]
    logits = torch.randn(5, backend.vocab_size, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    rows = [4, 0, 2]
    for matcher, row in zip(matchers, rows):
        matcher.mask_logits(expected[row])
    mask_logits_batch(matchers, logits, rows)
    assert torch.equal(logits, expected)


def test_apply_token_bitmask_matches_masked_fill():
    vocab_size = 100  # not a multiple of 32: the last word's high bits are ignored
    bitmask = np.random.default_rng(0).integers(-2**31, 2**31, size=(2, 4), dtype=np.int32)
    logits = torch.randn(3, vocab_size)
    expected = logits.clone()
    for i, row in enumerate([2, 0]):
        allowed = [(int(bitmask[i, t // 32]) >> (t % 32)) & 1 for t in range(vocab_size)]
        expected[row].masked_fill_(torch.tensor(allowed) == 0, float("-inf"))
    apply_token_bitmask_(logits, bitmask, [2, 0])
    assert torch.equal(logits, expected)


def test_compiled_grammars_are_an_lru_of_bounded_size(tokenizer, monkeypatch):
    monkeypatch.setattr("engine.sampling.structured.MAX_CACHED_GRAMMARS", 2)
    backend = GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    specs = [StructuredOutput("json_schema", json.dumps({"type": "integer", "maximum": n})) for n in range(3)]
    for spec in (specs[0], specs[1], specs[0], specs[2]):  # specs[1] is the least recently used
        backend.matcher(spec)
    assert list(backend._fresh) == [specs[0], specs[2]]


def test_disallowed_token_raises(tokenizer, backend):
    matcher = backend.matcher(json_schema("number_bounds"))
    with pytest.raises(RuntimeError, match="not allowed"):
        matcher.accept(tokenizer.encode("[", add_special_tokens=False)[0])


@pytest.mark.parametrize("schema_text, problem", [
    ('{"type": "object", ', "not valid JSON"),
    ('[{"type": "string"}]', "must be a JSON object"),
    ('{"type": 5}', "not a valid JSON Schema: 5 is not valid under any of the given schemas (at type)"),
    ('{"properties": {"a": {"minLength": -1}}}', "(at properties/a/minLength)"),
    ('{"type": "array", "uniqueItems": true}', "cannot be enforced: Unimplemented keys: [\"uniqueItems\"]"),
    ('{"type": "integer", "minimum": 3, "maximum": 2}', "cannot be enforced: Unsatisfiable schema"),
])
def test_bad_schemas_are_refused_with_the_problem_named(backend, schema_text, problem):
    spec = StructuredOutput("json_schema", schema_text)
    with pytest.raises(InvalidRequestError) as e:
        check_structured_output(spec)
    assert problem in str(e.value)
    with pytest.raises(InvalidRequestError) as built:
        structured_output("json_schema", schema_text)
    assert str(built.value) == str(e.value)
    with pytest.raises(InvalidRequestError):
        backend.matcher(spec)


def test_check_does_not_import_torch():
    code = ("import sys, engine.sampling.structured as s; from engine.request import StructuredOutput as S; "
            "s.check_structured_output(S('json_schema', '{\"type\": \"object\"}')); "
            "s.check_structured_output(S('json_object')); assert 'torch' not in sys.modules, 'torch imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
