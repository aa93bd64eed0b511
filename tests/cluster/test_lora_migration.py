"""LoRA adapters through a migration (issue 50: "role flips and migration keep working"): a real cluster (1 prefill,
2 decode workers, two peft adapters served), requests on both adapters and on the base streaming, greedy and seeded;
the decode worker streaming an adapter's request is SIGKILLed mid-stream. The requests it held continue on the other
worker with their adapter (the continuation is prefilled under the adapter's block namespace and decoded through its
slot), so every request's tokens and text equal a fault-free engine's with the same adapters, and the migrations are
counted. Then the pool is back at its target holding the adapters, and a stop that cancels a worker's start begins
no other (a cancelled start reconciles: before the fix, a replacement started after the stop and its actor leaked)."""
from __future__ import annotations

import asyncio
import random

import pytest

from engine.request import SamplingParams
from router.routing.policy import Role
from router.workers.registry import WorkerState
from tests.cluster.test_disagg_cluster import wait_for
from tests.cluster.test_operating import ready, stream_killing
from tests.engine.lora.peft_saved import save_peft_adapter

pytestmark = pytest.mark.slow
ON = (None, "ad-all", "ad-qv", "ad-all", "ad-qv", None)  # each request's adapter


def test_requests_on_adapters_migrate_with_their_adapters(cluster_factory, loop_thread, tiny_model, tmp_path):
    from engine.config import EngineConfig
    from engine.engine import Engine

    model = tiny_model()
    adapters = {"ad-all": str(save_peft_adapter(model, tmp_path / "all", seed=11, std=0.3, target_modules=(
                    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))),
                "ad-qv": str(save_peft_adapter(model, tmp_path / "qv", seed=12, r=8, std=0.3))}
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(20, 60))] for _ in ON]
    params = [SamplingParams(max_tokens=120, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=300 + i,
                             lora=lora) for i, lora in enumerate(ON)]
    want = Engine(EngineConfig(model=str(model), num_blocks=512, lora_modules=adapters)).generate(prompts, params)
    assert len({tuple(w["token_ids"]) for w in want}) == len(ON)  # the adapters change the outputs
    cluster = cluster_factory(model, **{"decode.num_workers": 2, "router.local_prefill_max_tokens": 0,
                                        "engine.lora_modules": adapters, "engine.max_loras": 2})
    backend, killed = cluster.backend, {}

    async def run():  # request 1 (ad-all) mid-stream: its worker dies
        return await asyncio.gather(*(stream_killing(cluster, f"lora-mig-{i}", prompts[i], params[i], killed,
                                                     8 if i == 1 else None) for i in range(len(ON))))

    results = loop_thread.run(run(), timeout=180)
    for i, ((tokens, text, last), ref) in enumerate(zip(results, want)):
        assert last.finished and last.finish_reason == "length", (i, ON[i], last.error)
        assert tokens == ref["token_ids"], (i, ON[i])  # continued under its own adapter: nothing changed
        assert text == ref["text"], (i, ON[i])
    assert killed["busy"] >= 1 and backend.counters["migrated"] >= 1, backend.counters
    back = wait_for(lambda: ready(cluster, Role.DECODE) == 2, timeout_s=90, interval_s=0.2)
    assert back, cluster.pools.autoscaler_view()

    async def stop_while_starting() -> list[str]:
        cluster.pools.set_target(Role.DECODE, 3)
        await asyncio.sleep(0.5)  # the start in flight: its actor spawned, waiting for it
        await cluster.pools.stop()  # cancels it; its reconcile must begin nothing
        await asyncio.sleep(0.2)
        return [r.worker_id for r in cluster.registry.records(states=(WorkerState.STARTING,))]

    assert loop_thread.run(stop_while_starting()) == []
