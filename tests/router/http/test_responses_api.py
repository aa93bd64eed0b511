"""POST /v1/responses (router/http/responses_api.py) through openai-python's Responses client on the tiny model: the
same tokens as the chat path, function calls as output items, a tool-call round trip, OpenAI's streaming events in
order (each with its sequence number) reassembling to the non-streamed response, and the stateful parts refused."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.router.http.test_app import served  # noqa: F401  (the module's server fixture)
from tests.router.http.test_tools import SCHEMAS, TOOLS, closing

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_text_output_equals_the_chat_path(served):
    kw = dict(temperature=0, max_output_tokens=12)
    chat = served.client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Rivers?"}],
        temperature=0, max_tokens=12)
    resp = served.client.responses.create(model="tiny", instructions="Be brief.", input="Rivers?", **kw)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == chat.choices[0].message.content
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert resp.usage.input_tokens == chat.usage.prompt_tokens and resp.usage.output_tokens == chat.usage.completion_tokens
    as_items = served.client.responses.create(model="tiny", instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Rivers?"}]}], **kw)
    assert as_items.output_text == resp.output_text


def test_function_calls_and_their_outputs_round_trip(served):
    kw = dict(model="tiny", tools=FLAT_TOOLS, tool_choice="required", temperature=1.0, max_output_tokens=160,
              extra_body={"seed": 2, "logit_bias": closing(served)})
    resp = served.client.responses.create(input="Weather in Paris?", **kw)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls and resp.status == "completed"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    follow_up = [{"role": "user", "content": "Weather in Paris?"},
                 *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                   for c in calls],
                 *[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]]
    again = served.client.responses.create(input=follow_up, **(kw | {"tool_choice": "auto"}))
    assert again.output and again.usage.input_tokens > resp.usage.input_tokens  # the calls and results went in


@pytest.mark.parametrize("tool_choice", [None, "required"])
def test_streamed_events_reassemble_to_the_response(served, tool_choice):
    kw = dict(model="tiny", input="Weather in Paris?", temperature=1.0, max_output_tokens=160,
              extra_body={"seed": 4, "logit_bias": closing(served)})
    if tool_choice:
        kw |= {"tools": FLAT_TOOLS, "tool_choice": tool_choice}
    whole = served.client.responses.create(**kw)
    events = list(served.client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    strip = lambda items: [{k: v for k, v in i.model_dump().items() if k not in ("id", "call_id")} for i in items]  # noqa: E731
    assert strip(final.output) == strip(whole.output)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == list(range(len(whole.output)))


@pytest.mark.parametrize("fields, param", [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"include": ["reasoning.encrypted_content"]}, "include"), ({"background": True}, "background"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"), ({"truncation": "auto"}, "truncation"),
])
def test_what_needs_stored_state_is_refused(served, fields, param):
    r = served.http.post(served.url + "/v1/responses", json={"model": "tiny", "input": "hi", **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
