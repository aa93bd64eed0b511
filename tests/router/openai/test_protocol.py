"""The OpenAI wire format without a server: request → SamplingParams, outputs → response bodies."""
from __future__ import annotations

import json
import re

import pytest

from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from router.openai.protocol import ChatCompletionRequest, CompletionRequest
from router.openai.response_builder import ChatResponses, ChoiceState, CompletionResponses


class LetterTokenizer:
    """decode([i]) is a letter; ids 1 and 2 collide on "?" as two halves of a character would."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("?" if i in (1, 2) else chr(ord("A") + i) for i in ids)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"model": "m", "prompt": "x", **fields}), strict=True)


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    return ChatCompletionRequest.model_validate_json(json.dumps(body), strict=True)


def test_sampling_params_defaults_and_per_choice_seeds():
    [p] = completion().sampling_params(num_prompt_tokens=10, max_model_len=100)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.logprobs) == (16, 1.0, 1.0, 0, None, None)
    params = completion(n=3, seed=5, top_k=-1, stop="x", logprobs=0).sampling_params(10, 100)
    assert [p.seed for p in params] == [5, 6, 7]
    assert {(p.top_k, p.stop, p.logprobs) for p in params} == {(0, ("x",), 0)}
    assert [p.seed for p in completion(n=2).sampling_params(10, 100)] == [None, None]


def test_chat_max_tokens_and_logprobs():
    assert chat().sampling_params(10, 100)[0].max_tokens == 90  # the rest of the context
    assert chat(max_tokens=7, max_completion_tokens=5).sampling_params(10, 100)[0].max_tokens == 5
    assert chat().sampling_params(100, 100)[0].max_tokens == 1  # the context check refuses it later
    assert chat(logprobs=True).sampling_params(10, 100)[0].logprobs == 0
    assert chat(logprobs=True, top_logprobs=4).sampling_params(10, 100)[0].logprobs == 4
    assert chat().sampling_params(10, 100)[0].logprobs is None
    with pytest.raises(InvalidRequestError):
        chat(top_logprobs=2).sampling_params(10, 100)


def test_logprobs_are_finite_and_colliding_strings_keep_the_likeliest():
    out = RequestOutput("r", [3], "D", True, finish_reason="length", new_logprobs=[float("-inf")],
                        new_top_logprobs=[{1: -0.5, 2: -0.1, 0: float("-inf")}], num_output_tokens=1)
    builder = CompletionResponses(LetterTokenizer(), "m", 4, with_logprobs=True)
    choice = ChoiceState(0)
    choice.add(out)
    body = json.loads(json.dumps(builder.response([choice]), allow_nan=False))
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == [-9999.0]
    assert logprobs["top_logprobs"] == [{"?": -0.1, "A": -9999.0, "D": -9999.0}]

    chat_body = ChatResponses(LetterTokenizer(), "m", 4, with_logprobs=True).response([choice])
    [entry] = chat_body["choices"][0]["logprobs"]["content"]
    assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.1, -0.5, -9999.0]
    assert entry["bytes"] == [ord("D")]


def test_echo_text_leads_the_first_delta_only():
    choice = ChoiceState(0, prefix_text="Hi")
    first = choice.add(RequestOutput("r", [0], "A", False))
    second = choice.add(RequestOutput("r", [1], "B", True, finish_reason="stop"))
    assert (first.text, second.text, choice.total().text) == ("HiA", "B", "HiAB")
    assert choice.error is None and choice.total().finish_reason == "stop"


def test_null_means_default_but_types_stay_strict():
    body = chat(stream=None, n=None, logprobs=None, stream_options={"include_usage": None},
                messages=[{"role": "user", "content": "x", "name": None}])
    assert (body.stream, body.n, body.logprobs, body.include_usage) == (False, 1, False, False)
    with pytest.raises(ValueError):
        chat(n="2")


@pytest.mark.parametrize("given, kind, text", [
    ({"regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"choice": ["a", "b c"]}, "choice", '["a", "b c"]'),
    ({"grammar": 'start: "x"+'}, "grammar", 'start: "x"+'),
    ({"json": {"type": "integer"}}, "json_schema", '{"type": "integer"}'),
    ({"json": '{"type": "integer"}'}, "json_schema", '{"type": "integer"}'),
    ({"json_object": True}, "json_object", None),
])
def test_structured_outputs_become_the_engines_constraint(given, kind, text):
    for request in (chat(structured_outputs=given), completion(structured_outputs=given)):
        [p] = request.sampling_params(10, 100)
        assert (p.structured.kind, p.structured.schema) == (kind, text)


@pytest.mark.parametrize("fields, problem", [
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"structured_outputs": {}}, "got none"),
    ({"structured_outputs": {"json_object": False}}, "got none"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "non-empty strings"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar: the grammar cannot be enforced"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "cannot both"),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos cannot be combined"),
])
def test_bad_structured_outputs_are_400s_naming_the_field(fields, problem):
    with pytest.raises(InvalidRequestError, match=re.escape(problem)) as e:
        chat(**fields).sampling_params(10, 100)
    assert e.value.param in ("structured_outputs", "ignore_eos")


def test_structured_outputs_keys_we_do_not_enforce_are_refused():
    with pytest.raises(ValueError, match="disable_any_whitespace"):  # pydantic's ValidationError: a 400
        chat(structured_outputs={"regex": "a", "disable_any_whitespace": True})
