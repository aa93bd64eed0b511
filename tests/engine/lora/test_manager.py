"""More adapters than device slots (engine/lora/manager.py): with ``max_loras`` 1 and three adapters loaded (host
memory, ``max_cpu_loras`` 3), requests of all three sent together all finish, each with exactly the tokens of an
engine that holds every adapter in its own slot (itself held equal to transformers + peft in test_lora_engine.py);
no step ever runs two adapters; the slot is rewritten as the batch changes adapter (evictions counted). A pinned
adapter never leaves its slot while the others take turns in the remaining one."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import LoraAdapterError
from engine.request import SamplingParams
from tests.engine.lora.peft_saved import save_peft_adapter

NUM_TOKENS = 10


@pytest.fixture(scope="module")
def three(tiny_model, tmp_path_factory):
    model = tiny_model("llama")
    adapters = {f"ad{i}": str(save_peft_adapter(model, tmp_path_factory.mktemp(f"ad{i}"), seed=10 + i, std=0.3))
                for i in range(3)}
    return model, adapters


def _serve(engine: Engine, jobs, watch=None):
    """Run ``jobs`` ((prompt, adapter) pairs) together; tokens per job. ``watch(engine)`` after every step."""
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, lora=lora)).request_id for p, lora in jobs]
    tokens = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if watch is not None:
            watch(engine)
    return [tokens[i] for i in ids]


def _jobs():
    return [(list(range(3 + i, 40 + 3 * i)), f"ad{i % 3}" if i % 4 else None) for i in range(8)]


def test_one_slot_serves_three_adapters_in_turns(three):
    model, adapters = three
    want = _serve(Engine(EngineConfig(model=str(model), num_blocks=256, lora_modules=adapters)), _jobs())
    engine = Engine(EngineConfig(model=str(model), num_blocks=256, lora_modules=adapters, max_loras=1))
    manager = engine.runner.lora
    assert (manager.max_loras, manager.max_cpu_loras, manager.names()) == (1, 3, ["ad0", "ad1", "ad2"])
    assert manager.slots.slot_of == {"ad0": 0}  # the first one found the free slot at load
    mixes = []

    def watch(e: Engine) -> None:
        running = {r.params.lora for r in e.scheduler.running} - {None}
        mixes.append(len(running))
        assert {n for n, c in e.runner.lora.slots.refs.items() if c} == running  # held == running adapters
        stats = e.lora_stats()
        assert stats["running_adapters"] == sorted(running)

    got = _serve(engine, _jobs(), watch)
    assert got == want
    assert max(mixes) == 1  # never two adapters in one batch
    info = engine.lora_stats()
    assert info["evictions"] >= 2 and info["slot_writes"] == info["evictions"] + 1
    assert info["running_adapters"] == info["waiting_adapters"] == []


def test_pinned_adapter_keeps_its_slot(three):
    model, adapters = three
    want = _serve(Engine(EngineConfig(model=str(model), num_blocks=256, lora_modules=adapters)), _jobs())
    engine = Engine(EngineConfig(model=str(model), num_blocks=256, lora_modules=adapters, max_loras=2, max_cpu_loras=4,
                                 pinned_loras=["ad1"]))
    manager = engine.runner.lora
    pinned_slot = manager.slots.slot_of["ad1"]

    def watch(e: Engine) -> None:
        assert e.runner.lora.slots.slot_of.get("ad1") == pinned_slot

    assert _serve(engine, _jobs(), watch) == want
    assert manager.slots.num_evictions >= 2  # ad0 and ad2 took turns in the other slot
    assert manager.info()["pinned"] == ["ad1"]
    with pytest.raises(LoraAdapterError, match="cannot pin LoRA adapter 'x': 1 of 2 slots are pinned and"):
        engine.load_lora("x", adapters["ad0"], pinned=True)
    engine.unload_lora("ad2")
    engine.unload_lora("ad0")
    engine.load_lora("solo", adapters["ad0"], pinned=True)  # every adapter pinned: no slot left is fine
    with pytest.raises(LoraAdapterError, match="every one of the 2 LoRA slots is pinned"):
        engine.load_lora("ad2", adapters["ad2"])


def test_a_stream_on_the_held_adapter_does_not_starve_another(three):
    """One slot, max_num_seqs 4: ad0's requests keep arriving (one more every step) while an ad1 request waits. Under
    vLLM's rule alone ad1 would wait as long as ad0's stream lasts (each admitted ad0 request extends ad0's hold);
    passed over by a batch's worth (4), it reserves the slot: ad0's running requests end, ad1 runs, with the tokens
    of an engine that serves it alone (engine/sched/lora_pass.py)."""
    model, adapters = three

    def params(lora):
        return SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, lora=lora)

    engine = Engine(EngineConfig(model=str(model), num_blocks=256, lora_modules=adapters, max_loras=1,
                                 max_num_seqs=4))
    engine.add_request(prompt_token_ids=list(range(5, 30)), params=params("ad0"))
    engine.step()  # ad0 holds the slot
    prompt = list(range(7, 33))
    waiting = engine.add_request(prompt_token_ids=prompt, params=params("ad1")).request_id
    tokens, mixes = [], []
    for step in range(200):
        engine.add_request(prompt_token_ids=list(range(3 + step % 5, 30)), params=params("ad0"))  # the stream goes on
        for out in engine.step():
            if out.request_id == waiting:
                tokens += out.new_token_ids
        mixes.append({r.params.lora for r in engine.scheduler.running})
        if len(tokens) == NUM_TOKENS:
            break
    assert len(tokens) == NUM_TOKENS, "ad1 waited for a slot as long as ad0's requests kept coming"
    # passed over by 4 (ad0's requests admitted as slots in the batch freed: ~NUM_TOKENS steps), the running ones
    # ended (~NUM_TOKENS more), then its own NUM_TOKENS
    assert step < 5 * NUM_TOKENS, step
    assert all(len(m - {None}) <= 1 for m in mixes)
    assert tokens == _serve(Engine(EngineConfig(model=str(model), num_blocks=256, lora_modules=adapters)),
                            [(prompt, "ad1")])[0]
    assert engine.lora_stats()["reserves"] == 1
