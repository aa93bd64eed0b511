"""Placement of a LoRA adapter's request by the workers' slot budgets (router/routing/lora_slots.py), and the
router routing by it (ClusterBackend with scripted workers; the real cluster: tests/cluster/test_lora_serve.py)."""
from __future__ import annotations

from engine.request import SamplingParams
from router.lora_adapters import ServedAdapter
from router.routing.lora_slots import ready, ready_workers
from tests.router.dispatch.test_cluster_backend import Script, collect

B = 4


def lora(slots=(), running=(), pinned=(), max_loras=2):
    return {"max_loras": max_loras, "slots": {a: i for i, a in enumerate(slots)}, "running_adapters": list(running),
            "pinned": list(pinned), "waiting_adapters": []}


def test_a_worker_is_ready_when_the_adapter_holds_a_slot_or_a_slot_can_be_given_up():
    assert ready(lora(slots=["a", "b"], running=["a", "b"]), "a")  # in its slot (running): no wait
    assert ready(lora(slots=["b", "c"], running=["b"]), "a")  # c's slot is idle: evictable
    assert not ready(lora(slots=["b", "c"], running=["b", "c"]), "a")  # both slots held by running requests
    assert not ready(lora(slots=["b", "c"], running=["b"], pinned=["c"]), "a")  # a pinned slot never frees
    assert ready(lora(slots=["c"], pinned=["c"], max_loras=2), "a")  # one slot still free
    assert ready(None, "a") and ready({}, "a")  # no stats yet (a worker just joined): not held against it


def test_ready_workers_keeps_the_ready_ones_else_all():
    busy, free = {"lora": lora(slots=["b", "c"], running=["b", "c"])}, {"lora": lora(slots=["b"], running=["b"])}
    assert ready_workers({"w0": busy, "w1": free, "w2": {}}, "a") == (["w1", "w2"], "ready")
    assert ready_workers({"w0": busy, "w1": busy}, "a") == (["w0", "w1"], "all_busy")
    assert ready_workers({"w0": busy}, None) == (["w0"], None)


async def test_the_router_sends_an_adapter_to_a_worker_whose_slots_can_run_it():
    """d0 holds the adapter's prompt in its cache, so the cache-aware policy picks it whenever it may; with d0's
    slots all held by other adapters' running requests the request goes to d1, which can run it now."""
    from engine.kv.events import BlockStored
    from engine.kv.hashing import BlockHasher
    from router.backend import ModelCard
    from router.dispatch.cluster_backend import ClusterBackend
    from router.routing.policy import Role

    decode = [Script(f"d{i}", Role.DECODE) for i in range(2)]
    backend = ClusterBackend(ModelCard("m", 1024, 100), tokenizer=None, hasher=BlockHasher(B), prefill=[],
                             decode=decode, lora_modules=[ServedAdapter("a", "/x")])
    prompt, params = list(range(1, 17)), SamplingParams(max_tokens=1, lora="a")
    backend.index.apply(BlockStored("d0", tuple(BlockHasher(B)(prompt, params.hash_salt)), None))
    backend.registry.update_stats("d1", {"lora": lora(slots=["b"], running=["b"])}, 0.0)
    await collect(backend.generate("cached", prompt, params))
    assert decode[0].calls == [("generate", "cached")]  # both can run it: the cache decides
    backend.registry.update_stats("d0", {"lora": lora(slots=["b", "c"], running=["b", "c"])}, 0.0)
    await collect(backend.generate("placed", prompt, params))
    assert decode[1].calls == [("generate", "placed")]  # d0's slots are all held: d1 runs it now
    assert backend.counters["lora_ready"] == 2
    backend.registry.update_stats("d1", {"lora": lora(slots=["b", "c"], running=["b", "c"])}, 0.0)
    await collect(backend.generate("waits", prompt, params))
    assert decode[0].calls[-1] == ("generate", "waits")  # no worker can: the policy's choice, it waits there
    assert backend.counters["lora_all_busy"] == 1
    await collect(backend.generate("base", prompt, SamplingParams(max_tokens=1)))
    assert backend.counters["lora_ready"] + backend.counters["lora_all_busy"] == 3  # the base model is not counted
