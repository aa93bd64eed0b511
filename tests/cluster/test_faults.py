"""The fault suite (issue 12): each scenario runs under concurrent streaming load on a real cluster (2 prefill
+ 2 decode Ray actors, KV over NIXL) and checks three things —

  1. no request hangs: every one ends within HANG_BOUND_S;
  2. every request either finishes with exactly the tokens and text of a fault-free run of the same seeded
     request (an in-process engine: disaggregated == colocated is proven elsewhere), or ends with a clear
     error — never a wrong text with success;
  3. afterwards every pool is back at its target, every live worker's KV blocks are free (no leak), and a
     fresh batch of requests is served exactly.

Figures per scenario (requests, exact, errors, migrations, placed again, recovery time) are written to
build/reliability/<scenario>.json; docs/reliability.md holds a run of them.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cluster.health import PROBE_TIMEOUT_S
from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from router.routing.policy import Role
from router.workers.registry import WorkerState
from tests.cluster.test_disagg_cluster import stats, wait_for

pytestmark = pytest.mark.slow
SCALE = int(os.environ.get("DUET_FAULT_SCALE", "1"))  # `make soak`: 5x the requests per scenario
HANG_BOUND_S = 120 * SCALE
RECOVERY_BOUND_S = 90
OUT = Path(__file__).resolve().parents[2] / "build" / "reliability"


def workload(seed: int, n: int, long_prompts: bool = False, scale: int = SCALE):
    n *= scale
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(600, 900) if long_prompts else rng.randint(20, 200))]
               for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(40, 120), ignore_eos=True,
                             temperature=0.0 if i % 3 == 0 else 0.8, seed=1000 + i) for i in range(n)]
    return prompts, params


@dataclass
class Outcome:
    exact: int = 0
    errors: list[str] = field(default_factory=list)
    wrong: list[int] = field(default_factory=list)
    wrong_detail: list[str] = field(default_factory=list)  # how each wrong output differs (the failure says)
    hung: list[int] = field(default_factory=list)
    cancelled: int = 0


async def stream(backend, rid, ids, params):
    tokens, text, last = [], "", None
    async for out in backend.generate(rid, ids, params):
        tokens += out.new_token_ids
        text += out.new_text
        last = out
    return tokens, text, last


def judge(results, references, outcome: Outcome) -> Outcome:
    for i, (result, ref) in enumerate(zip(results, references)):
        if isinstance(result, asyncio.TimeoutError):
            outcome.hung.append(i)
        elif isinstance(result, asyncio.CancelledError):
            outcome.cancelled += 1
        elif isinstance(result, BaseException):
            outcome.errors.append(f"{type(result).__name__}: {result}")
        else:
            tokens, text, last = result
            if last is not None and last.finish_reason == "error":
                assert last.error, "an error must say what failed"
                outcome.errors.append(last.error)
            elif tokens == ref["token_ids"] and text == ref["text"]:
                outcome.exact += 1
            else:
                outcome.wrong.append(i)
                got, want = tokens, ref["token_ids"]
                at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                outcome.wrong_detail.append(f"request {i}: {len(got)} tokens (reference {len(want)}), first "
                                            f"difference at token {at}; finish {getattr(last, 'finish_reason', None)}")
    return outcome


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = Engine(EngineConfig(model=str(tiny_model()), num_blocks=1024))
    return lambda prompts, params: engine.generate(prompts, params)


def recovered(loop_thread, cluster) -> bool:
    pools = cluster.pools
    for role in (Role.PREFILL, Role.DECODE):
        if len(cluster.registry.ready(role)) != pools.targets[role]:
            return False
    if cluster.registry.records(states=(WorkerState.STARTING, WorkerState.DRAINING)):
        return False
    try:
        snapshot = stats(loop_thread, cluster).values()
    except Exception:
        return False
    num_prefill = len(cluster.registry.ready(Role.PREFILL))
    return all(s["kv_blocks_used"] == 0 and s["num_requests"] == 0 and s.get("leases_held", 0) == 0
               # a decode worker knows exactly the live prefill workers: a dead one's NIXL peer is dropped
               and (s["role"] != "decode" or s["peers"] == num_prefill)
               for s in snapshot)


def finish(name, cluster, loop_thread, reference_fn, outcome: Outcome, fault_at: float, n: int,
           counters_before: dict, **extra) -> dict:
    """Check recovery and an exact batch afterwards; write the figures (``extra`` too) for docs/reliability.md."""
    assert not outcome.hung, f"hung requests: {outcome.hung}"
    if outcome.wrong:  # what the router and the workers did, to tell which path gave the wrong text
        counters = {k: v - counters_before.get(k, 0) for k, v in cluster.backend.counters.items()
                    if v != counters_before.get(k, 0)}
        try:
            workers = {w: {k: v for k, v in s.items() if isinstance(v, (int, float)) and v and any(
                part in k for part in ("remote", "peer", "recompute", "import", "fail", "handoff", "lease"))}
                for w, s in stats(loop_thread, cluster).items()}
        except Exception as e:  # noqa: BLE001 - a diagnosis must not hide the failure
            workers = repr(e)
        pytest.fail(f"requests that succeeded with another text than the fault-free run: {outcome.wrong}: "
                    f"{outcome.wrong_detail}; router counters {counters}; workers {workers}")
    back = wait_for(lambda: recovered(loop_thread, cluster), timeout_s=RECOVERY_BOUND_S, interval_s=0.25)
    recovery_s = time.monotonic() - fault_at
    assert back, ("pools did not return to their targets with every block free", cluster.pools.autoscaler_view())
    # and the cluster serves exactly again
    prompts, params = workload(999, 6, scale=1)

    async def again():
        return await asyncio.gather(*(stream(cluster.backend, f"{name}-after-{i}", p, q)
                                      for i, (p, q) in enumerate(zip(prompts, params))))

    after = loop_thread.run(again(), timeout=HANG_BOUND_S)
    refs = reference_fn(prompts, params)
    assert [(t, x) for t, x, _ in after] == [(r["token_ids"], r["text"]) for r in refs]
    figures = {"scenario": name, "requests": n, "exact": outcome.exact, "errors": len(outcome.errors),
               "cancelled": outcome.cancelled, "wrong": len(outcome.wrong), "hung": len(outcome.hung),
               "migrations": cluster.backend.counters["migrated"] - counters_before["migrated"],
               "placed_again": cluster.backend.counters["replaced"] - counters_before["replaced"],
               "recovery_s": round(recovery_s, 1), "leaked_blocks": 0, "error_messages": sorted(set(outcome.errors))[:3], **extra}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures))
    return figures


def run_with_fault(loop_thread, cluster, prompts, params, inject, *, name: str):
    """Start every request, call ``inject()`` (on the loop) once the load is under way, gather."""
    fault = {}

    async def go():
        tasks = [asyncio.create_task(asyncio.wait_for(stream(cluster.backend, f"{name}-{i}", p, q), HANG_BOUND_S))
                 for i, (p, q) in enumerate(zip(prompts, params))]
        await inject(fault)
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = loop_thread.run(go(), timeout=HANG_BOUND_S + 30)
    return results, fault["at"]


def pick(cluster, role: Role):
    busy = [r for r in cluster.registry.ready(role) if cluster.backend.inflight[r.worker_id]]
    return (busy or cluster.registry.ready(role))[0]


FAULT_CLUSTER = {"prefill.num_workers": 2, "decode.num_workers": 2, "router.local_prefill_max_tokens": 0,
                 "transfer.lease_timeout_s": 4.0, "transfer.transfer_timeout_s": 3.0}


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    """One cluster for the whole suite: each scenario must leave it recovered for the next (checked)."""
    return cluster_factory(**FAULT_CLUSTER)


@pytest.fixture
def before(cluster):
    return dict(cluster.backend.counters)


def test_kill_a_prefill_worker_mid_prefill(cluster, before, loop_thread, reference):
    prompts, params = workload(1, 16, long_prompts=True)

    async def inject(fault):
        await asyncio.sleep(0.05)  # the long prompts are queued and prefilling
        victim = pick(cluster, Role.PREFILL)
        fault.update(at=time.monotonic(), worker=victim.worker_id)
        os.kill(victim.pid, signal.SIGKILL)

    forgotten = cluster.pools.counters["peers_forgotten"]
    prefill_before = {r.worker_id for r in cluster.registry.ready(Role.PREFILL)}
    results, at = run_with_fault(loop_thread, cluster, prompts, params, inject, name="kill-prefill-mid-prefill")
    outcome = judge(results, reference(prompts, params), Outcome())
    figures = finish("kill-prefill-mid-prefill", cluster, loop_thread, reference, outcome, at, len(prompts), before)
    assert figures["exact"] + figures["errors"] == len(prompts)
    # each decode worker dropped the dead prefill worker's NIXL peer (recovered() checked the counts) …
    # and so did each surviving prefill worker (it could read the dead one's lent blocks)
    survivors = prefill_before & {r.worker_id for r in cluster.registry.ready(Role.PREFILL)}  # the victim is dead
    expected = len(cluster.registry.ready(Role.DECODE)) + len(survivors)
    assert cluster.pools.counters["peers_forgotten"] - forgotten == expected
    # … and pulls from its replacement (a new NIXL agent, often at the same host) succeed
    (replacement,) = {r.worker_id for r in cluster.registry.ready(Role.PREFILL)} - prefill_before
    for attempt in range(6):
        served = stats(loop_thread, cluster)[replacement]["leases_released"]
        if served:
            break
        prompts, params = workload(100 + attempt, 4, scale=1)

        async def more(prompts=prompts, params=params):
            return await asyncio.gather(*(stream(cluster.backend, f"replacement-{attempt}-{i}", p, q)
                                          for i, (p, q) in enumerate(zip(prompts, params))))

        after = loop_thread.run(more(), timeout=HANG_BOUND_S)
        assert [(t, x) for t, x, _ in after] == [(r["token_ids"], r["text"]) for r in reference(prompts, params)]
    assert served, f"the replacement {replacement} never handed KV to a decode worker"


def kill_a_decode_worker_streaming(cluster, min_inflight: int):
    """``run_with_fault``'s inject: once ``min_inflight`` requests are placed on decode workers and tokens flow,
    SIGKILL a busy decode worker."""
    async def inject(fault):
        while sum(cluster.backend.inflight[r.worker_id] for r in cluster.registry.ready(Role.DECODE)) < min_inflight:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # tokens are flowing
        victim = pick(cluster, Role.DECODE)
        fault.update(at=time.monotonic(), worker=victim.worker_id)
        os.kill(victim.pid, signal.SIGKILL)
    return inject


def test_kill_a_decode_worker_mid_stream(cluster, before, loop_thread, reference):
    prompts, params = workload(2, 16)
    inject = kill_a_decode_worker_streaming(cluster, 8)
    results, at = run_with_fault(loop_thread, cluster, prompts, params, inject, name="kill-decode-mid-stream")
    outcome = judge(results, reference(prompts, params), Outcome())
    figures = finish("kill-decode-mid-stream", cluster, loop_thread, reference, outcome, at, len(prompts), before)
    assert figures["exact"] == len(prompts) and figures["migrations"] >= 1  # migration: nobody sees an error


def test_sigstop_a_decode_worker_past_the_lease_then_continue(cluster, before, loop_thread, reference):
    """A frozen decode worker: its health probes time out ``lifecycle.health_misses`` times in a row, it is
    declared dead, killed and replaced; its requests move; the prefill leases it would have pulled expire on
    time (4 s)."""
    prompts, params = workload(3, 12)
    lc = cluster.config.lifecycle
    frozen_s = lc.health_misses * (PROBE_TIMEOUT_S + lc.health_interval_s) + 3  # past the last probe's timeout

    async def inject(fault):
        while sum(cluster.backend.inflight[r.worker_id] for r in cluster.registry.ready(Role.DECODE)) < 6:
            await asyncio.sleep(0.01)
        victim = pick(cluster, Role.DECODE)
        fault.update(at=time.monotonic(), worker=victim.worker_id)
        os.kill(victim.pid, signal.SIGSTOP)
        await asyncio.sleep(frozen_s)  # longer than the 4 s lease, and than the probes that find it dead
        try:
            os.kill(victim.pid, signal.SIGCONT)
        except ProcessLookupError:  # already killed by the router as dead
            pass

    replaced = cluster.pools.counters["replaced"]
    results, at = run_with_fault(loop_thread, cluster, prompts, params, inject, name="sigstop-decode")
    outcome = judge(results, reference(prompts, params), Outcome())
    finish("sigstop-decode", cluster, loop_thread, reference, outcome, at, len(prompts), before)
    assert cluster.pools.counters["replaced"] == replaced + 1


def test_a_decode_worker_frozen_for_one_probe_is_not_replaced(cluster, before, loop_thread, reference):
    """Frozen for one health probe's timeout and no longer (a loaded machine's slow answer): one probe fails,
    the next answers, so it is not declared dead (``lifecycle.health_misses`` = 2): counted as a probe miss, not
    replaced, every request exact."""
    prompts, params = workload(5, 12)
    lc = cluster.config.lifecycle
    assert lc.health_misses >= 2
    frozen = {}

    async def inject(fault):
        while sum(cluster.backend.inflight[r.worker_id] for r in cluster.registry.ready(Role.DECODE)) < 6:
            await asyncio.sleep(0.01)
        victim = pick(cluster, Role.DECODE)
        fault.update(at=time.monotonic())
        frozen.update(worker=victim.worker_id, misses=cluster.pools.counters["probe_misses"],
                      replaced=cluster.pools.counters["replaced"])
        os.kill(victim.pid, signal.SIGSTOP)
        await asyncio.sleep(PROBE_TIMEOUT_S + lc.health_interval_s + 1)  # one probe times out; the next one waits
        os.kill(victim.pid, signal.SIGCONT)

    results, at = run_with_fault(loop_thread, cluster, prompts, params, inject, name="sigstop-one-probe")
    outcome = judge(results, reference(prompts, params), Outcome())
    finish("sigstop-one-probe", cluster, loop_thread, reference, outcome, at, len(prompts), before)
    assert cluster.pools.counters["probe_misses"] > frozen["misses"]
    assert cluster.pools.counters["replaced"] == frozen["replaced"]
    assert cluster.registry.get(frozen["worker"]).state == WorkerState.READY


def test_cancel_storm(cluster, before, loop_thread, reference):
    """200 clients leave at random moments (queued, prefilling, in transfer, decoding); afterwards nothing is
    leaked and the requests that stayed are exact."""
    prompts, params = workload(4, 200)
    rng = random.Random(4)

    async def go():
        tasks = [asyncio.create_task(asyncio.wait_for(stream(cluster.backend, f"storm-{i}", p, q), HANG_BOUND_S))
                 for i, (p, q) in enumerate(zip(prompts, params))]
        cancelled = rng.sample(range(len(tasks)), len(tasks) * 3 // 4)
        for i in cancelled:
            loop = asyncio.get_running_loop()
            loop.call_later(rng.uniform(0.0, 3.0), tasks[i].cancel)
        return await asyncio.gather(*tasks, return_exceptions=True)

    at = time.monotonic()
    results = loop_thread.run(go(), timeout=HANG_BOUND_S + 30)
    outcome = judge(results, reference(prompts, params), Outcome())
    assert outcome.cancelled >= len(prompts) // 2  # most left before finishing
    figures = finish("cancel-storm", cluster, loop_thread, reference, outcome, at, len(prompts), before)
    assert figures["errors"] == 0


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_bounded_load_loses_nothing_and_memory_stays_bounded(cluster, before, loop_thread, reference):
    """64 closed-loop streaming clients with mixed lengths for 20 s: every request ends exactly; the router's
    and the workers' resident memory after the load stays within a bound of before."""
    duration_s, clients = 20 * SCALE, 64
    pids = {r.worker_id: r.pid for r in cluster.registry.ready(Role.PREFILL) + cluster.registry.ready(Role.DECODE)}
    router_before, workers_before = rss_mib(os.getpid()), {w: rss_mib(p) for w, p in pids.items()}
    rng = random.Random(6)
    checked = {"requests": 0, "exact": 0}

    async def client(i):
        end = time.monotonic() + duration_s
        n = 0
        while time.monotonic() < end:
            ids = [rng.randrange(3, 500) for _ in range(rng.randint(5, 300))]
            params = SamplingParams(max_tokens=rng.randint(1, 60), ignore_eos=True, temperature=0.0, seed=i)
            tokens, text, last = await asyncio.wait_for(stream(cluster.backend, f"load-{i}-{n}", ids, params),
                                                        HANG_BOUND_S)
            assert last.finished and last.finish_reason == "length", last.error
            assert len(tokens) == params.max_tokens
            checked["requests"] += 1
            if n == 0 and i < 8:  # a sample checked against the fault-free engine
                ref = reference([ids], [params])[0]
                assert (tokens, text) == (ref["token_ids"], ref["text"])
                checked["exact"] += 1
            n += 1

    async def go():
        await asyncio.gather(*(client(i) for i in range(clients)))

    loop_thread.run(go(), timeout=duration_s + HANG_BOUND_S)
    assert wait_for(lambda: recovered(loop_thread, cluster), timeout_s=RECOVERY_BOUND_S)
    router_after, workers_after = rss_mib(os.getpid()), {w: rss_mib(p) for w, p in pids.items()}
    growth = {"router": router_after - router_before, **{w: workers_after[w] - workers_before[w] for w in pids}}
    figures = {"scenario": "bounded-load", "clients": clients, "duration_s": duration_s, **checked,
               "rss_before_mib": {"router": round(router_before), **{w: round(v) for w, v in workers_before.items()}},
               "rss_after_mib": {"router": round(router_after), **{w: round(v) for w, v in workers_after.items()}}}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bounded-load.json").write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures))
    assert checked["requests"] >= clients and checked["exact"] == 8
    assert all(g < 300 for g in growth.values()), growth  # MiB: no unbounded buffering anywhere
