"""engine/sampling/call_lists.py on SmolLM2's real tokenizer: a "model" that only repeats one call gets its list closed right
after the first repeat (what SmolLM2 did with pydantic-ai's output tool, issue 46), by the mask alone; distinct
calls are untouched; a matcher rebuilt from the output tokens, or rolled back and advanced again (speculative
decoding), is in the same state."""
from __future__ import annotations

import json

import pytest

from engine.request import StructuredOutput
from engine.sampling.call_lists import CallListOutput, ListScanner, TokenTable
from tests.engine.sampling.test_structured import backend, tokenizer  # noqa: F401  (SmolLM2's tokenizer and grammar backend)

ITEM = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}
LISTS = {  # list_depth: (the schema, how the document opens)
    1: ({"type": "object", "properties": {"tool_calls": {"type": "array", "items": ITEM, "minItems": 1}},
         "required": ["tool_calls"], "additionalProperties": False}, '{"tool_calls":['),  # the generic format
    0: ({"type": "array", "items": ITEM, "minItems": 1}, "["),  # vLLM's required array (its key aside)
}


def call(city: str) -> str:
    return json.dumps({"name": "get_weather", "arguments": {"city": city}}, separators=(",", ":"))


@pytest.fixture(scope="module")
def table(tokenizer):
    return TokenTable(tokenizer.token_bytes(), tokenizer.special_token_ids)


def parrot(backend, table, spec, target: str, max_steps: int = 400) -> tuple[str, list[int], object]:
    """Decode under ``spec`` like a model that wants to write ``target``: each step the longest allowed token that
    continues it; when none is allowed, the longest allowed token among ``]}``, ``]``, then EOS. Returns (the text
    before EOS, its ids, the matcher)."""
    matcher, text, ids = backend.matcher(spec), "", []
    for _ in range(max_steps):
        allowed = set(matcher.allowed_token_ids())
        rest = target[len(text):]
        wanted = [i for n in range(min(len(rest), table.max_len), 0, -1) for i in table.spelling(rest[:n])]
        wanted += [i for s in ("]}", "]") for i in table.spelling(s)]
        choice = next((i for i in wanted if i in allowed), None)
        if choice is None:
            assert allowed & set(backend.eos_token_ids), "neither the target, a closing nor EOS is allowed"
            return text, ids, matcher
        matcher.accept(choice)
        text += table.text[choice]
        ids.append(choice)
    return text, ids, matcher


@pytest.mark.parametrize("list_depth", [1, 0])
def test_a_list_that_only_repeats_is_closed_after_the_first_repeat(backend, table, list_depth):
    schema, head = LISTS[list_depth]
    text = json.dumps(schema)
    target = head + ",".join([call("Paris"), call("Oslo")] + [call("Paris")] * 12)
    tail = "]" + "}" * list_depth
    out, _, matcher = parrot(backend, table, CallListOutput("json_schema", text, list_depth), target)
    assert out == head + ",".join([call("Paris"), call("Oslo"), call("Paris")]) + tail and matcher.is_terminated
    # without the rule the list goes on (max_tokens would cut it)
    out, _, _ = parrot(backend, table, StructuredOutput("json_schema", text), target, max_steps=150)
    assert out.count(call("Paris")) > 3


def test_distinct_calls_are_untouched(backend, table):
    schema, head = LISTS[1]
    doc = head + ",".join(call(c) for c in ("Paris", "Oslo", "Paris, TX", "Lima")) + "]}"
    out, _, matcher = parrot(backend, table, CallListOutput("json_schema", json.dumps(schema), 1), doc)
    assert out == doc and matcher.is_terminated


def test_the_repeat_may_not_run_on_into_another_call(backend, table):
    """A token that would complete the repeat and open the next call (SmolLM2's ``},``) is refused: of the tokens
    that could close the repeated call, only those ending with it or with the list's closing remain."""
    schema, head = LISTS[1]
    prefix = head + call("Paris") + "," + call("Paris")[:-1]  # the repeat, but for its last '}'
    closers = {}
    for name, spec in (("rule", CallListOutput("json_schema", json.dumps(schema), 1)),
                       ("plain", StructuredOutput("json_schema", json.dumps(schema)))):
        matcher = backend.matcher(spec, spelling(table, prefix))
        closers[name] = {table.text[i] for i in matcher.allowed_token_ids()}
    assert closers["plain"] >= {"}", "},", "}]"}  # the grammar alone: the list may go on
    assert "}" in closers["rule"] and "}]" in closers["rule"] and "}," not in closers["rule"], closers["rule"]
    assert closers["rule"] <= {"}", "}]", "}]}"}


def spelling(table, text: str) -> list[int]:
    """Ids spelling ``text``, the longest token first."""
    ids, done = [], ""
    while done != text:
        rest = text[len(done):]
        ids.append(next(i for n in range(min(len(rest), table.max_len), 0, -1) for i in table.spelling(rest[:n])))
        done += table.text[ids[-1]]
    return ids


def test_rebuilt_and_rolled_back_matchers_agree(backend, table):
    schema, head = LISTS[1]
    spec = CallListOutput("json_schema", json.dumps(schema), 1)
    target = head + ",".join([call("Rome"), call("Rome"), call("Rome")])
    out, ids, matcher = parrot(backend, table, spec, target)
    assert out == head + call("Rome") + "," + call("Rome") + "]}"
    for n in range(len(ids) + 1):  # a matcher rebuilt after n output tokens (a handoff, a migration)
        rebuilt = backend.matcher(spec, ids[:n])
        straight = backend.matcher(spec)
        for token_id in ids[:n]:
            straight.accept(token_id)
        assert rebuilt.allowed_token_ids() == straight.allowed_token_ids(), n
    for k in (1, 3, 9):  # drafts refused: rolled back k tokens, then the same tokens again
        rolled = backend.matcher(spec, ids)
        rolled.rollback(k)
        assert rolled.allowed_token_ids() == backend.matcher(spec, ids[:-k]).allowed_token_ids()
        for token_id in ids[-k:]:
            rolled.accept(token_id)
        assert rolled.is_terminated


def test_the_scanner_finds_items_whatever_their_strings_hold():
    scan = ListScanner(1)
    doc = '{"tool_calls": [ {"a": "]}\\"{,"}, [1, {"b": []}] , "s,]", 42 ] }'
    items = [item for ch in doc for item in scan.feed(ch)]  # a character at a time
    assert items == ['{"a": "]}\\"{,"}', '[1, {"b": []}]', '"s,]"', "42"] and scan.closed
    assert ListScanner(1).feed('{"response": "[not, a, list]"}') == []
