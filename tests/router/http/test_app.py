"""The OpenAI front door end to end: a real uvicorn server over LocalBackend on a tiny model, called with
the official `openai` client (and raw httpx for malformed input). Greedy answers are checked against a
separate engine run on the same prompt ids."""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from cluster.local_backend import LocalBackend
from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from engine.text.tokenizer import Tokenizer
from router.http.app import create_app
from tests.router.http.http_harness import ServerThread, assert_error_shape

PROMPT = "The river and the mountain"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about rivers."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@dataclass
class Served:
    url: str
    keyed_url: str  # the same backend behind an app with api_keys=("k1",)
    backend: LocalBackend
    reference_engine: Engine
    client: openai.OpenAI
    http: httpx.Client

    @property
    def tokenizer(self) -> Tokenizer:
        return self.backend.tokenizer

    def reference(self, prompt_ids: list[int], **params) -> dict:
        [result] = self.reference_engine.generate([prompt_ids], SamplingParams(**params))
        return result


@pytest.fixture(scope="module")
def served(tiny_model):
    model_dir = str(tiny_model())
    backend = LocalBackend(Engine(EngineConfig(model=model_dir)), model_id="tiny")
    app = create_app(backend, served_model_names=("tiny", "tiny-alias"))
    keyed_app = create_app(backend, api_keys=("k1",))
    try:
        with ServerThread(app) as server, ServerThread(keyed_app) as keyed:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
            with httpx.Client(timeout=30) as http:
                yield Served(server.url, keyed.url, backend, Engine(EngineConfig(model=model_dir)), client, http)
    finally:
        backend.async_engine.shutdown()


def test_http_modules_import_no_torch():
    code = "import sys, router.http.app, router.openai.protocol; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- completions -----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_as_ids", [False, True])
def test_completion_greedy_matches_engine(served, prompt_as_ids):
    ids = served.tokenizer.encode(PROMPT)
    ref = served.reference(ids, max_tokens=12, temperature=0, ignore_eos=True)
    r = served.client.completions.create(model="tiny", prompt=ids if prompt_as_ids else PROMPT, max_tokens=12,
                                         **GREEDY)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "tiny"
    [choice] = r.choices
    assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == (0, ref["text"], "length", None)
    assert len(ref["token_ids"]) == 12
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 12, len(ids) + 12)
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_concatenates_to_non_stream_with_logprobs(served):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, logprobs=3, **GREEDY)
    full = served.client.completions.create(**kw)
    *chunks, usage_chunk = served.client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens == len(served.tokenizer.encode(PROMPT))
    assert all(c.usage is None and c.id == usage_chunk.id for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]

    whole = full.choices[0].logprobs
    streamed = {key: sum((getattr(c.choices[0].logprobs, key) for c in chunks), [])
                for key in ("tokens", "token_logprobs", "text_offset", "top_logprobs")}
    assert len(whole.tokens) == len(whole.token_logprobs) == len(whole.top_logprobs) == 10
    assert streamed["tokens"] == whole.tokens and streamed["text_offset"] == whole.text_offset
    assert streamed["token_logprobs"] == pytest.approx(whole.token_logprobs, abs=1e-4)
    offsets = [0]
    for token in whole.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert whole.text_offset == offsets
    for logprob, top in zip(whole.token_logprobs, whole.top_logprobs):
        assert 1 <= len(top) <= 4  # the 3 most likely (distinct token strings) + the chosen one
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely


def test_completion_finish_reason_stop_on_stop_string(served):
    ids = served.tokenizer.encode(PROMPT)
    text = served.reference(ids, max_tokens=16, temperature=0, ignore_eos=True)["text"]
    stop = next(ch for ch in text[1:] if ch.isalnum())
    ref = served.reference(ids, max_tokens=16, temperature=0, ignore_eos=True, stop=(stop,))
    r = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, stop=[stop], **GREEDY)
    assert r.choices[0].finish_reason == ref["finish_reason"] == "stop"
    assert r.choices[0].text == ref["text"] == text[:text.index(stop)]
    assert r.usage.completion_tokens == len(ref["token_ids"])


def test_completion_echo_prepends_the_prompt(served):
    r = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, echo=True, **GREEDY)
    plain = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, **GREEDY)
    assert r.choices[0].text == PROMPT + plain.choices[0].text


def test_n_choices_use_seed_plus_index(served):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    both = served.client.completions.create(**kw, n=2, seed=7)
    singles = [served.client.completions.create(**kw, seed=s).choices[0].text for s in (7, 8)]
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == singles
    assert both.usage.completion_tokens == 12
    streamed = {0: "", 1: ""}
    for chunk in served.client.completions.create(**kw, n=2, seed=7, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[0], streamed[1]] == singles


# ---- chat ------------------------------------------------------------------------------------------


def test_chat_greedy_matches_engine_streamed_or_not(served):
    tok = served.tokenizer
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True), add_special_tokens=False)
    ref = served.reference(ids, max_tokens=8, temperature=0, ignore_eos=True)
    full = served.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, **GREEDY)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    [choice] = full.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", ref["text"], "length")
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(ids), 8)

    chunks = list(served.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, stream=True,
                                                         **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref["text"]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_content_parts_and_max_completion_tokens(served):
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    as_text = served.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, **GREEDY)
    as_parts = served.client.chat.completions.create(model="tiny", messages=parts, max_completion_tokens=5, **GREEDY)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    assert as_parts.usage.completion_tokens == 5


def test_chat_without_max_tokens_gets_the_rest_of_a_context_capped_to_the_kv_cache(tiny_model):
    """An engine whose KV cache holds less than the checkpoint's context (24 blocks of 16 < 1024 tokens) serves
    that much (GET /v1/models says so), and a chat request without max_tokens asks for the rest of it, as every
    OpenAI server does: answered, not refused for needing more KV blocks than there are."""
    backend = LocalBackend(Engine(EngineConfig(model=str(tiny_model()), num_blocks=24)), model_id="tiny")
    try:
        with ServerThread(create_app(backend)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            assert client.models.retrieve("tiny").model_extra["max_model_len"] == 24 * 16
            r = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
            assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == 24 * 16
    finally:
        backend.async_engine.shutdown()


def test_chat_logprobs_shapes_and_stream_consistency(served):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY)
    entries = served.client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(entries) == 6
    for e in entries:
        assert e.bytes == list(e.token.encode("utf-8"))
        assert len(e.top_logprobs) == 3
        top = [t.logprob for t in e.top_logprobs]
        assert top == sorted(top, reverse=True) and e.logprob == pytest.approx(top[0])
    streamed = [e for c in served.client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-4)


# ---- models, health, keys --------------------------------------------------------------------------


def test_models_list_and_retrieve(served):
    assert [m.id for m in served.client.models.list().data] == ["tiny", "tiny-alias"]
    # what the engine holds and runs, in the entry's "duet" extension (the openai client keeps it as an extra)
    weights = served.backend.engine.runner.weights
    for entry in (*served.client.models.list().data, served.client.models.retrieve("tiny")):
        duet = entry.model_extra["duet"]
        assert duet == weights.to_json() and duet["weight_bytes"] == sum(w["bytes"] for w in duet["weights"]) > 0
        assert duet["kernels"] == served.backend.engine.runner.ops.name
        assert {w["kind"] for w in duet["weights"]} >= {"embedding", "attention qkv", "mlp down", "norms", "lm_head"}
    assert served.client.models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError):
        served.client.models.retrieve("nope")
    r = served.client.completions.create(model="tiny-alias", prompt=PROMPT, max_tokens=2, **GREEDY)
    assert r.model == "tiny-alias"


def test_health(served):
    r = served.http.get(served.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_api_keys(served):
    url = served.keyed_url
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"}):
        r = httpx.post(url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401
        assert_error_shape(r.json(), "authentication_error")
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


# ---- bad input -------------------------------------------------------------------------------------


COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
IMAGE_PART = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_INPUT = [  # (id, path, body, status, param)
    ("malformed-json", "completions", b'{"model": "tiny",', 400, None),
    ("invalid-utf8", "completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),
    ("not-an-object", "completions", b"[1, 2]", 400, None),
    ("max-tokens-string", "completions", {**COMPLETION, "max_tokens": "5"}, 400, "max_tokens"),
    ("stream-not-bool", "completions", {**COMPLETION, "stream": "yes"}, 400, "stream"),
    ("missing-model", "completions", {"prompt": "hi"}, 400, "model"),
    ("missing-prompt", "completions", {"model": "tiny"}, 400, "prompt"),
    ("unknown-model", "completions", {**COMPLETION, "model": "gpt-9"}, 404, "model"),
    ("over-context", "completions", {**COMPLETION, "max_tokens": 5000}, 400, None),
    ("negative-max-tokens", "completions", {**COMPLETION, "max_tokens": -1}, 400, None),
    ("huge-n", "completions", {**COMPLETION, "n": 17}, 400, "n"),
    ("zero-n", "completions", {**COMPLETION, "n": 0}, 400, "n"),
    ("empty-prompt", "completions", {**COMPLETION, "prompt": ""}, 400, "prompt"),
    ("empty-id-prompt", "completions", {**COMPLETION, "prompt": []}, 400, "prompt"),
    ("too-many-prompts", "completions", {**COMPLETION, "prompt": ["a"] * 257}, 400, "prompt"),
    ("prompts-times-n", "completions", {**COMPLETION, "prompt": ["a"] * 20, "n": 13}, 400, "prompt"),
    ("one-empty-prompt-of-a-batch", "completions", {**COMPLETION, "prompt": ["a", ""]}, 400, "prompt"),
    ("one-empty-id-prompt-of-a-batch", "completions", {**COMPLETION, "prompt": [[1, 2], []]}, 400, "prompt"),
    ("token-id-out-of-range-in-a-batch", "completions", {**COMPLETION, "prompt": [[1, 2], [10**6]]}, 400, None),
    ("token-id-out-of-range", "completions", {**COMPLETION, "prompt": [1, 10**6]}, 400, None),
    ("huge-token-id-echo", "completions", {**COMPLETION, "prompt": [10**30], "echo": True}, 400, None),
    ("negative-temperature", "completions", {**COMPLETION, "temperature": -1}, 400, None),
    ("zero-top-p", "completions", {**COMPLETION, "top_p": 0}, 400, None),
    ("empty-stop-string", "completions", {**COMPLETION, "stop": [""]}, 400, None),
    ("too-many-stops", "completions", {**COMPLETION, "stop": ["x"] * 17}, 400, "stop"),
    ("presence-penalty-over-2", "completions", {**COMPLETION, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("frequency-penalty-string", "completions", {**COMPLETION, "frequency_penalty": "1"}, 400, "frequency_penalty"),
    ("repetition-penalty-zero", "completions", {**COMPLETION, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("logit-bias-not-an-id", "completions", {**COMPLETION, "logit_bias": {"hello": 2}}, 400, "logit_bias"),
    ("logit-bias-negative-id", "completions", {**COMPLETION, "logit_bias": {"-3": 2}}, 400, "logit_bias"),
    ("logit-bias-over-100", "completions", {**COMPLETION, "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ("logit-bias-id-outside-vocab", "completions", {**COMPLETION, "logit_bias": {"99999999": 1}}, 400, None),
    ("response-format-unknown", "completions", {**COMPLETION, "response_format": {"type": "yaml"}}, 400,
     "response_format"),
    ("json-schema-missing", "completions", {**COMPLETION, "response_format": {"type": "json_schema"}}, 400,
     "response_format"),
    ("json-schema-invalid", "chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 5}}}}}}, 400, "response_format"),
    ("json-schema-bad-name", "chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a b", "schema": {"type": "object"}}}}, 400, "response_format"),
    ("json-with-ignore-eos", "chat/completions", {**CHAT, "ignore_eos": True, "response_format": {
        "type": "json_object"}}, 400, "ignore_eos"),
    ("chat-max-tokens-zero", "chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("logprobs-21", "completions", {**COMPLETION, "logprobs": 21}, 400, "logprobs"),
    ("missing-messages", "chat/completions", {"model": "tiny"}, 400, "messages"),
    ("empty-messages", "chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("bad-role", "chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("image-part", "chat/completions", {**CHAT, "messages": [{"role": "user", "content": [IMAGE_PART]}]}, 400, None),
    ("top-logprobs-alone", "chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("tool-choice-unknown-tool", "chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                                                      "tool_choice": {"type": "function", "function": {"name": "g"}}},
     400, "tool_choice"),
    ("custom-tool-type", "chat/completions", {**CHAT, "tools": [{"type": "custom", "custom": {"name": "f"}}]}, 400, None),
    ("chat-over-context", "chat/completions", {**CHAT, "max_completion_tokens": 5000}, 400, None),
]


# every case, and as a streaming request every case whose body is JSON
BAD_INPUT_RUNS = [pytest.param(*case[1:], False, id=f"plain-{case[0]}") for case in BAD_INPUT] + [
    pytest.param(path, {**body, "stream": True}, status, param, True, id=f"stream-{name}")
    for name, path, body, status, param in BAD_INPUT if isinstance(body, dict) and "stream" not in body]


@pytest.mark.parametrize("path, body, status, param, stream", BAD_INPUT_RUNS)
def test_bad_input_is_an_openai_error(served, path, body, status, param, stream):
    r = served.http.post(f"{served.url}/v1/{path}", **({"json": body} if isinstance(body, dict) else {"content": body}))
    assert r.status_code == status, r.text
    error = assert_error_shape(r.json())
    if param is not None:
        assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"


def test_unknown_fields_are_ignored_and_routes_answer_in_openai_shape(served):
    r = served.http.post(served.url + "/v1/completions", json={**COMPLETION, "frobnicate": 3, "user": "u1"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert_error_shape(served.http.get(served.url + "/v1/nothing-here").json())
    r = served.http.get(served.url + "/v1/completions")
    assert r.status_code == 405
    assert_error_shape(r.json())


# ---- disconnects abort ---------------------------------------------------------------------------


def wait_until_idle(engine: Engine, num_aborted_before: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        idle = not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests
        if idle and engine.stats.num_aborted > num_aborted_before and engine.pool.num_used_blocks == 0:
            engine.pool.check()
            return
        time.sleep(0.02)
    pytest.fail(f"engine not idle: running={len(engine.scheduler.running)} used_blocks={engine.pool.num_used_blocks} "
                f"aborted={engine.stats.num_aborted - num_aborted_before}")


LONG = {"model": "tiny", "max_tokens": 900, "ignore_eos": True, "temperature": 0}  # seconds of decoding


@pytest.mark.parametrize("path, body", [("completions", {**LONG, "prompt": PROMPT}),
                                        ("chat/completions", {**LONG, "messages": MESSAGES})])
def test_stream_disconnect_aborts_the_request(served, path, body):
    engine = served.backend.engine
    num_aborted = engine.stats.num_aborted
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", f"{served.url}/v1/{path}", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            assert next(line for line in r.iter_lines() if line).startswith("data: {")
    wait_until_idle(engine, num_aborted)


def test_non_stream_client_timeout_aborts_the_request(served):
    engine = served.backend.engine
    num_aborted = engine.stats.num_aborted
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json={**LONG, "prompt": PROMPT}, timeout=0.5)
    wait_until_idle(engine, num_aborted)
