"""The front door when the backend misbehaves: refusals are 400s, failures after the status line are
in-band SSE errors, faults before it are 503 / 500 — always OpenAI error bodies, never a hang."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from engine.text.tokenizer import Tokenizer
from router.backend import Backend, Health, ModelCard
from router.http.app import create_app
from tests.router.http.http_harness import ServerThread, assert_error_shape


class ScriptedBackend(Backend):
    """Every request plays ``behaviour``: ok, refuse, crash (before any output), hang (no output ever),
    fail or crash_later (one token, then finish_reason "error" / an exception)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.card = ModelCard("fake", max_model_len=256, vocab_size=tokenizer.vocab_size)
        self.behaviour = "ok"
        self.healthy = True
        self.num_closed = 0  # hung streams closed by the front door

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self.behaviour == "refuse":
            raise InvalidRequestError("the request needs 99 KV blocks; this engine has 4")
        if self.behaviour == "crash":
            raise RuntimeError("a bug before the first token")
        if self.behaviour == "hang":  # queued forever: only the client going away ends it
            try:
                await asyncio.Event().wait()
            finally:
                self.num_closed += 1
        n_prompt = len(prompt_token_ids)
        yield RequestOutput(request_id, [65], "A", False, num_prompt_tokens=n_prompt, num_output_tokens=1)
        if self.behaviour == "crash_later":
            raise RuntimeError("a bug after the first token")
        reason, error = ("stop", None) if self.behaviour == "ok" else ("error", "decode worker lost")
        yield RequestOutput(request_id, [66], "B", True, finish_reason=reason, error=error,
                            num_prompt_tokens=n_prompt, num_output_tokens=2)

    def health(self) -> Health:
        return Health(self.healthy, {"workers": int(self.healthy)})


@pytest.fixture(scope="module")
def fake(tiny_model):
    backend = ScriptedBackend(Tokenizer.from_dir(tiny_model()))
    with ServerThread(create_app(backend)) as server, httpx.Client(base_url=server.url, timeout=10) as http:
        yield backend, http


@pytest.fixture
def scripted(fake):
    backend, http = fake
    yield backend, http
    backend.behaviour, backend.healthy, backend.num_closed = "ok", True, 0


BODIES = {"completions": {"model": "fake", "prompt": "hi", "max_tokens": 4},
          "chat/completions": {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}


def sse_events(response: httpx.Response) -> list:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line]


@pytest.mark.parametrize("path", list(BODIES))
def test_ok_script_round_trip(scripted, path):
    _, http = scripted
    r = http.post(f"/v1/{path}", json=BODIES[path])
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert r.json()["choices"][0]["finish_reason"] == "stop"


# (a streamed "fail" sends its first token before failing: in-band, see the next test)
@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("behaviour, status, type, stream", [
    ("refuse", 400, "invalid_request_error", False), ("refuse", 400, "invalid_request_error", True),
    ("crash", 500, "server_error", False), ("crash", 500, "server_error", True),
    ("fail", 503, "server_error", False)])
def test_faults_before_the_status_line(scripted, path, behaviour, status, type, stream):
    backend, http = scripted
    backend.behaviour = behaviour
    r = http.post(f"/v1/{path}", json={**BODIES[path], "stream": stream})
    assert r.status_code == status
    error = assert_error_shape(r.json(), type)
    assert {"refuse": "KV blocks", "crash": "internal", "fail": "decode worker lost"}[behaviour] in error["message"]


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("behaviour, message", [("fail", "decode worker lost"), ("crash_later", "internal")])
def test_stream_failure_after_first_token_is_an_sse_error(scripted, path, behaviour, message):
    backend, http = scripted
    backend.behaviour = behaviour
    with http.stream("POST", f"/v1/{path}", json={**BODIES[path], "stream": True}) as r:
        assert r.status_code == 200
        *chunks, error, done = sse_events(r)
    assert done == "[DONE]"
    assert "A" in "".join(chunks)
    assert message in assert_error_shape(json.loads(error), "server_error")["message"]
    client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        list(client.completions.create(model="fake", prompt="hi", max_tokens=4, stream=True))


def test_unhealthy_backend_is_503(scripted):
    backend, http = scripted
    assert http.get("/health").status_code == 200
    backend.healthy = False
    r = http.get("/health")
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "unavailable" and body["workers"] == 0
    assert_error_shape({"error": body["error"]}, "server_error")


@pytest.mark.parametrize("stream", [False, True])
def test_client_gone_while_nothing_is_produced_closes_the_backend_stream(scripted, stream):
    backend, http = scripted
    backend.behaviour = "hang"
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={**BODIES["completions"], "stream": stream}, timeout=0.3)
    deadline = time.monotonic() + 3
    while backend.num_closed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.num_closed == 1
