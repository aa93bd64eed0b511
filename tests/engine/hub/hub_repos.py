"""A local Hub (tests/engine/hub/fake_hub.py) holding tiny models, and settings that point at it with a fresh cache:
fixtures for tests/engine/hub/ (its conftest.py imports them) and tests/cluster/test_hub_serve.py.

Repositories:
- ``duet-test/tiny-llama``: two commits; the older (tag ``v1``) holds the seed-0 tiny Llama plus files duet must
  never fetch (a pickle, a README, a subfolder), ``main`` the seed-1 one;
- ``duet-test/tiny-sharded``: two safetensors shards + index, and a stray ``consolidated.safetensors``;
- ``duet-test/tiny-GGUF``: the seed-0 model as Q8_0 and F16 GGUF files (written as llama.cpp writes them) and a
  vision projector;
- ``duet-test/gated`` (gated), ``duet-test/private`` (private): the seed-0 model behind the token ``hf_good``;
- ``duet-test/pickles-only``: config, tokenizer and ``pytorch_model.bin``;
- ``duet-test/tiny-lora``: a PEFT LoRA adapter of the seed-0 model written by peft (plus a README and a pickled copy
  duet must never fetch); ``duet-test/lora-pickle``: only ``adapter_config.json`` and ``adapter_model.bin``.
"""
from __future__ import annotations

import pytest

from engine.hub.resolve import HubSettings
from tests.engine.hub.fake_hub import FakeHub
from tests.engine.loading.gguf_files import write_gguf

TOKEN = "hf_good"
LLAMA, SHARDED, GGUF = "duet-test/tiny-llama", "duet-test/tiny-sharded", "duet-test/tiny-GGUF"
GATED, PRIVATE, PICKLES = "duet-test/gated", "duet-test/private", "duet-test/pickles-only"
LORA, LORA_PICKLE = "duet-test/tiny-lora", "duet-test/lora-pickle"
JUNK = {"pytorch_model.bin": b"\x80pickle" * 100, "README.md": b"# tiny\n", "original/params.json": b"{}"}


@pytest.fixture(scope="session")
def hub_models(tiny_model, tmp_path_factory):
    """(seed-0 dir, seed-1 dir, sharded dir, {quant: gguf file}) on disk."""
    old, new = tiny_model("llama"), tiny_model("llama", seed=1)
    sharded = tiny_model("llama", num_shards=2)
    out = tmp_path_factory.mktemp("hub-gguf")
    ggufs = {q: write_gguf(old, out / f"tiny-llama-{q}.gguf", q) for q in ("Q8_0", "F16")}
    return old, new, sharded, ggufs


@pytest.fixture(scope="session")
def hub_lora(hub_models, tmp_path_factory):
    """A PEFT adapter of the seed-0 model, written by peft."""
    from tests.engine.lora.peft_saved import save_peft_adapter

    return save_peft_adapter(hub_models[0], tmp_path_factory.mktemp("hub-lora") / "lora", seed=7, std=0.3)


@pytest.fixture(scope="session")
def fake_hub(hub_models, hub_lora):
    old, new, sharded, ggufs = hub_models
    hub = FakeHub()
    hub.old = hub.add_commit(LLAMA, {"": old, **JUNK}, refs=("main", "v1"))
    hub.new = hub.add_commit(LLAMA, {"": new})
    hub.add_commit(SHARDED, {"": sharded, "consolidated.safetensors": b"stray" * 50})
    hub.add_commit(GGUF, {**{p.name: p for p in ggufs.values()}, "mmproj-tiny-llama-F16.gguf": b"GGUF" + b"\0" * 64,
                          "README.md": b"# gguf\n"})
    for repo in (GATED, PRIVATE):
        hub.add_commit(repo, {"": old})
    hub.repos[GATED].gated = hub.repos[PRIVATE].private = True
    hub.repos[GATED].tokens = hub.repos[PRIVATE].tokens = (TOKEN,)
    hub.add_commit(PICKLES, {"config.json": (old / "config.json"), "tokenizer.json": (old / "tokenizer.json"),
                             "pytorch_model.bin": b"\x80pickle"})
    hub.lora = hub.add_commit(LORA, {"": hub_lora, "README.md": b"# lora\n", "adapter_model.bin": b"\x80pickle"})
    hub.add_commit(LORA_PICKLE, {"adapter_config.json": hub_lora / "adapter_config.json",
                                 "adapter_model.bin": b"\x80pickle"})
    with hub:
        yield hub


@pytest.fixture(autouse=True)
def no_ambient_token(monkeypatch, tmp_path):
    """No token but the one a test passes: neither HF_TOKEN nor a login file of this machine."""
    from huggingface_hub import constants

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


@pytest.fixture
def settings(fake_hub, tmp_path):
    """Online against the local Hub, into an empty cache; ``fake_hub.requests`` starts empty."""
    fake_hub.requests.clear()
    return HubSettings(fake_hub.endpoint, tmp_path / "hf-cache", offline=False)
