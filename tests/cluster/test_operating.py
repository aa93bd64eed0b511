"""Operating a live cluster (issue 10): the autoscaler on real traffic, a killed worker replaced, the admin
API's pool writes draining without losing a request, and /metrics under load.

Every cluster here is real: Ray actors in their own processes, KV over NIXL, the router's dispatch. Load is
driven through the router's backend (the code path behind both front doors) or over HTTP where the
scrape is what is tested.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.cluster.autoscale_live import Clients, Phase
from engine.request import SamplingParams
from router.routing.policy import Role
from router.workers.registry import WorkerState
from tests.cluster.test_disagg_cluster import stats, wait_for

pytestmark = pytest.mark.slow


def ready(cluster, role: Role) -> int:
    return len(cluster.registry.ready(role))


def all_blocks_free(loop_thread, cluster) -> bool:
    return all(s["kv_blocks_used"] == 0 and s["num_requests"] == 0 for s in stats(loop_thread, cluster).values())


class Load(Clients):
    """Closed-loop clients on the cluster's loop (bench/cluster/autoscale_live.py's), sized by keyword."""

    def __init__(self, backend, clients: int, prompt_len: int, max_tokens: int, seed: int) -> None:
        super().__init__(backend, Phase("load", clients, prompt_len, max_tokens, max_s=0, settle_s=0), 500, seed)


AUTOSCALE = {
    "autoscaler.enabled": True, "autoscaler.interval_s": 1.5, "autoscaler.warmup_s": 3,
    "autoscaler.min_prefill": 1, "autoscaler.max_prefill": 3, "autoscaler.min_decode": 1,
    "autoscaler.max_decode": 3, "autoscaler.prefill_queued_tokens_high": 1000,
    "autoscaler.decode_running_high": 6, "autoscaler.ttft_slo_s": 600, "autoscaler.itl_slo_s": 600,
    "autoscaler.scale_down_intervals": 3, "router.local_prefill_max_tokens": 0,
}


@pytest.mark.soak  # ~60 s; `make test` follows a traffic mix live in tests/bench/cluster/test_autoscale_live.py
def test_autoscaler_follows_the_traffic_mix_and_drains_back(cluster_factory, loop_thread):
    """Long prompts add a prefill worker (and not a decode one), long outputs add a decode worker, silence
    drains both pools back to one — with no failed request and every block back in the pools."""
    cluster = cluster_factory(**AUTOSCALE)
    pools = cluster.pools
    max_decode_during_prefill_burst = 1

    prefill_burst = Load(cluster.backend, clients=24, prompt_len=700, max_tokens=1, seed=1)
    loop_thread.run(prefill_burst.start())
    try:
        def watch_prefill():
            nonlocal max_decode_during_prefill_burst
            max_decode_during_prefill_burst = max(max_decode_during_prefill_burst, pools.targets[Role.DECODE])
            return ready(cluster, Role.PREFILL) >= 2
        assert wait_for(watch_prefill, timeout_s=60, interval_s=0.2), pools.autoscaler_view()
    finally:
        loop_thread.run(prefill_burst.stop())
    assert max_decode_during_prefill_burst == 1, "prefill pressure scaled the decode pool: " + "; ".join(
        f"{d['role']} {d['direction']}: {d['reason']} {d['signals']}" for d in pools.autoscaler_view()["decisions"])

    decode_burst = Load(cluster.backend, clients=16, prompt_len=20, max_tokens=160, seed=2)
    loop_thread.run(decode_burst.start())
    try:
        assert wait_for(lambda: ready(cluster, Role.DECODE) >= 2, timeout_s=60, interval_s=0.2), pools.autoscaler_view()
    finally:
        loop_thread.run(decode_burst.stop())

    back = wait_for(lambda: ready(cluster, Role.PREFILL) == 1 and ready(cluster, Role.DECODE) == 1
                    and not cluster.registry.records(states=(WorkerState.DRAINING, WorkerState.STARTING)),
                    timeout_s=90, interval_s=0.5)
    assert back, pools.autoscaler_view()
    for load in (prefill_burst, decode_burst):
        assert load.failed == 0 and not load.errors, load.errors[:3]
        assert load.done > 0
    assert wait_for(lambda: all_blocks_free(loop_thread, cluster), timeout_s=10)
    view = pools.autoscaler_view()
    for d in reversed(view["decisions"]):
        print(f"{d['role']:8} {d['direction']:5} -> {d['target']}  {d['reason']}")
    moves = {(d["role"], d["direction"], d["code"]) for d in view["decisions"]}
    assert ("prefill", "up", "queued_prefill_tokens") in moves and ("decode", "up", "running_seqs") in moves
    assert ("prefill", "down", "fits_in_fewer") in moves and ("decode", "down", "fits_in_fewer") in moves
    assert all(d["reason"] and d["signals"] for d in view["decisions"])
    drained = [r for r in cluster.registry.records(states=(WorkerState.DEAD,)) if r.reason.startswith("drained")]
    assert len(drained) >= 2 and not any(r.fault for r in drained)
    assert view["counters"].get("drain_timeouts", 0) == 0


def on_loop(loop_thread, fn, *args):
    async def call():
        return fn(*args)
    return loop_thread.run(call())


def test_admin_writes_scale_a_pool_and_a_drain_loses_no_request(cluster_factory, loop_thread):
    cluster = cluster_factory(**{"router.local_prefill_max_tokens": 0})
    pools = cluster.pools
    view = on_loop(loop_thread, pools.set_target, Role.DECODE, 2)
    assert view["target"] == 2 and view["starting"] == 1  # the new worker is visible at once
    assert wait_for(lambda: ready(cluster, Role.DECODE) == 2, timeout_s=60)
    load = Load(cluster.backend, clients=8, prompt_len=30, max_tokens=120, seed=3)
    loop_thread.run(load.start())
    assert wait_for(lambda: all(cluster.backend.inflight[w] for w in cluster.backend.decode), timeout_s=30)
    on_loop(loop_thread, pools.set_target, Role.DECODE, 1)  # drains one of two busy workers while the load goes on
    assert wait_for(lambda: cluster.registry.records(Role.DECODE, (WorkerState.DRAINING,)), timeout_s=10)
    assert wait_for(lambda: ready(cluster, Role.DECODE) == 1 and
                    not cluster.registry.records(Role.DECODE, (WorkerState.DRAINING,)), timeout_s=90)
    loop_thread.run(load.stop())
    assert load.failed == 0 and load.done > 0, load.errors[:3]
    assert wait_for(lambda: all_blocks_free(loop_thread, cluster), timeout_s=10)
    with pytest.raises(Exception, match=r"target must be an integer in \[1, 3\]"):
        on_loop(loop_thread, pools.set_target, Role.DECODE, 0)


REPLACE_BOUND_S = 60  # health probe (1 s) + probe timeout (5 s) + a tiny worker's start (~5-20 s on 2 vCPUs)


TOOL_REQUESTS = (2, 5)  # these carry a required tool call's grammar (the generic format: SmolLM2's, the tiny model's)


def tool_call_constraint():
    """What the router sends the engine for ``tool_choice: "required"`` with one tool in the generic format."""
    from router.openai.tool_parsers import FORMATS
    from router.openai.tools import ToolDef, ToolPlan

    tool = ToolDef.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}})
    return ToolPlan.of([tool], "required", False, FORMATS["generic"]).constraint


async def stream_killing(cluster, rid: str, prompt, params, killed: dict, kill_after: int | None):
    """(tokens, text, last output) of one request streamed through ``cluster.backend``; once it has ``kill_after``
    tokens (None: never), and nothing was killed yet, SIGKILL the decode worker streaming it (``killed``: its id, when,
    and how many requests it held)."""
    backend, tokens, text = cluster.backend, [], ""
    async for out in backend.generate(rid, prompt, params):
        tokens += out.new_token_ids
        text += out.new_text
        if not killed and kill_after is not None and len(tokens) >= kill_after:
            victim = next(r for r in cluster.registry.ready(Role.DECODE)
                          if rid in backend.tracker.requests_on(r.worker_id))
            killed.update(worker=victim.worker_id, at=time.monotonic(), busy=backend.inflight[victim.worker_id])
            os.kill(victim.pid, signal.SIGKILL)
        last = out
    return tokens, text, last


def test_a_decode_worker_killed_mid_stream_its_requests_migrate_and_the_pool_recovers(cluster_factory, loop_thread,
                                                                                      tiny_model):
    """SIGKILL a decode worker's process while seeded requests stream from it (2 decode workers): every
    request's full text and tokens equal a fault-free run's — the ones on the dead worker were continued
    elsewhere from where their clients were — the migrations are counted, and the pool is back at target.
    The victim is the worker streaming a tool call (issue 25): its grammar continues where the call was, so the
    call is the same valid call."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from router.openai.tool_parsers import Call, GenericParser

    cluster = cluster_factory(**{"decode.num_workers": 2, "router.local_prefill_max_tokens": 0})
    backend = cluster.backend
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(20, 90))] for _ in range(8)]
    tool_call = tool_call_constraint()
    closing = {cluster.backend.tokenizer.token_to_id(t): 8.0 for t in ('"', "}")}  # a random model's strings end
    params = [SamplingParams(max_tokens=150, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=100 + i,
                             stop=("zq",) if i == 3 else ()) if i not in TOOL_REQUESTS else
              SamplingParams(max_tokens=150, temperature=0.8 if i % 2 else 0.0, seed=100 + i, structured=tool_call,
                             logit_bias=closing) for i in range(len(prompts))]
    want = Engine(EngineConfig(model=str(tiny_model()), num_blocks=512)).generate(prompts, params)
    killed = {}

    async def run():  # mid-call: the victim is the tool call's worker
        return await asyncio.gather(*(stream_killing(cluster, f"mig-{i}", prompts[i], params[i], killed,
                                                     6 if i == TOOL_REQUESTS[0] else None)
                                      for i in range(len(prompts))))

    results = loop_thread.run(run(), timeout=180)
    for i, ((tokens, text, last), ref) in enumerate(zip(results, want)):
        assert last.finished and last.finish_reason in ("length", "stop"), (i, last.error)
        assert tokens == ref["token_ids"], i  # nothing missing, repeated or changed
        assert text == ref["text"], i
    assert killed["busy"] >= 1 and backend.counters["migrated"] >= 1
    migrated_call = results[TOOL_REQUESTS[0]]
    assert migrated_call[2].finish_reason == "stop"  # the grammar completed the call after the move
    parser = GenericParser()
    events = parser.feed(migrated_call[1]) + parser.finish()
    calls = [e for e in events if isinstance(e, Call)]
    assert len(calls) == 1 and calls[0].name == "get_weather" and len(json.loads(calls[0].arguments)["city"]) <= 10
    assert sum(s.value for s in cluster.metrics.migrations.collect()[0].samples if s.name.endswith("_total")) >= 1
    back = wait_for(lambda: ready(cluster, Role.DECODE) == 2, timeout_s=REPLACE_BOUND_S, interval_s=0.2)
    took_s = time.monotonic() - killed["at"]
    assert back, cluster.pools.autoscaler_view()
    assert killed["worker"] in backend.lost and killed["worker"] not in backend.decode
    assert wait_for(lambda: all_blocks_free(loop_thread, cluster), timeout_s=10)
    print(f"{backend.counters['migrated']} request(s) migrated; decode pool back at its target {took_s:.1f} s "
          "after the kill")


def test_metrics_scrape_under_load_matches_the_requests(cluster_factory, loop_thread):
    import openai
    import uvicorn

    from router.http.app import create_app

    cluster = cluster_factory(**{"router.local_prefill_max_tokens": 0})
    app = create_app(cluster.backend, served_model_names=[cluster.config.model_name], operator=cluster.pools,
                     metrics=cluster.metrics)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    serving = asyncio.run_coroutine_threadsafe(server.serve(), loop_thread.loop)
    assert wait_for(lambda: server.started, timeout_s=20)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        rng = random.Random(7)

        async def one(i: int):
            prompt = " ".join(rng.choice(["river", "mountain", "stone", "bridge", "garden"]) for _ in range(20 + i))
            if i % 2:
                stream = await client.completions.create(model=cluster.config.model_name, prompt=prompt, max_tokens=12,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True})
                usage = None
                async for chunk in stream:
                    usage = chunk.usage or usage
                return usage
            return (await client.completions.create(model=cluster.config.model_name, prompt=prompt, max_tokens=8 + i,
                                                    temperature=0)).usage

        async def scrape_during(tasks):
            while not all(t.done() for t in tasks):
                r = await asyncio.to_thread(httpx.get, url + "/metrics", timeout=10)
                assert r.status_code == 200
                list(text_string_to_metric_families(r.text))  # parses mid-load
                await asyncio.sleep(0.05)

        async def run():
            tasks = [asyncio.create_task(one(i)) for i in range(10)]
            await scrape_during(tasks)
            return [t.result() for t in tasks]

        usages = loop_thread.run(run(), timeout=120)
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}

        def total(family, suffix="_count", **labels):
            return sum(s.value for s in families[family].samples
                       if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items()))

        assert total("vllm:time_to_first_token_seconds") == 10
        assert total("vllm:inter_token_latency_seconds") == sum(u.completion_tokens - 1 for u in usages)
        assert total("vllm:e2e_request_latency_seconds") == 10
        assert total("vllm:request_success", "_total") == 10
        assert total("vllm:time_to_first_token_seconds", role="prefill") == 10  # all disaggregated
        assert total("duet_routing_decisions", "_total", outcome="disaggregated") == 10
        assert wait_for(lambda: cluster.registry.get("prefill-0").stats.get("num_prompt_tokens", 0) >=
                        sum(u.prompt_tokens for u in usages), timeout_s=5)
        assert families["vllm:kv_cache_usage_perc"].type == "gauge"
        assert total("duet_workers", "", role="decode", state="ready") == 1
    finally:
        server.should_exit = True
        serving.result(15)
