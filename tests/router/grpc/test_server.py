"""The gRPC front door end to end: a real grpc.aio server on 127.0.0.1 over LocalBackend (tiny llama),
clients built from the generated stubs. Backend failure modes use a scripted fake backend (no model)."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.local_backend import LocalBackend
from engine.config import EngineConfig
from engine.engine import Engine
from engine.outputs import RequestOutput
from engine.request import SamplingParams

# generated code: importing router.grpc.server above builds it when missing, so these come after it
from proto.duet.v1 import generate_pb2 as pb  # noqa: E402,I001
from proto.duet.v1 import generate_pb2_grpc as pb_grpc
from router.backend import Backend, Health, ModelCard
from router.grpc.server import SERVICE_NAME, start_grpc_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT_IDS = [1, 17, 42, 99, 123, 7, 300, 5]
MODEL_ID = "tiny-llama"
API_KEY = "sesame"


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    """A separate engine on the same checkpoint: what the server's tokens must equal."""
    engine = Engine(EngineConfig(model=str(model_dir), num_blocks=64))

    def run(ids, **params):
        return engine.generate([ids], SamplingParams(**params))[0]

    return run


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(model_dir):
    b = LocalBackend(Engine(EngineConfig(model=str(model_dir), num_blocks=128)), model_id=MODEL_ID)
    yield b
    await b.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(backend):
    s = await start_grpc_server(backend, "127.0.0.1", 0)
    yield s
    await s.stop(None)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def channel(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


@pytest.fixture
def stub(channel):
    return pb_grpc.GenerateStub(channel)


def token_request(ids=PROMPT_IDS, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), **fields)


async def collect(stub, request: pb.GenerateRequest, **call_kw) -> list[pb.GenerateResponse]:
    return [m async for m in stub.Generate(request, **call_kw)]


def tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


async def wait_until_idle(backend: LocalBackend, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    engine = backend.engine
    while engine.scheduler.running or engine.pool.num_used_blocks:
        assert time.monotonic() < deadline, (len(engine.scheduler.running), engine.pool.num_used_blocks)
        await asyncio.sleep(0.02)
    engine.pool.check()


# ---- generation --------------------------------------------------------------------------------------

async def test_greedy_stream_matches_direct_engine(stub, reference):
    msgs = await collect(stub, token_request(max_tokens=12, temperature=0, ignore_eos=True))
    want = reference(PROMPT_IDS, max_tokens=12, temperature=0, ignore_eos=True)
    assert tokens(msgs) == want["token_ids"]
    assert "".join(m.text for m in msgs) == want["text"]
    assert msgs[-1].finish_reason == want["finish_reason"] == "length"
    assert len(msgs) > 1  # streamed, not batched into one message


async def test_usage_and_finish_reason_on_last_message_only(stub):
    msgs = await collect(stub, token_request(max_tokens=5, temperature=0, ignore_eos=True, request_id="mine-1"))
    *body, last = msgs
    assert all(not m.HasField("usage") and not m.HasField("finish_reason") for m in body)
    assert last.usage == pb.Usage(prompt_tokens=len(PROMPT_IDS), completion_tokens=5,
                                  cached_tokens=last.usage.cached_tokens)
    assert {m.request_id for m in msgs} == {"mine-1"}


async def test_same_seed_same_tokens(stub):
    req = token_request(max_tokens=16, temperature=0.9, seed=1234, ignore_eos=True)
    first, second = await collect(stub, req), await collect(stub, req)
    assert tokens(first) == tokens(second) and len(tokens(first)) == 16


async def test_text_and_chat_prompts_are_tokenized_like_the_engine(stub, backend, reference):
    tok = backend.tokenizer
    text_msgs = await collect(stub, pb.GenerateRequest(text="def f(x): return", max_tokens=6, temperature=0))
    ids = tok.encode("def f(x): return")
    assert text_msgs[-1].usage.prompt_tokens == len(ids)
    assert tokens(text_msgs) == reference(ids, max_tokens=6, temperature=0)["token_ids"]

    chat = [pb.ChatMessage(role="system", content="be brief"), pb.ChatMessage(role="user", content="hello")]
    chat_msgs = await collect(stub, pb.GenerateRequest(chat=pb.ChatMessages(messages=chat), max_tokens=6,
                                                       temperature=0))
    chat_ids = tok.encode_chat([{"role": m.role, "content": m.content} for m in chat])
    assert chat_msgs[-1].usage.prompt_tokens == len(chat_ids)
    assert tokens(chat_msgs) == reference(chat_ids, max_tokens=6, temperature=0)["token_ids"]


async def test_logprobs_when_asked(stub):
    msgs = await collect(stub, token_request(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3))
    for m in msgs:
        assert len(m.logprobs) == len(m.top_logprobs) == len(m.token_ids)
        for t, lp, top in zip(m.token_ids, m.logprobs, m.top_logprobs):
            lps = [e.logprob for e in top.entries]
            assert len(lps) == 3 and lps == sorted(lps, reverse=True)
            assert top.entries[0].token_id == t and lp == pytest.approx(lps[0])  # greedy picks the top
    chosen_only = await collect(stub, token_request(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0))
    assert sum(len(m.logprobs) for m in chosen_only) == 3 and not any(m.top_logprobs for m in chosen_only)
    plain = await collect(stub, token_request(max_tokens=3, temperature=0, ignore_eos=True))
    assert not any(m.logprobs or m.top_logprobs for m in plain)


async def test_stop_token_id_is_reported(stub):
    free = tokens(await collect(stub, token_request(max_tokens=8, temperature=0, ignore_eos=True)))
    stop_id = free[3]
    msgs = await collect(stub, token_request(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]))
    got = tokens(msgs)
    assert got == free[: free.index(stop_id) + 1]
    assert msgs[-1].finish_reason == "stop" and msgs[-1].stop_token_id == stop_id


async def test_list_models(stub, backend):
    resp = await stub.ListModels(pb.ListModelsRequest())
    assert [(m.id, m.max_model_len, m.vocab_size) for m in resp.models] == [
        (MODEL_ID, backend.card.max_model_len, backend.card.vocab_size)]


# ---- errors ------------------------------------------------------------------------------------------

BAD_REQUESTS = {
    "empty text": (pb.GenerateRequest(text=""), "empty"),
    "no prompt": (pb.GenerateRequest(max_tokens=4), "no prompt"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), "empty"),
    "empty chat": (pb.GenerateRequest(chat=pb.ChatMessages()), "empty list of messages"),
    "unknown model": (token_request(model="gpt-9"), "unknown model"),
    "over context": (token_request(max_tokens=1020), "maximum context length"),
    "max_tokens 0": (token_request(max_tokens=0), "max_tokens"),
    "max_tokens < 0": (token_request(max_tokens=-3), "max_tokens"),
    "temperature < 0": (token_request(temperature=-0.5), "temperature"),
    "temperature nan": (token_request(temperature=float("nan")), "temperature"),
    "top_p 0": (token_request(top_p=0), "top_p"),
    "top_k < 0": (token_request(top_k=-1), "top_k"),
    "logprobs 21": (token_request(logprobs=21), "logprobs"),
    "min_tokens > max": (token_request(max_tokens=2, min_tokens=3), "min_tokens"),
    "token out of range": (token_request(ids=[1, 2, 10**6]), "out of range"),
    "empty stop string": (token_request(stop=[""]), "stop"),
    "long request id": (token_request(request_id="x" * 300), "request_id"),
    "empty cache_salt": (token_request(cache_salt=""), "cache_salt"),
    "long cache_salt": (token_request(cache_salt="x" * 257), "cache_salt"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
async def test_bad_requests_are_invalid_argument(stub, name):
    request, fragment = BAD_REQUESTS[name]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert fragment in err.value.details()


async def test_request_id_in_use_is_invalid_argument(stub, backend):
    first = stub.Generate(token_request(max_tokens=500, ignore_eos=True, request_id="dup"))
    await first.read()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, token_request(max_tokens=2, request_id="dup"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "in use" in err.value.details()
    first.cancel()
    await wait_until_idle(backend)


# ---- cancellation ------------------------------------------------------------------------------------

async def test_cancel_aborts_request_and_frees_blocks(stub, backend):
    call = stub.Generate(token_request(max_tokens=900, ignore_eos=True, temperature=0))
    first = await call.read()
    assert first.token_ids
    assert backend.engine.scheduler.running  # still generating when we hang up
    call.cancel()
    await wait_until_idle(backend)


async def test_deadline_aborts_request_and_frees_blocks(stub, backend):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, token_request(max_tokens=900, ignore_eos=True), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until_idle(backend)


# ---- health, reflection, auth -----------------------------------------------------------------------

async def test_health_serving(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_generate_service(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    replies = [r async for r in call]
    names = {s.name for s in replies[0].list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


async def test_api_keys(backend):
    server = await start_grpc_server(backend, "127.0.0.1", 0, api_keys=(API_KEY, "other"))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb_grpc.GenerateStub(ch)
            for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", API_KEY),)]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(stub, token_request(max_tokens=2), metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ListModels(pb.ListModelsRequest(), metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            good = (("authorization", f"Bearer {API_KEY}"),)
            msgs = await collect(stub, token_request(max_tokens=2, ignore_eos=True), metadata=good)
            assert len(tokens(msgs)) == 2
            assert (await stub.ListModels(pb.ListModelsRequest(), metadata=good)).models[0].id == MODEL_ID
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())  # no key
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)


# ---- tenant isolation ----------------------------------------------------------------------------------

SALT_KEYS = ("key-a", "key-b")


async def cached_and_tokens(stub, ids, metadata=(), **fields) -> tuple[int, list[int]]:
    msgs = await collect(stub, token_request(ids, max_tokens=3, temperature=0, ignore_eos=True, **fields),
                         metadata=metadata)
    return msgs[-1].usage.cached_tokens, tokens(msgs)


async def test_cache_salt_confines_prefix_hits(stub):
    ids = list(range(400, 450))  # 3 full blocks, sent by no other test
    cached, want = await cached_and_tokens(stub, ids, cache_salt="a")
    assert cached == 0
    assert await cached_and_tokens(stub, ids, cache_salt="a") == (48, want)
    assert await cached_and_tokens(stub, ids, cache_salt="b") == (0, want)
    assert await cached_and_tokens(stub, ids) == (0, want)


async def test_salt_by_api_key_makes_each_key_a_cache_domain(backend):
    with pytest.raises(ValueError, match="salt_by_api_key needs api_keys"):
        await start_grpc_server(backend, "127.0.0.1", 0, salt_by_api_key=True)
    server = await start_grpc_server(backend, "127.0.0.1", 0, api_keys=SALT_KEYS, salt_by_api_key=True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb_grpc.GenerateStub(ch)
            a, b = [(("authorization", f"Bearer {k}"),) for k in SALT_KEYS]
            ids = list(range(450, 500))
            cached, want = await cached_and_tokens(stub, ids, a)
            assert cached == 0
            assert await cached_and_tokens(stub, ids, a) == (48, want)
            assert await cached_and_tokens(stub, ids, b) == (0, want)
            assert await cached_and_tokens(stub, ids, b, cache_salt="s") == (0, want)  # both salts apply
            assert await cached_and_tokens(stub, ids, a, cache_salt="s") == (0, want)
            assert await cached_and_tokens(stub, ids, b, cache_salt="s") == (48, want)
    finally:
        await server.stop(None)


# ---- backend failure modes (scripted backend, no model) ---------------------------------------------

class ScriptedBackend(Backend):
    """Yields `script` for every request; raises it instead when it is an exception."""

    def __init__(self, script) -> None:
        self.card = ModelCard(model_id="scripted", max_model_len=64, vocab_size=100)
        self.tokenizer = None
        self.script = script
        self.ok = True

    async def generate(self, request_id, prompt_token_ids, params):
        if isinstance(self.script, Exception):
            raise self.script
        for out in self.script:
            yield out

    def health(self) -> Health:
        return Health(ok=self.ok)


async def _call_scripted(backend: ScriptedBackend) -> tuple[list, grpc.aio.AioRpcError]:
    server = await start_grpc_server(backend, "127.0.0.1", 0)
    got: list = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for m in pb_grpc.GenerateStub(ch).Generate(token_request(ids=[1, 2])):
                    got.append(m)
    finally:
        await server.stop(None)
    return got, err.value


async def test_backend_error_mid_stream_is_unavailable():
    script = [RequestOutput("r", [5], "a", False),
              RequestOutput("r", [], "", True, finish_reason="error", error="decode worker lost")]
    got, err = await _call_scripted(ScriptedBackend(script))
    assert tokens(got) == [5]  # what was streamed before the failure arrives
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "decode worker lost" in err.details()


async def test_backend_exception_is_internal():
    got, err = await _call_scripted(ScriptedBackend(RuntimeError("boom")))
    assert not got and err.code() == grpc.StatusCode.INTERNAL and "boom" in err.details()


async def test_health_follows_backend_and_shutdown():
    backend = ScriptedBackend([])
    server = await start_grpc_server(backend, "127.0.0.1", 0, health_interval_s=0.05)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            backend.ok = False
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            backend.ok = True
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            stopping = asyncio.create_task(server.stop(1.0))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            await stopping
    finally:
        await server.stop(None)
