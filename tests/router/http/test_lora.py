"""LoRA adapters through the OpenAI front door (LocalBackend on a tiny Llama): /v1/models lists each adapter with
its base as ``parent``; a request naming an adapter in ``model`` runs with it (the engine's own output with that
adapter, which tests/engine/lora/test_lora_engine.py holds equal to transformers + peft); the base name runs the
base model. At run time (vLLM's endpoints, admin key): an adapter loads, serves and unloads; an unload waits for the
adapter's running request and refuses new ones from the moment it arrives."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from cluster.local_backend import LocalBackend
from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from router.http.app import create_app
from tests.engine.lora.peft_saved import save_peft_adapter
from tests.router.http.http_harness import ServerThread

PROMPT = [5, 9, 77, 130, 41, 300, 12]
N = 12


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    model = tiny_model("llama")
    adapters = {f"ad{i}": str(save_peft_adapter(model, tmp_path_factory.mktemp(f"ad{i}"), seed=i + 1))
                for i in range(2)}
    config = EngineConfig(model=str(model), num_blocks=128, lora_modules=adapters)
    backend = LocalBackend(Engine(config), model_id="tiny")
    reference = Engine(config)
    try:
        with ServerThread(create_app(backend)) as server, httpx.Client(timeout=30) as http:
            yield server.url, http, reference
    finally:
        backend.async_engine.shutdown()


def test_models_lists_adapters_with_parent(served):
    url, http, _ = served
    data = http.get(url + "/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [("tiny", None), ("ad0", "tiny"), ("ad1", "tiny")]
    assert http.get(url + "/v1/models/ad1").json()["parent"] == "tiny"


def test_model_field_names_the_adapter(served):
    url, http, reference = served
    outs = {}
    for model in ("tiny", "ad0", "ad1"):
        r = http.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": N,
                                                      "temperature": 0, "ignore_eos": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        outs[model] = r.json()["choices"][0]["logprobs"]["tokens"]
        [want] = reference.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0, ignore_eos=True,
                                                             lora=None if model == "tiny" else model))
        assert [reference.tokenizer.decode([t]) for t in want["token_ids"]] == outs[model], model
    assert len({tuple(v) for v in outs.values()}) == 3  # base and both adapters differ
    assert http.post(url + "/v1/completions", json={"model": "ad9", "prompt": PROMPT}).status_code == 404


@pytest.fixture(scope="module")
def runtime(tiny_model, tmp_path_factory):
    """A colocated server started with no adapter (one device slot, two in host memory) and an admin key."""
    model = tiny_model("llama")
    paths = {f"rt{i}": str(save_peft_adapter(model, tmp_path_factory.mktemp(f"rt{i}"), seed=20 + i, std=0.3))
             for i in range(3)}
    backend = LocalBackend(Engine(EngineConfig(model=str(model), num_blocks=128, max_loras=1, max_cpu_loras=2)),
                           model_id="tiny")
    reference = Engine(EngineConfig(model=str(model), num_blocks=128, lora_modules=paths))
    try:
        with ServerThread(create_app(backend, admin_key="adm")) as server, httpx.Client(timeout=60) as http:
            yield server.url, http, backend, reference, paths
    finally:
        backend.async_engine.shutdown()


ADMIN = {"Authorization": "Bearer adm"}


def _complete(http, url, model, max_tokens=N, **extra):
    return http.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True, **extra})


def test_load_over_http_is_vllms_and_admin_only(runtime):
    url, http, backend, reference, paths = runtime

    def load(body, headers=ADMIN):
        return http.post(url + "/v1/load_lora_adapter", json=body, headers=headers)

    body = {"lora_name": "rt0", "lora_path": paths["rt0"]}
    assert load(body, {}).status_code == 401
    assert load(body, {"Authorization": "Bearer nope"}).status_code == 403
    r = load({"lora_name": "rt0"})
    assert r.status_code == 400 and "'lora_name' and 'lora_path' must be provided" in r.json()["error"]["message"]
    assert load({**body, "load_inplace": True}).json()["error"]["param"] == "load_inplace"
    assert load({"lora_name": "rt9", "lora_path": "/no/such/dir"}).status_code == 404
    r = load(body)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'rt0' added successfully.")
    assert [(m["id"], m.get("parent")) for m in http.get(url + "/v1/models").json()["data"]] == [
        ("tiny", None), ("rt0", "tiny")]
    r = load(body)
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    got = _complete(http, url, "rt0", logprobs=0).json()["choices"][0]["logprobs"]["tokens"]
    [want] = reference.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, lora="rt0"))
    assert [reference.tokenizer.decode([t]) for t in want["token_ids"]] == got
    assert load({"lora_name": "rt1", "lora_path": paths["rt1"]}).status_code == 200
    r = load({"lora_name": "rt2", "lora_path": paths["rt2"]})
    assert r.status_code == 400 and "max_cpu_loras: 2 LoRA adapters are loaded" in r.json()["error"]["message"]
    assert _complete(http, url, "rt1").status_code == 200  # the one slot: rt0 evicted for rt1
    assert backend.engine.runner.lora.slots.num_evictions >= 1


def test_unload_waits_for_running_requests_and_refuses_new_ones(runtime):
    url, http, backend, _, paths = runtime
    unload = lambda name, headers=ADMIN: http.post(url + "/v1/unload_lora_adapter",  # noqa: E731
                                                   json={"lora_name": name}, headers=headers)
    assert unload("rt1", {}).status_code == 401
    assert unload("nothing-here").status_code == 404
    before = _complete(http, url, "rt1", max_tokens=400).json()["choices"][0]["text"]
    events, done = [], {}

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": "rt1", "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))

    def unloading() -> None:
        done["status"] = unload("rt1").status_code

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert wait_until(lambda: events)
    unloader = threading.Thread(target=unloading)
    unloader.start()
    assert wait_until(lambda: "rt1" not in [m["id"] for m in http.get(url + "/v1/models").json()["data"]])
    seen, pending = len(events), unloader.is_alive()  # the name is gone, the stream goes on, the unload waits
    r = _complete(http, url, "rt1")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    streamer.join(60)
    unloader.join(60)
    assert pending and seen < len(events) and done["status"] == 200
    assert "".join(e["choices"][0]["text"] for e in events) == before  # nothing cut
    assert backend.engine.runner.lora.names() == ["rt0"]
    assert http.post(url + "/v1/load_lora_adapter", headers=ADMIN,  # the name again, other bytes: refused
                     json={"lora_name": "rt1", "lora_path": paths["rt2"]}).status_code == 400


def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False
