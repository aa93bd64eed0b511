"""The front doors over the real disaggregated cluster (issue 4, must-show 1 and 6): the official openai
client and a gRPC client built from proto/ against router -> prefill actor -> NIXL -> decode actor;
cancellation over HTTP and gRPC leaves no block behind on any worker."""
from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from tests.cluster.test_disagg_cluster import stats, wait_for
from tests.router.http.http_harness import assert_error_shape

pytestmark = pytest.mark.slow

PROMPT = "the river and the mountain met at the old stone bridge where"
DECODE_BLOCKS = 48


@pytest.fixture(scope="module")
def doors(cluster_factory, loop_thread):
    """HTTP and gRPC servers on the cluster's own event loop (the router's index lives on it)."""
    import uvicorn

    from proto.duet.v1 import generate_pb2_grpc as pb_grpc
    from router.grpc.server import start_grpc_server
    from router.http.app import create_app

    # the decode pool's KV cache holds less than the checkpoint's 1024 tokens: the served context is its 768
    cluster = cluster_factory(**{"router.local_prefill_max_tokens": 0, "prefill.num_blocks": 64,
                                 "decode.num_blocks": DECODE_BLOCKS})
    app = create_app(cluster.backend, served_model_names=[cluster.config.model_name])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    serving = asyncio.run_coroutine_threadsafe(server.serve(), loop_thread.loop)
    assert wait_for(lambda: server.started, timeout_s=20)
    port = server.servers[0].sockets[0].getsockname()[1]
    grpc_server = loop_thread.run(start_grpc_server(cluster.backend, "127.0.0.1", 0))
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}")
    yield cluster, f"http://127.0.0.1:{port}", pb_grpc.GenerateStub(channel)
    channel.close()
    loop_thread.run(grpc_server.stop(1))
    server.should_exit = True
    serving.result(20)


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = Engine(EngineConfig(model=str(tiny_model()), num_blocks=256))

    def run(ids, **params):
        return engine.generate([ids], SamplingParams(**params))[0]

    return engine, run


def test_openai_client_completions_and_chat_stream_and_not(doors, reference):
    cluster, url, _ = doors
    engine, run = reference
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    model = cluster.config.model_name
    want = run(engine.tokenizer.encode(PROMPT), max_tokens=16, temperature=0)
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    assert full.choices[0].text == want["text"]
    assert full.usage.completion_tokens == len(want["token_ids"])
    assert full.usage.prompt_tokens == len(engine.tokenizer.encode(PROMPT))
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == want["text"]

    messages = [{"role": "user", "content": "tell me about rivers"}]
    want_chat = run(engine.tokenizer.encode_chat(messages), max_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == want_chat["text"]
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for c in chunks:
        if c.choices and c.choices[0].delta.content:
            parts.append(c.choices[0].delta.content)
        usage = c.usage or usage
    assert "".join(parts) == want_chat["text"] and usage.completion_tokens == len(want_chat["token_ids"])


def test_the_served_context_is_what_every_worker_holds_and_a_chat_without_max_tokens_fills_it(doors):
    """Each worker caps its context to its KV cache (prefill: 64 blocks hold the checkpoint's 1024 tokens; decode:
    48 blocks of 16 hold 768); /v1/models serves the smallest, and a chat request without max_tokens (the rest
    of the context, as OpenAI servers do) passes through both pools to the last token."""
    cluster, url, _ = doors
    assert {c.worker_id: c.info.max_model_len for c in cluster.workers} == {"prefill-0": 1024,
                                                                            "decode-0": DECODE_BLOCKS * 16}
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = cluster.config.model_name
    assert client.models.retrieve(model).model_extra["max_model_len"] == DECODE_BLOCKS * 16
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "tell me about rivers"}],
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.total_tokens == DECODE_BLOCKS * 16


def test_grpc_streams_the_same_tokens_as_http_for_the_same_seed(doors, reference):
    from proto.duet.v1 import generate_pb2 as pb

    cluster, url, stub = doors
    engine, run = reference
    ids = engine.tokenizer.encode(PROMPT)
    want = run(ids, max_tokens=14, temperature=0.8, top_p=0.95, seed=5)
    msgs = list(stub.Generate(pb.GenerateRequest(text=PROMPT, max_tokens=14, temperature=0.8, top_p=0.95, seed=5)))
    assert [t for m in msgs for t in m.token_ids] == want["token_ids"]
    assert len(msgs) > 1 and msgs[-1].usage.completion_tokens == 14
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    http = client.completions.create(model=cluster.config.model_name, prompt=PROMPT, max_tokens=14, temperature=0.8,
                                     top_p=0.95, seed=5)
    assert http.choices[0].text == "".join(m.text for m in msgs) == want["text"]


def _idle(loop_thread, cluster) -> bool:
    return all(w["kv_blocks_used"] == 0 and w["num_requests"] == 0 for w in stats(loop_thread, cluster).values())


def test_http_client_disconnect_frees_blocks_on_prefill_and_decode(doors, loop_thread):
    cluster, url, _ = doors
    body = {"model": cluster.config.model_name, "prompt": PROMPT * 3, "max_tokens": 500, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    assert wait_for(lambda: _idle(loop_thread, cluster), timeout_s=15), stats(loop_thread, cluster)
    assert cluster.backend.counters["aborted"] >= 1


def test_grpc_cancel_frees_blocks_on_prefill_and_decode(doors, loop_thread):
    from proto.duet.v1 import generate_pb2 as pb

    cluster, _, stub = doors
    call = stub.Generate(pb.GenerateRequest(text=PROMPT * 3, max_tokens=500, ignore_eos=True, temperature=0))
    next(call)
    call.cancel()
    assert wait_for(lambda: _idle(loop_thread, cluster), timeout_s=15), stats(loop_thread, cluster)


def test_bad_input_is_a_4xx_through_the_cluster(doors):
    cluster, url, stub = doors
    model = cluster.config.model_name
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "x " * 5000, "max_tokens": 4})
    assert r.status_code == 400 and "context length" in assert_error_shape(r.json())["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    from proto.duet.v1 import generate_pb2 as pb

    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(text="hi", max_tokens=-1)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
