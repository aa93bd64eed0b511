"""The LoRA resolver (router/lora_resolver.py) and LoraAdapters.resolve (router/lora_adapters.py): which names find
a directory, and the cache's rules (one load for requests naming an adapter at once; the least recently named idle
resolved adapter unloaded for room, never one loaded by name; none idle: busy). Workers here are stand-ins that
keep vLLM's max_cpu_loras limit (an additional test; tests/cluster/test_lora_serve.py runs the same on a real
cluster with peft's adapters)."""
from __future__ import annotations

import asyncio
import json
import os

import pytest

from engine.errors import (
    ConfigError,
    LoraAdapterError,
    LoraAdapterNotFoundError,
    LoraAdaptersBusyError,
    LoraCapacityError,
)
from router.lora_adapters import LoraAdapters, ServedAdapter
from router.lora_resolver import LoraResolver


def adapter_dir(path, peft_type="LORA"):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": peft_type, "r": 4}))
    return path


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "adapters"
    for name in ("a", "b", "c", "org/d"):
        adapter_dir(root / name)
    adapter_dir(root / "ia3", peft_type="IA3")
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text("{not json")
    (root / "empty").mkdir()
    adapter_dir(tmp_path / "outside")
    os.symlink(tmp_path / "outside", root / "escape")
    return root


def test_names_find_adapter_directories_and_never_paths(root, tmp_path):
    r = LoraResolver(root)
    assert r.find("a") == str(root / "a") and r.find("org/d") == str(root / "org" / "d")
    for name in ("", ".", "..", "../outside", "a/..", "org/../a", "/a", "a//b", "a b", "x" * 200, "empty",
                 "missing", "org", "escape", "a/b/c/d/e"):
        assert r.find(name) is None, name
    with pytest.raises(LoraAdapterError, match="peft_type 'IA3'"):
        r.find("ia3")
    with pytest.raises(LoraAdapterError, match="not readable JSON"):
        r.find("broken")
    with pytest.raises(ConfigError, match="not a directory"):
        LoraResolver(tmp_path / "nowhere")


def test_hub_repositories_are_allowed_by_name_or_owner(root):
    r = LoraResolver(hub_repos=["acme/sql", "tuned/*"])
    names = ("acme/sql", "acme/sql@v2", "tuned/x", "acme/other", "acme/sql:Q4_K_M", "sql", "../acme/sql")
    assert [r.find(n) for n in names] == ["acme/sql", "acme/sql@v2", "tuned/x", None, None, None, None]
    both = LoraResolver(root, hub_repos=["org/*"])
    assert both.find("org/d") == str(root / "org" / "d") and both.find("org/e") == "org/e"  # the directory first
    for bad in (["acme"], ["acme/sql@v1"], "acme/sql", [3], ["acme/sql:Q4"]):
        with pytest.raises(ConfigError, match="lora_resolver_hub_repos"):
            LoraResolver(hub_repos=bad)


class Worker:
    """A worker's three LoRA verbs with its max_cpu_loras limit; loads take a moment (others may run meanwhile)."""

    def __init__(self, worker_id: str, capacity: int) -> None:
        self.worker_id, self.capacity = worker_id, capacity
        self.held: dict[str, str] = {}
        self.loads = 0

    async def load_lora(self, name, path, pinned=False):
        await asyncio.sleep(0.01)
        if len(self.held) >= self.capacity:
            raise LoraCapacityError(f"max_cpu_loras: {len(self.held)} LoRA adapters are loaded")
        self.loads += 1
        self.held[name] = f"digest-of-{path}"
        return self.held[name]

    async def unload_lora(self, name):
        self.held.pop(name)

    async def lora_adapters(self):
        return dict(self.held)


def cache(root, capacity=3):
    workers = [Worker("prefill-0", capacity), Worker("decode-0", capacity)]
    for w in workers:
        w.held["named"] = "digest-of-named"
    adapters = LoraAdapters(lambda: workers, [ServedAdapter("named", "/named", digest="digest-of-named")],
                            LoraResolver(root))
    return adapters, workers


async def test_requests_naming_an_adapter_at_once_load_it_once(root):
    adapters, workers = cache(root)
    assert await asyncio.gather(*(adapters.resolve("org/d") for _ in range(5))) == [True] * 5
    assert [w.loads for w in workers] == [1, 1] and adapters.names() == ("named", "org/d")
    assert adapters.counters["resolved"] == 1
    assert await adapters.resolve("named") and not await adapters.resolve("nope")
    assert adapters.counters["resolve_misses"] == 1
    assert not await LoraAdapters(lambda: workers).resolve("a")  # no resolver: nothing found


async def test_the_least_recently_named_idle_resolved_adapter_makes_room(root):
    adapters, workers = cache(root, capacity=3)
    assert await adapters.resolve("a") and await adapters.resolve("b")  # full: named, a, b
    adapters.begin("a")  # a runs a request, b is idle: c takes b's place
    assert await adapters.resolve("c")
    assert adapters.names() == ("a", "c", "named") and all(set(w.held) == {"a", "c", "named"} for w in workers)
    adapters.end("a")  # a idle again, named before c: b takes a's place
    assert await adapters.resolve("b") and adapters.names() == ("b", "c", "named")
    assert adapters.counters["resolve_evictions"] == 2
    # an admin's load makes room the same way; a named adapter is never unloaded for room
    await adapters.load("admin", str(root / "a"))
    assert adapters.names() == ("admin", "b", "named")  # c: named before b
    adapters.begin("b")
    with pytest.raises(LoraAdaptersBusyError, match="cannot be loaded now"):
        await adapters.resolve("org/d")
    assert "named" in adapters.served and "admin" in adapters.served and "org/d" not in adapters.served
    assert adapters.counters["resolve_busy"] == 1 and all("org/d" not in w.held for w in workers)


async def test_a_directory_that_is_no_adapter_is_refused_and_counted(root):
    adapters, workers = cache(root)
    with pytest.raises(LoraAdapterError, match="IA3"):
        await adapters.resolve("ia3")
    assert adapters.counters["resolve_failures"] == 1 and [w.loads for w in workers] == [0, 0]


async def test_a_request_whose_adapter_was_unloaded_for_room_resolves_it_again_at_admission(root):
    """Checked at the front door, then queued for admission while other requests' adapters took its place: admitted,
    it loads its adapter again instead of a 404; a name no one serves or resolves is still the 404."""
    adapters, workers = cache(root, capacity=2)  # named + one resolved
    assert await adapters.resolve("a")
    assert await adapters.resolve("b") and "a" not in adapters.served  # a unloaded for b
    await adapters.admit("a")
    assert adapters.inflight["a"] == 1 and "b" not in adapters.served and all("a" in w.held for w in workers)
    adapters.end("a")
    with pytest.raises(LoraAdapterNotFoundError):
        await adapters.admit("nope")
    await adapters.admit(None)  # the base model: nothing to do
