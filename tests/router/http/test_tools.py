"""Tool calling through the HTTP front door (router/openai/tools.py, router/openai/assistant_message.py) on the tiny
model, whose template renders no tools: duet's generic format, every mode enforced by a grammar. A random model writes
garbage unless the grammar holds it, so every call must still parse and validate against its tool's schema
(issue 25, must-show 3), and streamed calls reassembled as clients do must equal the non-streamed ones (2)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from router.openai.chat_format import ChatFormat
from router.openai.protocol import ChatCompletionRequest
from tests.router.http.test_app import served  # noqa: F401  (the module's server fixture)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
SEEDS = range(8)


def closing(served) -> dict[str, float]:
    """Random weights write endless strings; a bias towards closing tokens (the grammar still decides where they
    may go) ends the documents within max_tokens."""
    ids = [served.tokenizer.token_to_id(t) for t in ('"', "}")]
    assert all(i is not None for i in ids)
    return {str(i): 8.0 for i in ids}


def ask(served, stream=False, **kw):
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=160, temperature=1.0,
              logit_bias=closing(served)) | kw
    if not stream:
        choice = served.client.chat.completions.create(**kw).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None  # reassembled as clients do: by index, arguments concatenated
    for chunk in served.client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            call = calls.setdefault(c.index, [c.id, "", ""])
            call[1] += (c.function.name or "") if c.function else ""
            call[2] += (c.function.arguments or "") if c.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def valid(calls) -> None:
    for _, name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("choice, finish", [("required", "tool_calls"),
                                            ({"type": "function", "function": {"name": "get_time"}}, "stop")])
def test_required_and_named_calls_always_parse_and_validate(served, choice, finish):
    counts = []
    for seed in SEEDS:
        content, calls, reason = ask(served, seed=seed, tool_choice=choice)
        assert content is None and calls and reason == finish, (seed, content, calls, reason)
        valid(calls)
        if isinstance(choice, dict):
            assert [name for _, name, _ in calls] == ["get_time"]
        assert len({i for i, _, _ in calls}) == len(calls) and all(i.startswith("call_") for i, _, _ in calls)
        counts.append(len(calls))
    if choice == "required":
        assert max(counts) > 1  # parallel calls happen (several calls in one response)
        assert all(len(ask(served, seed=s, tool_choice="required", parallel_tool_calls=False)[1]) == 1 for s in SEEDS)


def test_auto_gives_a_message_or_valid_calls(served):
    kinds = set()
    for seed in SEEDS:
        content, calls, reason = ask(served, seed=seed, tool_choice="auto")
        if calls:
            valid(calls)
            assert content is None and reason == "tool_calls"
            kinds.add("calls")
        else:
            assert isinstance(content, str) and reason == "stop"
            kinds.add("message")
    assert kinds == {"calls", "message"}, kinds  # the model chose, the grammar only shaped


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_streamed_calls_equal_non_streamed(served, choice):
    several = False
    for seed in SEEDS:
        content, calls, reason = ask(served, seed=seed, tool_choice=choice)
        s_content, s_calls, s_reason = ask(served, stream=True, seed=seed, tool_choice=choice)
        assert (s_content, [c[1:] for c in s_calls], s_reason) == (content, [c[1:] for c in calls], reason)
        assert all(c[0].startswith("call_") for c in s_calls)
        several |= len(calls) > 1
    assert several or choice == "auto"  # required: several calls in one response among the seeds


def test_tool_choice_none_is_a_plain_message(served):
    out = served.client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                                max_tokens=8, temperature=0)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")


class Weather(BaseModel):
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


def test_openai_parse_with_a_pydantic_function_tool(served):
    """openai-python's chat.completions.parse: strict tool, arguments parsed into the pydantic model."""
    for seed in range(3):
        completion = served.client.chat.completions.parse(
            model="tiny", messages=MESSAGES, tools=[openai.pydantic_function_tool(Weather)], tool_choice="required",
            parallel_tool_calls=False, max_tokens=160, temperature=1.0, seed=seed, logit_bias=closing(served))
        call = completion.choices[0].message.tool_calls[0]
        assert call.function.name == "Weather" and isinstance(call.function.parsed_arguments, Weather)


def test_openai_streaming_helper_assembles_and_parses_the_call(served):
    """openai-python's chat.completions.stream: its events and final completion, parsed into the model."""
    kw = dict(model="tiny", messages=MESSAGES, tools=[openai.pydantic_function_tool(Weather)], tool_choice="required",
              parallel_tool_calls=False, max_tokens=160, temperature=1.0, seed=1, logit_bias=closing(served))
    with served.client.chat.completions.stream(**kw) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Weather) and len(done) == 1
    assert done[0].arguments == call.function.arguments and done[0].name == "Weather"
    whole = served.client.chat.completions.parse(**kw).choices[0].message.tool_calls[0]
    assert whole.function.parsed_arguments == call.function.parsed_arguments


def test_the_history_of_calls_and_results_reaches_the_prompt(served):
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}},
                   {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "JST"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
               {"role": "tool", "tool_call_id": "call_2", "content": "21:04"}]
    body = ChatCompletionRequest.model_validate({"model": "tiny", "messages": history, "tools": TOOLS})
    ids, shaping = ChatFormat.of(served.tokenizer).prompt(body)
    text = served.tokenizer.decode(ids, skip_special_tokens=False)
    assert '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}' in text
    assert '"tool_call_id": "call_1", "name": "get_weather", "content": "18 C, clear"' in text
    assert "21:04" in text and '"get_time"' in text and shaping.plan.mode == "auto"
    out = served.client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=160,
                                                temperature=1.0, seed=1, logit_bias=closing(served))
    assert out.choices[0].finish_reason in ("stop", "tool_calls")


@pytest.mark.parametrize("fields, problem", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tool names must be unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters (f): not a valid JSON Schema"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "pattern"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "needs the tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_time", "arguments": "{not json"}}]}]}, "arguments is not JSON"),
    ({"chat_template_kwargs": {"messages": "x"}}, "cannot set messages"),
])
def test_bad_tool_requests_are_400s(served, fields, problem):
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4} | fields
    body = {k: v for k, v in body.items() if v is not None}
    r = served.http.post(served.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and problem in r.json()["error"]["message"], r.text
