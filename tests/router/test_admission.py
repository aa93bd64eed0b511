"""Admission control and limits (router/admission.py, the front doors): one status per condition, each
tested on real servers — 429 with Retry-After, 408, 504, 503, 413, 405 with Allow, gRPC RESOURCE_EXHAUSTED /
DEADLINE_EXCEEDED / UNAVAILABLE — slots always given back, and a client that stops reading a stream is cut
off instead of making the router buffer without bound."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

from engine.outputs import RequestOutput
from engine.request import SamplingParams
from engine.text.tokenizer import Tokenizer
from router.admission import AdmissionConfig, AdmittedBackend, DeadlineExceededError, OverloadedError, QueueTimeoutError
from router.backend import Backend, Health, ModelCard
from router.http import choice_streams as choice_run
from router.http.app import create_app
from router.routing.policy import NoWorkersError
from tests.router.http.http_harness import ServerThread, assert_error_shape


class Slow(Backend):
    """Each request yields ``n_tokens`` outputs, ``delay_s`` apart; behaviour "no_workers" refuses."""

    def __init__(self, tokenizer, n_tokens: int = 3, delay_s: float = 0.2) -> None:
        self.tokenizer = tokenizer
        self.card = ModelCard("fake", max_model_len=4096, vocab_size=tokenizer.vocab_size)
        self.n_tokens, self.delay_s = n_tokens, delay_s
        self.behaviour = "ok"
        self.started: list[str] = []
        self.closed = 0

    async def generate(self, request_id, prompt_token_ids, params) -> AsyncIterator[RequestOutput]:
        if self.behaviour == "no_workers":
            raise NoWorkersError("no decode worker to route to")
        self.started.append(request_id)
        try:
            for i in range(self.n_tokens):
                await asyncio.sleep(self.delay_s)
                last = i == self.n_tokens - 1
                yield RequestOutput(request_id, [65], "A", last, "length" if last else None,
                                    num_prompt_tokens=len(prompt_token_ids), num_output_tokens=i + 1)
        finally:
            self.closed += 1

    def health(self) -> Health:
        return Health(True)


async def drain(backend, rid, params=SamplingParams(max_tokens=3)):
    return [o async for o in backend.generate(rid, [5, 6, 7], params)]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer.from_dir(tiny_model())


async def test_slots_queue_in_order_and_overflow_is_refused(tokenizer):
    inner = Slow(tokenizer, n_tokens=2, delay_s=0.05)
    backend = AdmittedBackend(inner, AdmissionConfig(max_concurrent=2, max_queued=2))
    tasks = [asyncio.create_task(drain(backend, f"r{i}")) for i in range(4)]
    await asyncio.sleep(0.01)
    assert (backend.running, backend.queued) == (2, 2)
    with pytest.raises(OverloadedError) as e:
        await drain(backend, "r4")
    assert e.value.retry_after_s >= 1
    await asyncio.gather(*tasks)
    assert inner.started == ["r0", "r1", "r2", "r3"]  # first come, first served
    assert (backend.running, backend.queued) == (0, 0)
    assert backend.counters == {"admitted": 4, "overloaded": 1}
    from prometheus_client import CollectorRegistry, generate_latest

    from router.metrics.collector import AdmissionCollector

    registry = CollectorRegistry()
    registry.register(AdmissionCollector(backend))
    text = generate_latest(registry).decode()
    assert 'duet_admission_rejections_total{reason="overloaded"} 1.0' in text and "duet_requests_running 0.0" in text


async def test_queue_timeout_and_cancel_while_queued_give_every_slot_back(tokenizer):
    backend = AdmittedBackend(Slow(tokenizer, n_tokens=3, delay_s=0.2), AdmissionConfig(max_concurrent=1,
                                                                                         queue_timeout_s=0.1))
    first = asyncio.create_task(drain(backend, "a"))
    await asyncio.sleep(0.01)
    with pytest.raises(QueueTimeoutError):
        await drain(backend, "b")
    waiting = asyncio.create_task(drain(backend, "c"))
    await asyncio.sleep(0.02)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await first
    assert (backend.running, backend.queued) == (0, 0)
    assert len(await drain(backend, "d")) == 3  # the slot is free again


async def test_deadline_aborts_the_request(tokenizer):
    inner = Slow(tokenizer, n_tokens=10, delay_s=0.1)
    backend = AdmittedBackend(inner, AdmissionConfig(request_timeout_s=0.35))
    got = []
    with pytest.raises(DeadlineExceededError, match="deadline of 0.35 s"):
        async for out in backend.generate("slow", [1, 2], SamplingParams(max_tokens=10)):
            got.append(out)
    assert 2 <= len(got) <= 4 and inner.closed == 1 and backend.running == 0


def config_errors():
    from engine.errors import ConfigError

    for bad in (dict(max_concurrent=0), dict(max_queued=-1), dict(queue_timeout_s=0), dict(max_concurrent=True)):
        with pytest.raises(ConfigError):
            AdmissionConfig(**bad)


def test_config_is_validated():
    config_errors()


BODY = {"model": "fake", "prompt": "hello", "max_tokens": 3}


def post(url, body=BODY, **kw):
    return httpx.post(url + "/v1/completions", json=body, timeout=20, **kw)


def test_http_status_per_condition(tokenizer):
    inner = Slow(tokenizer, n_tokens=3, delay_s=0.3)
    backend = AdmittedBackend(inner, AdmissionConfig(max_concurrent=1, max_queued=1, queue_timeout_s=0.4,
                                                     request_timeout_s=5))
    with ServerThread(create_app(backend, max_request_bytes=2048)) as server:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            busy = pool.submit(post, server.url)
            time.sleep(0.1)
            queued = pool.submit(post, server.url)  # waits 0.4 s for the busy slot (0.9 s): 408
            time.sleep(0.1)
            over = post(server.url)  # the queue holds one already: 429 at once
            assert over.status_code == 429 and over.headers["Retry-After"] == "1"
            assert assert_error_shape(over.json(), "rate_limit_error")["code"] == "overloaded"
            late = queued.result()
            assert late.status_code == 408 and assert_error_shape(late.json(), "timeout_error")["code"] == "queue_timeout"
            assert busy.result().status_code == 200
        huge = post(server.url, {**BODY, "prompt": "x" * 5000})
        assert huge.status_code == 413 and assert_error_shape(huge.json())["code"] == "body_too_large"
        chunked = httpx.post(server.url + "/v1/completions", content=iter([b"{" + b" " * 3000 + b"}"]), timeout=10,
                             headers={"Content-Type": "application/json"})  # no Content-Length: counted while read
        assert chunked.status_code == 413
        inner.behaviour = "no_workers"
        down = post(server.url)
        assert down.status_code == 503 and assert_error_shape(down.json(), "server_error")["code"] == "no_workers"
        stream = post(server.url, {**BODY, "stream": True})
        assert stream.status_code == 503  # decided before the first byte, streaming or not
        inner.behaviour = "ok"
        wrong_method = httpx.get(server.url + "/v1/completions", timeout=10)
        assert wrong_method.status_code == 405 and wrong_method.headers["Allow"] == "POST"
        assert_error_shape(wrong_method.json())
    assert (backend.running, backend.queued) == (0, 0)


def test_http_deadline_before_and_during_a_stream(tokenizer):
    inner = Slow(tokenizer, n_tokens=20, delay_s=0.1)
    backend = AdmittedBackend(inner, AdmissionConfig(request_timeout_s=0.5))
    with ServerThread(create_app(backend)) as server:
        r = post(server.url, {**BODY, "max_tokens": 20})
        assert r.status_code == 504 and assert_error_shape(r.json(), "timeout_error")["code"] == "deadline_exceeded"
        with httpx.stream("POST", server.url + "/v1/completions", json={**BODY, "max_tokens": 20, "stream": True},
                          timeout=10) as s:
            assert s.status_code == 200
            events = [line.removeprefix("data: ") for line in s.iter_lines() if line]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert error["error"]["code"] == "deadline_exceeded"  # in band: the status line was already sent
    assert backend.running == 0 and inner.closed == inner.started.__len__()


def test_a_client_that_stops_reading_is_cut_off(tokenizer, monkeypatch):
    """The backend produces much faster than a stalled client reads; the router aborts the request once
    MAX_BUFFERED_OUTPUTS are waiting instead of buffering the whole generation."""
    monkeypatch.setattr(choice_run, "MAX_BUFFERED_OUTPUTS", 64)
    inner = Slow(tokenizer, n_tokens=200_000, delay_s=0)
    with ServerThread(create_app(inner)) as server:
        host, port = server.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps({**BODY, "max_tokens": 4000, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while inner.closed == 0 and time.monotonic() < deadline:  # never reading a byte
            time.sleep(0.1)
        assert inner.closed == 1, "the stalled stream was never aborted"
        sock.close()


async def test_grpc_status_per_condition(tokenizer):
    from proto.duet.v1 import generate_pb2 as pb
    from proto.duet.v1 import generate_pb2_grpc as pb_grpc
    from router.grpc.server import start_grpc_server

    inner = Slow(tokenizer, n_tokens=3, delay_s=0.3)
    backend = AdmittedBackend(inner, AdmissionConfig(max_concurrent=1, max_queued=0, request_timeout_s=2.0))
    server = await start_grpc_server(backend, "127.0.0.1", 0, max_request_bytes=4096)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.GenerateStub(channel)

            async def call(**kw):
                request = pb.GenerateRequest(text=kw.pop("prompt", "hello"), max_tokens=kw.pop("max_tokens", 3), **kw)
                return [r async for r in stub.Generate(request)]

            busy = asyncio.create_task(call())
            await asyncio.sleep(0.1)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await busy
            inner.n_tokens = 10
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call(max_tokens=10)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            inner.behaviour = "no_workers"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call(prompt="x" * 10_000)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await server.stop(1)
    assert backend.running == 0
