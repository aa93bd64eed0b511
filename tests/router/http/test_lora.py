"""LoRA adapters through the OpenAI front door (LocalBackend on a tiny Llama): /v1/models lists each adapter with
its base as ``parent``; a request naming an adapter in ``model`` runs with it (the engine's own output with that
adapter, which tests/engine/lora/test_lora_engine.py holds equal to transformers + peft); the base name runs the
base model."""
from __future__ import annotations

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
