"""LoRA adapters named by Hub id (issue 50: PEFT adapter directories, "Hub ids too"), against the local Hub
(tests/engine/hub/fake_hub.py): the launcher / router pins ``org/name`` to its commit fetching exactly the adapter's two
files (never its pickle or README), a worker reads the pinned id from the cache without a request, an engine loads
the same bytes (the same digest) as from the directory the repository was made from and answers the same, and each
refusal names why. Through a cluster: tests/cluster/test_hub_serve.py."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from engine.config import EngineConfig
from engine.errors import LoraAdapterError, ModelLoadError
from engine.hub import resolve as hub_resolve
from engine.hub.files import select_adapter_files
from engine.hub.resolve import pin_adapter, pin_engine_config, resolve_adapter
from engine.lora.adapter import load_adapter
from tests.engine.hub.hub_repos import LLAMA, LORA, LORA_PICKLE


def test_pinning_fetches_the_two_adapter_files_once(fake_hub, settings, hub_lora):
    pinned = pin_adapter(LORA, settings)
    assert pinned == f"{LORA}@{fake_hub.lora}"
    assert sorted(fake_hub.files_requested(LORA)) == ["adapter_config.json", "adapter_model.safetensors"]
    fake_hub.requests.clear()
    snapshot = resolve_adapter(pinned, settings)  # a worker: the pinned commit, complete in the cache
    assert fake_hub.requests == []
    assert (snapshot / "adapter_model.safetensors").read_bytes() == (hub_lora / "adapter_model.safetensors").read_bytes()
    assert resolve_adapter(str(hub_lora), settings) == hub_lora  # an existing path is that path


def test_an_engine_loads_a_hub_adapter_as_its_directory(fake_hub, settings, hub_lora, hub_models, monkeypatch):
    monkeypatch.setattr(hub_resolve.HubSettings, "from_env", classmethod(lambda cls: settings))
    from_hub, from_dir = load_adapter("a", pin_adapter(LORA, settings)), load_adapter("a", hub_lora)
    assert from_hub.digest == from_dir.digest and from_hub.rank == from_dir.rank
    config = EngineConfig(model=str(hub_models[0]), lora_modules={"a": LORA}, num_blocks=32)
    pinned = pin_engine_config(config, settings)
    assert pinned.lora_modules == (("a", f"{LORA}@{fake_hub.lora}"),)

    from engine.engine import Engine
    from engine.request import SamplingParams

    def greedy(cfg):
        engine = Engine(cfg)
        out = engine.generate([[5, 9, 13, 2, 40, 7]], SamplingParams(max_tokens=8, temperature=0, lora="a",
                                                                    ignore_eos=True))
        return out[0]["token_ids"]

    assert greedy(pinned) == greedy(dataclasses.replace(config, lora_modules={"a": str(hub_lora)}))


def test_adapter_refusals_name_what_is_wrong(fake_hub, settings):
    with pytest.raises(ModelLoadError, match="no adapter_model.safetensors at the top of the repository: not a PEFT "
                                             "LoRA adapter duet reads; its pickled weights .*adapter_model.bin"):
        pin_adapter(LORA_PICKLE, settings)
    with pytest.raises(ModelLoadError, match="no adapter_config.json or adapter_model.safetensors"):
        pin_adapter(LLAMA, settings)  # a model, not an adapter
    with pytest.raises(ModelLoadError, match="without a quantization or file"):
        select_adapter_files(["adapter_config.json"], "Q8_0", "x@main")
    with pytest.raises(ModelLoadError, match="no such model repository"):
        pin_adapter("duet-test/no-such-adapter", settings)


def test_the_router_pins_a_hub_adapter_before_any_worker_loads_it(fake_hub, settings, monkeypatch):
    from router.lora_adapters import LoraAdapters

    monkeypatch.setattr(hub_resolve.HubSettings, "from_env", classmethod(lambda cls: settings))

    class Target:
        worker_id = "w0"

        def __init__(self):
            self.paths = []

        async def load_lora(self, name, path, pinned=False):
            self.paths.append(path)
            return "digest"

        async def unload_lora(self, name):
            pass

    target = Target()
    adapters = LoraAdapters(lambda: [target])
    served = asyncio.run(adapters.load("a", LORA))
    assert target.paths == [f"{LORA}@{fake_hub.lora}"] and served.path == target.paths[0]
    with pytest.raises(LoraAdapterError, match="duet-test/no-such-adapter: .*no such model repository"):
        asyncio.run(adapters.load("b", "duet-test/no-such-adapter"))
    assert target.paths == [f"{LORA}@{fake_hub.lora}"]  # the failed pin asked no worker


def test_a_resolver_loads_an_allowed_hub_adapter_on_first_use(fake_hub, settings, hub_lora, hub_models, monkeypatch):
    """``--lora-resolver-hub-repos duet-test/*``: a request naming the Hub adapter loads it pinned to its commit and
    runs with it as with its directory; a repository outside the list is not looked up (404); one inside it that is
    no adapter is refused naming why (400)."""
    monkeypatch.setattr(hub_resolve.HubSettings, "from_env", classmethod(lambda cls: settings))
    from cluster.local_backend import LocalBackend
    from engine.engine import Engine
    from engine.request import SamplingParams
    from router.lora_resolver import LoraResolver

    prompt, params = [5, 9, 13, 2, 40, 7], SamplingParams(max_tokens=8, temperature=0, lora=LORA, ignore_eos=True)
    want = Engine(EngineConfig(model=str(hub_models[0]), num_blocks=32, lora_modules={LORA: str(hub_lora)})).generate(
        [prompt], params)[0]["token_ids"]
    backend = LocalBackend(Engine(EngineConfig(model=str(hub_models[0]), num_blocks=32, max_loras=1)), "tiny",
                           LoraResolver(hub_repos=["duet-test/*"]))

    async def first_use() -> list[int]:
        assert not await backend.lora.resolve("elsewhere/tiny-lora")
        assert fake_hub.requests == []  # not asked
        assert await backend.lora.resolve(LORA) and backend.lora_adapters() == (LORA,)
        assert backend.lora.served[LORA].path == f"{LORA}@{fake_hub.lora}"
        with pytest.raises(LoraAdapterError, match="no adapter_config.json or adapter_model.safetensors"):
            await backend.lora.resolve(LLAMA)
        return [t async for out in backend.generate("r", prompt, params) for t in out.new_token_ids]

    try:
        assert asyncio.run(first_use()) == want
    finally:
        backend.async_engine.shutdown()
    assert backend.lora.counters["resolved"] == 1 and backend.lora.counters["resolve_failures"] == 1
