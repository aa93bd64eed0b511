"""Fuzzing the front doors: schemathesis against the published OpenAPI document (positive and negative
modes, every check; >= 2,000 generated requests under `make soak`, fewer random ones in `make test`) and
hypothesis against the gRPC messages. Nothing may be a server error, error bodies stay bounded and
OpenAI-shaped, and the servers still serve afterwards."""
from __future__ import annotations

import asyncio
import collections
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.local_backend import LocalBackend
from engine.config import EngineConfig
from engine.text.tokenizer import Tokenizer
from router.http.app import create_app
from tests.router.http.http_harness import ServerThread, assert_error_shape
from tests.router.http.test_admin import RecordingOperator
from tests.router.http.test_backend_faults import ScriptedBackend

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
REPORT = ROOT / "build" / "fuzz"
# `make soak` (DUET_FAULT_SCALE=5): the full run. `make test`: the coverage phase (every schema edge case) in
# full, fewer random examples per operation (the suite's 25-minute budget; 160 s -> 105 s here).
SOAK = int(os.environ.get("DUET_FAULT_SCALE", "1")) > 1
EXAMPLES, MIN_CASES = ("110", 2000) if SOAK else ("40", 1500)


def test_schemathesis_finds_no_server_error_and_nothing_undocumented(tiny_model):
    """Every operation of /openapi.json, valid and invalid inputs, all checks (status codes, content types,
    response schemas, schema-violating requests rejected, Allow headers, ...)."""
    backend = ScriptedBackend(Tokenizer.from_dir(tiny_model()))
    REPORT.mkdir(parents=True, exist_ok=True)
    events = REPORT / "schemathesis.ndjson"
    operator = RecordingOperator()  # /admin/* answer as in a cluster (pools of 1..3), instead of 404
    with ServerThread(create_app(backend, operator=operator)) as server:
        run = subprocess.run(
            [str(Path(sys.executable).parent / "st"), "run", server.url + "/openapi.json", "--checks", "all",
             "--exclude-checks", "positive_data_acceptance", "--mode", "all", "--max-examples", EXAMPLES, "--seed", "7",
             "--no-shrink", "--workers", "1", "--request-timeout", "20", "--report", "ndjson",
             "--report-ndjson-path", str(events)], capture_output=True, text=True, timeout=600)
        summary = run.stdout[run.stdout.rfind("Test cases:"):]
        assert run.returncode == 0, run.stdout[-6000:]
        generated = int(summary.split()[2])
        assert generated >= MIN_CASES, summary
        ok = httpx.post(server.url + "/v1/completions", json={"model": "fake", "prompt": "still here?",
                                                              "max_tokens": 2}, timeout=10)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "AB"  # still serving
        assert operator.calls  # the fuzzer got through to the pool writes
    (REPORT / "schemathesis.txt").write_text(run.stdout)


@pytest.mark.soak  # ~50 s: `make soak`; `make test` fuzzes the scripted backend above and the hostile bodies below
def test_schemathesis_against_a_real_engine(tiny_model):
    """A shorter run against a real engine (LocalBackend: tokenizer, validation against the model's vocab
    and context length, scheduler, sampler), so errors only real generation can raise are reached too. Random
    examples and stateful runs only: the schema's edge cases (the coverage phase, 130 of this run's 160 s once
    tools and /v1/responses were documented) are the test above's, against a backend that answers at once."""
    backend = LocalBackend.from_config(EngineConfig(model=str(tiny_model()), num_blocks=256, max_model_len=256))
    REPORT.mkdir(parents=True, exist_ok=True)
    try:
        with ServerThread(create_app(backend)) as server:
            run = subprocess.run(
                [str(Path(sys.executable).parent / "st"), "run", server.url + "/openapi.json", "--checks", "all",
                 "--exclude-checks", "positive_data_acceptance", "--mode", "all", "--max-examples", "35",
                 "--phases", "fuzzing,stateful", "--seed", "11", "--no-shrink", "--workers", "1", "--request-timeout", "60"],
                capture_output=True, text=True, timeout=600)
            summary = run.stdout[run.stdout.rfind("Test cases:"):]
            assert run.returncode == 0, run.stdout[-6000:]
            assert int(summary.split()[2]) >= 400, summary
            model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            ok = httpx.post(server.url + "/v1/completions", timeout=30,
                            json={"model": model, "prompt": "still here?", "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3  # still serving
            assert backend.engine.pool.num_used_blocks == 0  # nothing the fuzzer sent left a block behind
    finally:
        backend.async_engine.shutdown()
    (REPORT / "schemathesis-real-engine.txt").write_text(run.stdout)


HOSTILE_BODIES = {
    "huge n": {"model": "fake", "prompt": "x", "n": 10**9},
    "long prompt list": {"model": "fake", "prompt": ["a"] * 50_000},
    "deep nesting": '{"model": "fake", "prompt": ' + "[" * 5000 + "]" * 5000 + "}",
    "nul bytes": {"model": "fake\x00", "prompt": "a\x00b", "stop": ["\x00"]},
    "numbers out of range": {"model": "fake", "prompt": "x", "max_tokens": 10**30, "temperature": 1e308, "seed": -2**70},
    "wrong types everywhere": {"model": ["fake"], "prompt": {"a": 1}, "stream": "yes", "n": "2"},
}


@pytest.mark.parametrize("case", list(HOSTILE_BODIES))
def test_hostile_bodies_are_clear_4xx(tiny_model, case):
    backend = ScriptedBackend(Tokenizer.from_dir(tiny_model()))
    body = HOSTILE_BODIES[case]
    path = "/v1/chat/completions" if "messages" in str(body)[:80] else "/v1/completions"
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    with ServerThread(create_app(backend)) as server:
        r = httpx.post(server.url + path, content=raw,
                       headers={"Content-Type": "application/json"}, timeout=20)
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
        assert len(r.content) < 4096  # bounded error bodies, whatever came in
        assert_error_shape(r.json())


def test_chat_content_is_data_not_template(tiny_model):
    """Template syntax inside a message is text: rendered verbatim into the prompt, never evaluated."""
    backend = ScriptedBackend(Tokenizer.from_dir(tiny_model()))
    hostile = "{{ raise_exception('x') }}{% for i in range(10**9) %}{% endfor %}"
    with ServerThread(create_app(backend)) as server:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=10, json={
            "model": "fake", "messages": [{"role": "user", "content": hostile}]})
        assert r.status_code == 200
    prompt = backend.tokenizer.apply_chat_template([{"role": "user", "content": hostile}])
    assert hostile in prompt


def test_invalid_utf8_and_a_false_content_length(tiny_model):
    backend = ScriptedBackend(Tokenizer.from_dir(tiny_model()))
    with ServerThread(create_app(backend)) as server:
        r = httpx.post(server.url + "/v1/completions", content=b'{"model": "fake", "prompt": "\xff\xfe"}',
                       headers={"Content-Type": "application/json"}, timeout=10)
        assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # claims more than it sends
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\": \"fake\"}")
            sock.shutdown(socket.SHUT_WR)
            reply = sock.recv(65536)
        assert not reply.startswith(b"HTTP/1.1 5"), reply[:200]
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ---- gRPC: hypothesis on the messages, against a real engine ----------------------------------------------

texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=200)
ints = st.one_of(st.integers(-5, 40), st.integers(-2**31, 2**31 - 1))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 2))
messages = st.lists(st.tuples(st.sampled_from(["user", "assistant", "system", "tool", "", "x" * 50]), texts),
                    max_size=6)


@pytest.fixture(scope="module")
def grpc_server(tiny_model):
    from router.grpc.server import start_grpc_server

    loop = asyncio.new_event_loop()
    backend = LocalBackend.from_config(EngineConfig(model=str(tiny_model()), num_blocks=256, max_model_len=512))
    server = loop.run_until_complete(start_grpc_server(backend, "127.0.0.1", 0, max_request_bytes=1 << 20))
    yield loop, server.port, backend
    loop.run_until_complete(server.stop(1))
    loop.run_until_complete(backend.aclose())
    loop.close()


def request_strategy():
    from proto.duet.v1 import generate_pb2 as pb

    def build(prompt_kind, text, ids, chat, max_tokens, temperature, top_p, top_k, seed, stop, stop_ids, logprobs,
              min_tokens, model, request_id):
        kw = dict(model=model, request_id=request_id, stop=stop, stop_token_ids=stop_ids)
        for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                            ("top_k", top_k), ("seed", seed), ("logprobs", logprobs), ("min_tokens", min_tokens)):
            if value is not None:
                kw[name] = value
        if prompt_kind == "text":
            kw["text"] = text
        elif prompt_kind == "ids":
            kw["token_ids"] = pb.TokenIds(ids=ids)
        elif prompt_kind == "chat":
            kw["chat"] = pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in chat])
        return pb.GenerateRequest(**kw)

    opt = lambda s: st.one_of(st.none(), s)  # noqa: E731
    return st.builds(
        build, st.sampled_from(["text", "ids", "chat", "none"]), texts,
        st.lists(st.integers(0, 2**32 - 1), max_size=60), messages,
        opt(st.integers(-3, 64) | st.integers(-2**31, 2**31 - 1)), opt(floats), opt(floats), opt(ints),
        opt(st.integers(-2**63, 2**63 - 1)), st.lists(texts, max_size=5), st.lists(st.integers(0, 2**32 - 1), max_size=5),
        opt(st.integers(-2, 30)), opt(st.integers(-2, 80)), st.sampled_from(["", "tiny-llama0", "nope"]),
        st.one_of(st.just(""), texts))


ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
SEEN: collections.Counter = collections.Counter()  # status codes the fuzz produced (checked afterwards)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(request=request_strategy())
def test_grpc_messages_never_cause_a_server_error(grpc_server, request):
    from proto.duet.v1 import generate_pb2_grpc as pb_grpc

    loop, port, backend = grpc_server
    model = backend.card.model_id
    if request.model == "tiny-llama0":
        request.model = model

    async def call():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerateStub(channel)
            try:
                return grpc.StatusCode.OK, [r async for r in stub.Generate(request, timeout=60)]
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()

    code, detail = loop.run_until_complete(call())
    SEEN[code.name] += 1
    assert code in ALLOWED, (code, detail, request)
    if code != grpc.StatusCode.OK:
        assert len(detail) < 2048


def test_grpc_server_still_serves_after_the_fuzz(grpc_server):
    from proto.duet.v1 import generate_pb2 as pb
    from proto.duet.v1 import generate_pb2_grpc as pb_grpc

    loop, port, backend = grpc_server

    async def call():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerateStub(channel)
            return [r async for r in stub.Generate(pb.GenerateRequest(text="the river", max_tokens=4, temperature=0))]

    replies = loop.run_until_complete(call())
    assert sum(len(r.token_ids) for r in replies) == 4
    assert SEEN["OK"] >= 20 and SEEN["INVALID_ARGUMENT"] >= 20, SEEN  # the fuzz reached both kinds of path
    backend.engine.pool.check()
    assert backend.engine.pool.num_used_blocks == 0
