"""Issue 46: a list of tool calls cut by max_tokens returns its complete calls, in every format, streamed or not (only
the unfinished call is dropped); a call identical to an earlier one is not returned; every dropped call is counted
in ``duet_tool_calls_dropped_total``. Parsers and shaper without a model, then the HTTP front door over a backend
that plays the outputs SmolLM2 wrote (issue 46's list of repeated ``final_result`` calls)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from engine.outputs import RequestOutput
from engine.text.tokenizer import Tokenizer
from router.backend import Backend, Health, ModelCard
from router.http.app import create_app
from router.metrics.collector import RouterMetrics
from router.openai.assistant_message import Shaping
from router.openai.tool_parsers import FORMATS, Call, Dropped, Text
from tests.router.http.http_harness import ServerThread
from tests.router.openai.test_tool_parsers import chunkings, events, plan, shape, without_ids

PARIS = '{"name":"final_result","arguments":{"city":"Paris","country":"France"}}'
OSLO = '{"name":"final_result","arguments":{"city":"Oslo","country":"Norway"}}'
CUT = '{"name":"final_result","arguments":{"city":"Par'
PARIS_ARGS, OSLO_ARGS = '{"city": "Paris", "country": "France"}', '{"city": "Oslo", "country": "Norway"}'


@pytest.mark.parametrize("name, text, want", [
    ("generic", '{"tool_calls":[' + PARIS + "," + OSLO + "," + CUT,
     [Call("final_result", PARIS_ARGS), Call("final_result", OSLO_ARGS), Dropped("unfinished", CUT)]),
    ("generic", '{"tool_calls":[' + CUT, [Dropped("unfinished", CUT)]),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": "]"}}, {"name": "b", "argu',
     [Call("a", '{"x": "]"}'), Dropped("unfinished", '{"name": "b", "argu')]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"q',
     [Call("a", "{}"), Text("\n"), Dropped("unfinished", '{"name": "b", "arguments": {"q')]),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": "}',
     [Call("a", "{}"), Dropped("unfinished", '{"name": "b", "parameters": {"x": "}')]),
    ("hermes", "text <tool_call>not json at all", [Text("text <tool_call>not json at all")]),  # no call: text
])
def test_a_cut_list_gives_its_complete_calls_at_every_chunking(name, text, want):
    for deltas in chunkings(text):
        assert events(FORMATS[name].parser(), deltas) == want, deltas


def test_the_generic_list_releases_each_call_as_soon_as_it_is_complete():
    parser = FORMATS["generic"].parser()
    assert parser.feed('{"tool_calls":[' + PARIS[:-1]) == []
    assert parser.feed('},{"name"') == [Call("final_result", PARIS_ARGS)]  # before the list ends: streamed early


def test_the_message_of_a_cut_list_holds_the_complete_calls_and_no_content():
    reports = []
    shaping = Shaping(plan("generic", choice="required"), report=lambda fmt, reason: reports.append((fmt, reason)))
    text = '{"tool_calls":[' + PARIS + "," + OSLO + "," + CUT
    for deltas in chunkings(text):
        content, _, calls = without_ids(shape(shaping, deltas))
        assert content == "" and calls == [(0, "final_result", PARIS_ARGS), (1, "final_result", OSLO_ARGS)]
    assert set(reports) == {("generic", "unfinished")}
    required = '[{"name":"get_time","parameters":{"city":"Oslo"}},{"name":"get_weather","parameters":{"ci'
    assert without_ids(shape(Shaping(plan(choice="required")), [required]))[2] == [(0, "get_time", '{"city": "Oslo"}')]


def test_a_call_identical_to_an_earlier_one_is_not_returned():
    reports = []
    shaping = Shaping(plan("generic", choice="required"), report=lambda fmt, reason: reports.append((fmt, reason)))
    reordered = '{"name":"final_result","arguments":{"country":"France","city":"Paris"}}'  # key order aside
    text = '{"tool_calls":[' + PARIS + "," + OSLO + "," + reordered + "]}"
    assert without_ids(shape(shaping, [text]))[2] == [(0, "final_result", PARIS_ARGS), (1, "final_result", OSLO_ARGS)]
    assert reports == [("generic", "repeat")]
    hermes = f'<tool_call>{PARIS}</tool_call><tool_call>{PARIS}</tool_call>'  # every format: the shaper decides
    assert len(shape(Shaping(plan()), [hermes]).tool_calls) == 1
    reports.clear()  # parallel_tool_calls false: a second, distinct call is dropped too, and counted
    one = Shaping(plan(parallel=False), report=lambda fmt, reason: reports.append((fmt, reason)))
    assert len(shape(one, [f'<tool_call>{PARIS}</tool_call><tool_call>{OSLO}</tool_call>']).tool_calls) == 1
    assert reports == [("hermes", "extra")]


def test_lists_that_may_hold_several_calls_carry_the_repeat_rule():
    from engine.sampling.call_lists import CallListOutput

    assert plan("generic", choice="required").constraint.list_depth == 1
    assert plan("generic").constraint.list_depth == 1  # auto: {"tool_calls": [...]} or {"response": ...}
    assert plan(choice="required").constraint.list_depth == 0  # vLLM's array
    for one_call in (plan("generic", choice="required", parallel=False), plan(choice="required", parallel=False),
                     plan("generic", choice={"type": "function", "function": {"name": "get_time"}})):
        assert not isinstance(one_call.constraint, CallListOutput)  # maxItems 1: nothing to repeat


class PlayedBackend(Backend):
    """Plays ``text`` in chunks of ``chunk`` characters, ending with ``reason``, whatever the request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.card = ModelCard("played", max_model_len=4096, vocab_size=tokenizer.vocab_size)
        self.text, self.reason, self.chunk = "", "stop", 7

    async def generate(self, request_id, prompt_token_ids, params) -> AsyncIterator[RequestOutput]:
        pieces = [self.text[i:i + self.chunk] for i in range(0, len(self.text), self.chunk)]
        for n, piece in enumerate(pieces, 1):
            last = n == len(pieces)
            yield RequestOutput(request_id, [65], piece, last, finish_reason=self.reason if last else None,
                                num_prompt_tokens=len(prompt_token_ids), num_output_tokens=n)

    def health(self) -> Health:
        return Health(True, {})


@pytest.fixture(scope="module")
def played(tiny_model):
    backend = PlayedBackend(Tokenizer.from_dir(tiny_model()))
    metrics = RouterMetrics("played", 4096)
    with ServerThread(create_app(backend, metrics=metrics)) as server:
        yield backend, openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0), server.url


def dropped_total(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {line.split('reason="')[1].split('"')[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("duet_tool_calls_dropped_total{")}


def call_back(client, stream: bool):
    """(content, [(name, arguments)], finish_reason), streamed calls reassembled as clients do."""
    kw = dict(model="played", messages=[{"role": "user", "content": "Where is the Eiffel tower?"}],
              tools=[{"type": "function", "function": {"name": "final_result", "parameters": {
                  "type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}}}}}],
              tool_choice="required", max_completion_tokens=150)
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        return choice.message.content, [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []], \
            choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            calls.setdefault(c.index, ["", ""])
            calls[c.index][0] += c.function.name or ""
            calls[c.index][1] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_cut_inside_its_call_list_returns_the_complete_calls(played, stream):
    """Issue 46's response: SmolLM2 repeating final_result until max_tokens cut the list. The complete calls come back
    as tool_calls (the repeats dropped), finish_reason stays length, no content; each drop is counted."""
    backend, client, url = played
    backend.text, backend.reason = '{"tool_calls":[' + ",".join([PARIS, OSLO, PARIS, PARIS]) + "," + CUT, "length"
    before = dropped_total(url)
    content, calls, finish = call_back(client, stream)
    assert content is None and finish == "length"
    assert [(n, json.loads(a)) for n, a in calls] == [("final_result", json.loads(PARIS_ARGS)),
                                                      ("final_result", json.loads(OSLO_ARGS))]
    after = dropped_total(url)
    assert after.get("repeat", 0) - before.get("repeat", 0) == 2
    assert after.get("unfinished", 0) - before.get("unfinished", 0) == 1
    # the list the repeat rule ended: the repeat is the last call, dropped; finish_reason tool_calls
    backend.text, backend.reason = '{"tool_calls":[' + ",".join([PARIS, OSLO, PARIS]) + "]}", "stop"
    content, calls, finish = call_back(client, stream)
    assert content is None and finish == "tool_calls" and len(calls) == 2
    assert dropped_total(url)["repeat"] - after["repeat"] == 1
