"""Tool-call parsing and message shaping (router/openai/tool_parsers.py, router/openai/assistant_message.py), without a
model: the same text cut into deltas every possible way gives the same message as the whole text — the streaming bugs of
vLLM and SGLang (#9693, #16340, #31443; #6310) came from parsers that assumed one token per delta."""
from __future__ import annotations

import json

import pytest

from router.openai.assistant_message import MessagePart, Shaping
from router.openai.tool_parsers import FORMATS, Call, Dropped, GenericParser, Text, detect_format
from router.openai.tools import FunctionDef, NamedToolChoice, ToolDef, ToolPlan


def chunkings(text: str):
    """Every fixed delta size, and a ragged one."""
    for size in range(1, len(text) + 1):
        yield [text[i:i + size] for i in range(0, len(text), size)]
    cuts, i, step = [], 0, 1
    while i < len(text):
        cuts.append(text[i:i + step])
        i, step = i + step, step % 7 + 1
    yield cuts


def events(parser, deltas) -> list:
    out = []
    for d in deltas:
        out += parser.feed(d)
    out += parser.finish()
    merged = []  # adjacent texts joined: where text is cut is not part of the contract
    for e in out:
        if isinstance(e, Text) and merged and isinstance(merged[-1], Text):
            merged[-1] = Text(merged[-1].text + e.text)
        else:
            merged.append(e)
    return merged


HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
          '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris \\u00e9"}}</tool_call>')


@pytest.mark.parametrize("name, text, want", [
    ("hermes", HERMES, [Text("Let me check. "), Call("get_weather", '{"city": "Paris", "unit": "C"}'), Text("\n"),
                        Call("get_time", '{"tz": "Europe/Paris é"}')]),
    ("hermes", "no call <tool_ca but text", [Text("no call <tool_ca but text")]),
    ("hermes", "<tool_call>{not json}</tool_call> after", [Text("<tool_call>{not json}</tool_call> after")]),
    ("hermes", 'cut <tool_call>{"name": "f", "arguments": {}}', [Text("cut "), Call("f", "{}")]),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": "{}"}]',
     [Call("a", '{"x": 1}'), Call("b", "{}")]),
    ("llama3_json", ' {"name": "a", "parameters": {"x": [1, 2]}}; {"name": "b", "parameters": {}}',
     [Call("a", '{"x": [1, 2]}'), Call("b", "{}")]),
    ("llama3_json", "Plain answer {with braces}", [Text("Plain answer {with braces}")]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}', [Call("a", "{}")]),
])
def test_every_chunking_gives_the_same_events(name, text, want):
    for deltas in chunkings(text):
        assert events(FORMATS[name].parser(), deltas) == want, deltas


RESPONSE = '{"response":"Caf\\u00e9 \\"ok\\"\\n\\ud83d\\ude00 done"}'


@pytest.mark.parametrize("text, want", [
    (RESPONSE, [Text('Café "ok"\n😀 done')]),
    ('{"tool_calls":[{"name":"f","arguments":{"a":1}},{"name":"g","arguments":{}}]}', [Call("f", '{"a": 1}'),
                                                                                        Call("g", "{}")]),
    ('{"tool_calls":[{"name":"f","argu', [Dropped("unfinished", '{"name":"f","argu')]),  # cut by max_tokens
])
def test_the_generic_format_streams_its_response_text(text, want):
    for deltas in chunkings(text):
        assert events(GenericParser(), deltas) == want, deltas
    parser = GenericParser()
    assert parser.feed('{"response":"Hel') == [Text("Hel")]  # released as it decodes, not at the end


def plan(fmt="hermes", choice=None, parallel=True, strict=False):
    tools = [ToolDef(type="function", function=FunctionDef(name=n, parameters={
        "type": "object", "properties": {"city": {"type": "string"}}}, strict=strict))
        for n in ("get_weather", "get_time")]
    if isinstance(choice, dict):
        choice = NamedToolChoice.model_validate(choice)
    return ToolPlan.of(tools, choice, parallel, FORMATS[fmt])


def shape(shaping: Shaping, deltas) -> MessagePart:
    shaper, part = shaping.shaper(), MessagePart()
    for d in deltas:
        part = part.merged(shaper.feed(d))
    return part.merged(shaper.finish())


def without_ids(part: MessagePart):
    return part.content, part.reasoning, [(c["index"], c["function"]["name"], c["function"]["arguments"])
                                          for c in part.tool_calls]


THINKING = "<think>\nThe user wants weather.\n</think>\n\n" + HERMES


def test_reasoning_content_and_calls_split_the_same_at_every_chunking():
    shaping = Shaping(plan(), thinks=True)
    want = ("Let me check. ", "\nThe user wants weather.\n",
            [(0, "get_weather", '{"city": "Paris", "unit": "C"}'), (1, "get_time", '{"tz": "Europe/Paris é"}')])
    for deltas in chunkings(THINKING):
        assert without_ids(shape(shaping, deltas)) == want, deltas
    # the prompt opened the block (R1 distills): the output starts in reasoning
    assert without_ids(shape(Shaping(None, thinks=True, starts_thinking=True), ["abc</think>\n\nhi"])) == \
        ("hi", "abc", [])
    # no think block: all content; one cut off by max_tokens: all reasoning
    assert without_ids(shape(Shaping(None, thinks=True), ["hi <think>x"])) == ("hi <think>x", "", [])
    assert without_ids(shape(Shaping(None, thinks=True), ["<think>still thinking"])) == ("", "still thinking", [])


def test_call_ids_are_unique_and_blank_text_between_calls_is_dropped():
    part = shape(Shaping(plan()), [HERMES.replace("Let me check. ", "")])
    assert part.content == "" and len({c["id"] for c in part.tool_calls}) == 2
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in part.tool_calls)
    # parallel_tool_calls false: the first call only
    assert [c["function"]["name"] for c in shape(Shaping(plan(parallel=False)), [HERMES]).tool_calls] == ["get_weather"]


def test_required_and_named_outputs_are_json_calls():
    required = plan(choice="required")
    out = '[{"name":"get_time","parameters":{"city":"Oslo"}},{"name":"get_weather","parameters":{}}]'
    part = shape(Shaping(required), [out[:9], out[9:]])
    assert without_ids(part)[2] == [(0, "get_time", '{"city": "Oslo"}'), (1, "get_weather", "{}")]
    assert required.finish_reason(2, "stop") == "tool_calls" and required.finish_reason(0, "length") == "length"
    named = plan(choice={"type": "function", "function": {"name": "get_time"}})
    assert without_ids(shape(Shaping(named), ['{"city":"Oslo"}']))[2] == [(0, "get_time", '{"city": "Oslo"}')]
    assert named.finish_reason(1, "stop") == "stop"  # OpenAI: a named call finishes with stop
    assert without_ids(shape(Shaping(named), ['{"city":"Os']))[0] == '{"city":"Os'  # cut: the text, as content


def test_the_enforcing_grammars_are_built_and_checked():
    assert plan().constraint is None  # auto, not strict: parsed only
    assert plan(strict=True).constraint.kind == "grammar"  # auto + strict: the lazy grammar
    required = json.loads(plan(choice="required", parallel=False).constraint.schema)
    assert required["minItems"] == required["maxItems"] == 1
    generic = json.loads(plan("generic").constraint.schema)
    assert [list(branch["properties"]) for branch in generic["anyOf"]] == [["tool_calls"], ["response"]]
    assert plan("generic", choice="none").constraint is None


def test_the_tool_metric_tells_enforced_strict_calls_from_parsed_ones():
    assert plan().metric_mode == "auto" and plan(choice="required").metric_mode == "required"
    assert plan(strict=True).metric_mode == "auto_strict"  # hermes: the lazy grammar holds the calls
    assert plan("generic", strict=True).metric_mode == "auto_strict"  # the generic format's schema holds them
    assert plan("mistral", strict=True).metric_mode == "auto_strict_parsed"  # no grammar for it: a logged fallback


def test_formats_are_detected_from_the_template():
    assert detect_format("{{ messages }}").name == "generic"  # renders no tools
    assert detect_format("{% if tools %}<tool_call>{{ tools }}</tool_call>{% endif %}").name == "hermes"
    assert detect_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]").name == "mistral"
    assert detect_format("{% if tools %}<|python_tag|>{% endif %}").name == "llama3_json"


def test_the_generic_prompt_offers_the_tools_except_with_tool_choice_none():
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "09:00"},
               {"role": "assistant", "content": "It is nine."}]
    auto, _ = plan("generic").template_input(history)
    assert auto[0]["role"] == "system" and '"get_weather"' in auto[0]["content"]
    assert auto[-1]["content"] == '{"response":"It is nine."}'  # the answer as the model writes it here
    assert '"tool_call_id": "c1", "name": "get_time", "content": "09:00"' in auto[3]["content"]
    none, _ = plan("generic", choice="none").template_input(history)
    assert [m["role"] for m in none] == ["user", "assistant", "user", "assistant"]  # no tools offered
    assert none[1]["content"] == '{"tool_calls":[{"name":"get_time","arguments":{"city":"Oslo"}}]}'
    assert none[-1]["content"] == "It is nine."
    in_user, _ = plan("generic").template_input(history, placement="user")
    assert in_user[0]["role"] == "user" and in_user[0]["content"].startswith("You can use these tools")
