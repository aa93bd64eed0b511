"""The OpenAI features clients send every day, through the HTTP front door over one engine (LocalBackend):
lists of prompts, echo with prompt logprobs (and max_tokens 0), penalties and logit_bias, response_format.
The disaggregated path runs the same checks in tests/cluster/test_api_features_cluster.py."""
from __future__ import annotations

import json

import jsonschema
import pytest

from engine.request import SamplingParams, StructuredOutput
from tests.router.http.test_app import served  # noqa: F401  (the module's server fixture)

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                  "required": ["x", "y"], "additionalProperties": False},
        "ok": {"type": "boolean"}}, "required": ["point", "ok"], "additionalProperties": False},
    "list": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                          "kind": {"enum": ["x", "y"]}},
                                         "required": ["id", "kind"], "additionalProperties": False},
             "minItems": 1, "maxItems": 3},
}


def chat_text(client, stream: bool, **kw) -> str:
    """The assistant's text of one chat completion, streamed (the deltas joined) or not."""
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    return client.chat.completions.create(**kw).choices[0].message.content


def prompt_logprobs_of(served, ids: list[int], k: int):
    """The engine's own prompt logprobs (tests/engine checks those against transformers)."""
    engine = served.reference_engine
    engine.add_request("ref", prompt_token_ids=ids, params=SamplingParams(max_tokens=0, prompt_logprobs=k))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs[-1].prompt_logprobs, outs[-1].prompt_top_logprobs


# ---- a list of prompts ------------------------------------------------------------------------------


@pytest.mark.parametrize("as_ids", [False, True])
def test_32_prompts_in_one_request_equal_32_single_requests(served, as_ids):
    texts = [f"prompt number {i} about the river" + " and" * (i % 5) for i in range(32)]
    prompts = [served.tokenizer.encode(t) for t in texts] if as_ids else texts
    kw = dict(model="tiny", max_tokens=6, temperature=0.9, seed=123, n=2, logprobs=1,
              extra_body={"ignore_eos": True, "repetition_penalty": 1.2})
    batch = served.client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in batch.choices] == list(range(64))
    singles = [served.client.completions.create(prompt=p, **kw) for p in prompts]
    for p, single in enumerate(singles):
        for i in range(2):
            got, want = batch.choices[p * 2 + i], single.choices[i]
            assert (got.text, got.logprobs.tokens) == (want.text, want.logprobs.tokens)
            # batched with other prompts, the GEMMs add in another order: logprobs agree to fp32 rounding
            assert got.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs, abs=1e-5)
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 64 * 6
    assert len({c.text for c in batch.choices}) > 32  # prompts and seeds give different texts


def test_a_list_of_prompts_streams_every_choice(served):
    prompts = ["the river", "the mountain", "the bridge"]
    stream = served.client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0, n=2,
                                              stream=True, extra_body={"ignore_eos": True})
    texts, finished = {}, set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    plain = served.client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0, n=2,
                                             extra_body={"ignore_eos": True})
    assert finished == set(range(6))
    assert [texts[i] for i in range(6)] == [c.text for c in plain.choices]


# ---- echo with prompt logprobs ----------------------------------------------------------------------


@pytest.mark.parametrize("as_ids", [False, True])
def test_echo_logprobs_max_tokens_0_gives_prompt_logprobs_first_null(served, as_ids):
    text = "The river and the mountain met at the bridge"
    ids = served.tokenizer.encode(text)
    out = served.client.completions.create(model="tiny", prompt=ids if as_ids else text, max_tokens=0, echo=True,
                                           logprobs=2, temperature=0)
    choice = out.choices[0]
    want, want_top = prompt_logprobs_of(served, ids, 2)
    assert choice.text == (served.tokenizer.decode(ids) if as_ids else text)
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 0
    assert out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.tokens == [served.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-6)
    for j in range(1, len(ids)):
        top = lp.top_logprobs[j]
        expected = {served.tokenizer.decode([t], skip_special_tokens=False): v for t, v in want_top[j].items()}
        assert set(expected) <= set(top) and len(top) <= 3  # the 2 most likely, plus the prompt's own token
        assert top[lp.tokens[j]] == pytest.approx(lp.token_logprobs[j])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_logprobs_with_generation_streamed_equals_not_streamed(served):
    kw = dict(model="tiny", prompt="the old stone bridge", max_tokens=4, echo=True, logprobs=1, temperature=0,
              extra_body={"ignore_eos": True})
    plain = served.client.completions.create(**kw).choices[0]
    ids = served.tokenizer.encode("the old stone bridge")
    n = len(ids)
    assert plain.logprobs.token_logprobs[0] is None and len(plain.logprobs.tokens) == n + 4
    assert plain.text.startswith("the old stone bridge")
    tokens, logprobs, text = [], [], ""
    for chunk in served.client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                logprobs += c.logprobs.token_logprobs
    assert (text, tokens, logprobs) == (plain.text, plain.logprobs.tokens, plain.logprobs.token_logprobs)
    # the generated part equals a plain request's
    gen = served.client.completions.create(**{**kw, "echo": False}).choices[0]
    assert plain.logprobs.token_logprobs[n:] == gen.logprobs.token_logprobs


def test_echo_without_logprobs_and_max_tokens_0(served):
    out = served.client.completions.create(model="tiny", prompt=["a river", "a bridge"], max_tokens=0, echo=True)
    assert [c.text for c in out.choices] == ["a river", "a bridge"]
    assert all(c.finish_reason == "length" and c.logprobs is None for c in out.choices)


# ---- penalties and logit_bias -----------------------------------------------------------------------


def test_penalties_and_logit_bias_equal_the_engine(served):
    ids = served.tokenizer.encode("the river the river the river")
    extra = {"ignore_eos": True, "repetition_penalty": 1.3}
    out = served.client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0.8, seed=9,
                                           presence_penalty=0.4, frequency_penalty=0.9,
                                           logit_bias={"17": 4.0, "18": -100}, extra_body=extra)
    want = served.reference(ids, max_tokens=12, temperature=0.8, seed=9, presence_penalty=0.4, frequency_penalty=0.9,
                            logit_bias={17: 4.0, 18: -100}, ignore_eos=True, repetition_penalty=1.3)
    assert out.choices[0].text == want["text"]
    plain = served.reference(ids, max_tokens=12, temperature=0.8, seed=9, ignore_eos=True)
    assert plain["text"] != want["text"]


def test_logit_bias_100_forces_a_token_in_chat(served):
    token = served.tokenizer.encode("river", add_special_tokens=False)[0]
    out = served.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, logit_bias={str(token): 100}, temperature=1.0)
    assert out.choices[0].message.content == served.tokenizer.decode([token] * 5)


# ---- structured output ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_parse_and_validate(served, name, stream):
    """A tiny random model writes garbage unless the grammar holds it: every output must still be valid."""
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    texts = []
    for seed in range(3):
        kw = dict(model="tiny", messages=[{"role": "user", "content": "give me json"}], max_tokens=200,
                  temperature=1.0, seed=seed, response_format=fmt)
        text = chat_text(served.client, stream, **kw)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
        texts.append(text)
    if name == "person":  # free strings: sampling still samples inside the grammar
        assert len(set(texts)) > 1


def test_json_object_on_completions(served):
    # random weights write endless strings; a bias towards closing tokens (the mask still decides where they
    # may go) lets every document end well within max_tokens
    closing = {str(served.tokenizer.token_to_id(t)): 10.0 for t in ('"', "}") if served.tokenizer.token_to_id(t)}
    assert len(closing) == 2
    out = served.client.completions.create(model="tiny", prompt=["json please", "more json"], max_tokens=300,
                                           temperature=1.0, seed=4, n=2, logit_bias=closing,
                                           extra_body={"response_format": {"type": "json_object"}})
    for c in out.choices:
        assert c.finish_reason == "stop" and isinstance(json.loads(c.text), dict), c.text


def test_structured_output_spec_reaches_the_engine_as_schema_text(served):
    from router.openai.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate_json(json.dumps({
        "model": "tiny", "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["person"]}}}))
    [params] = body.sampling_params(3, 100)
    assert params.structured == StructuredOutput("json_schema", json.dumps(SCHEMAS["person"]))


# ---- the published document --------------------------------------------------------------------------


def test_openapi_document_describes_the_new_fields(served):
    doc = served.http.get(served.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    for field in ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "response_format",
                  "echo", "logprobs", "prompt", "max_tokens"):
        assert field in completion, field
    assert "presence_penalty" in schemas["ChatCompletionRequest"]["properties"]
    fmt = json.dumps(schemas["ResponseFormat"])
    assert all(kind in fmt for kind in ("json_object", "json_schema", "text"))
    assert "schema" in schemas["JsonSchemaFormat"]["properties"]
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        assert "structured_outputs" in schemas[model]["properties"], model
    assert set(schemas["StructuredOutputs"]["properties"]) == {"json", "regex", "choice", "grammar", "json_object"}
    chat = schemas["ChatCompletionRequest"]["properties"]
    for field in ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs"):  # issue 25
        assert field in chat, field
    assert "post" in doc["paths"]["/v1/responses"]
    models = served.client.models.list().data
    assert all(m.model_extra["max_model_len"] == served.backend.card.max_model_len for m in models)
