"""Constraints beyond JSON (engine/sampling/structured.py): regex, choice and Lark / GBNF grammars hold over random
sampling on SmolLM2's tokenizer; a schema's integers are bounded to ±(2^53 − 1) unless it bounds them itself; and the
case that showed the need — SmolLM2, a strict schema with an integer population, greedy, 120 tokens — gives valid JSON
for every prompt."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.request import SamplingParams, StructuredOutput
from engine.sampling.structured import SAFE_INTEGER, bound_integers, close_objects, structured_output
from tests.engine.sampling.test_structured import backend, tokenizer  # noqa: F401  (module fixtures: SmolLM2's)

SEEDS = range(12)


def sample(tokenizer, backend, spec, seed, bias=None, max_tokens=200) -> str:
    """Random logits (plus ``bias``) under the mask, argmax, until EOS: the text before EOS."""
    generator = torch.Generator().manual_seed(seed)
    matcher, ids = backend.matcher(spec), []
    for _ in range(max_tokens):
        logits = torch.randn(backend.vocab_size, generator=generator) * 3
        if bias is not None:
            logits += bias
        matcher.mask_logits(logits)
        token_id = int(logits.argmax())
        matcher.accept(token_id)
        if token_id in backend.eos_token_ids:
            assert matcher.is_terminated
            return tokenizer.decode(ids)
        ids.append(token_id)
    raise AssertionError(f"no EOS after {max_tokens} tokens: {tokenizer.decode(ids)!r}")


def bias_to(tokenizer, backend, chars: bytes, value=6.0):
    """+``value`` on every token that holds one of ``chars`` (pushes random sampling to grow a number)."""
    bias = torch.zeros(backend.vocab_size)
    for i, spelling in enumerate(tokenizer.token_bytes()):
        if spelling and any(c in chars for c in spelling):
            bias[i] = value
    return bias


@pytest.mark.parametrize("kind, text, check", [
    ("regex", r"[A-Z]{2}-[0-9]{3}( \(urgent\))?", lambda s: re.fullmatch(r"[A-Z]{2}-[0-9]{3}( \(urgent\))?", s)),
    ("choice", json.dumps(["yes", "no", "not sure yet"]), lambda s: s in ("yes", "no", "not sure yet")),
    ("grammar", 'start: "(" NUM ("+" NUM)~0..3 ")"\nNUM: /[0-9]{1,3}/',
     lambda s: re.fullmatch(r"\(\d{1,3}(\+\d{1,3}){0,3}\)", s)),
    ("grammar", 'root ::= animal " says " sound\nanimal ::= "cat" | "dog"\nsound ::= [a-z] [a-z] [a-z]?',  # GBNF
     lambda s: re.fullmatch(r"(cat|dog) says [a-z]{2,3}", s)),
])
def test_regex_choice_and_grammars_hold_over_random_sampling(tokenizer, backend, kind, text, check):
    spec = structured_output(kind, text)
    outputs = [sample(tokenizer, backend, spec, seed) for seed in SEEDS]
    assert all(check(s) for s in outputs), outputs
    if kind == "choice":
        assert len(set(outputs)) > 1  # the mask chooses among them, it does not force the first


@pytest.mark.parametrize("kind, text, problem", [
    ("regex", "[a-z", "unclosed character class"),
    ("regex", "(?<=a)b", "look-around"),
    ("choice", "[]", "non-empty list"),
    ("choice", '["a", 3]', "non-empty list of non-empty strings"),
    ("grammar", "start: (", "the grammar cannot be enforced"),
    ("grammar", "root ::= missing", "Rule 'missing' not found"),
    ("grammar", "  ", "the grammar is empty"),
])
def test_bad_constraints_are_refused_with_the_problem_named(kind, text, problem):
    with pytest.raises(InvalidRequestError, match=re.escape(problem)):
        structured_output(kind, text)
    with pytest.raises(InvalidRequestError, match="needs its constraint as text"):
        StructuredOutput(kind)


def test_integers_are_bounded_where_the_schema_leaves_them_open(tokenizer, backend):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    digits = bias_to(tokenizer, backend, b"0123456789")  # random sampling that wants digits forever
    for seed in SEEDS:
        value = json.loads(sample(tokenizer, backend, structured_output("json_schema", json.dumps(schema)), seed,
                                  bias=digits))["n"]
        assert isinstance(value, int) and abs(value) <= SAFE_INTEGER
    bounded = bound_integers({"type": "array", "items": {"anyOf": [{"type": ["integer", "null"]},
                                                                   {"type": "integer", "minimum": 0},
                                                                   {"type": "integer", "enum": [10**30]}]}})
    one, two, three = bounded["items"]["anyOf"]
    assert (one["minimum"], one["maximum"]) == (-SAFE_INTEGER, SAFE_INTEGER)
    assert (two["minimum"], two["maximum"]) == (0, SAFE_INTEGER)  # the schema's own bound is kept
    assert "minimum" not in three  # an enum is finite already


def test_objects_that_list_their_properties_get_no_others(tokenizer, backend):
    """No ``additionalProperties`` (LangChain's non-strict tools, most hand-written schemas): closed, as xgrammar's
    strict mode (vLLM's default) closes them. Random sampling that wants more keys still ends after the listed
    ones; what the schema says about other keys is kept; ``allOf`` branches stay open."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"]}
    quote = bias_to(tokenizer, backend, b'",')  # keeps wanting to open another key
    for seed in SEEDS:
        doc = json.loads(sample(tokenizer, backend, structured_output("json_schema", json.dumps(schema)), seed,
                                bias=quote))
        assert set(doc) == {"city", "days"}
    closed = close_objects({"type": "object", "$defs": {"p": {"properties": {"x": {}}}},
                            "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                                           "open": {"type": "object", "properties": {}, "additionalProperties": True},
                                           "pairs": {"type": "array", "prefixItems": [{"type": "string"}]},
                                           "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}}})
    assert closed["additionalProperties"] is False and closed["$defs"]["p"]["additionalProperties"] is False
    inner = closed["properties"]
    assert inner["properties"]["additionalProperties"] is False and inner["open"]["additionalProperties"] is True
    assert inner["pairs"]["items"] is False
    assert all("additionalProperties" not in branch for branch in inner["both"]["allOf"])
    assert "additionalProperties" not in inner["both"]


CITY = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["city", "country", "population"], "additionalProperties": False}
# unbounded, all four ran until max_tokens cut the number (0/4 valid; 15 of 48 such prompts valid, 48/48 bounded)
PROMPTS = [f"What is the population of {city}?" for city in ("Paris", "Lagos", "Cairo", "London")]


def test_the_strict_schema_case_gives_valid_json_for_every_prompt(smollm2_gguf, tokenizer):
    """The independent check's case (issue 25): SmolLM2, greedy, max_tokens 120 — unbounded, the model repeated
    digits (``"population":11112222333…``) until max_tokens cut the JSON (1 of 4 valid there, 0 of these 4)."""
    engine = Engine(EngineConfig(model=str(smollm2_gguf), num_blocks=256))
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    params = SamplingParams(max_tokens=120, temperature=0,
                            structured=structured_output("json_schema", json.dumps(CITY)))
    results = engine.generate(prompts, params)
    for result in results:
        assert result["finish_reason"] == "stop", result
        doc = json.loads(result["text"])
        jsonschema.validate(doc, CITY)
        assert abs(doc["population"]) <= SAFE_INTEGER
