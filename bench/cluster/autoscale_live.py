"""The autoscaler live (issue 24, "must show 2"): long prompts, then long outputs, on a real cluster at a budget.

    python -m bench.cluster.autoscale_live [--tiny]      (make bench-autoscale)

A real cluster (Ray actors, KV over NIXL, the router's dispatch; SmolLM2-135M by default, ``--tiny``: the tiny
random Llama) starts at 1 prefill + 1 decode worker with the autoscaler on (``--autoscale``) at a budget of 3
workers (``autoscaler.max_total_workers``; 1..2 of each role), a 1.5 s interval, every prompt prefilled by a
prefill worker (``router.local_prefill_max_tokens: 0``). Closed-loop clients drive two phases through the
router's backend (the code path behind both front doors):

1. long prompts, one output token (prefill-heavy): the prefill pool must grow to 2 — a cold start, the budget
   is then used — and the phase runs on until the split has held for ``settle_s``;
2. short prompts, long outputs (decode-heavy): capacity must move into the decode pool. At the budget that is
   the autoscaler's rebalance (prefill −1 and decode +1 in one tick), which the pool manager carries out as a
   role flip of a drained prefill worker in place (or as a drain + start when flips are not cheaper).

Recorded (JSON under build/bench/autoscale/): the pools per second (ready, starting, draining, targets, the
latest decision code per role), every decision that changed a target (time, role, direction, code, reason,
signals), every flip (drain_s, flip_s, total_s) and cold start (cold_start_s) the pool manager measured, and
per phase the clients' results (requests done and failed, TTFT and ITL p50/p90). The run fails (exit 1, the
reasons printed) unless no request failed, the decode pool grew in phase 2 within the budget, and the phase-2
move's reason names the signals it was judged on. If no cold start happened during the run, one is measured
at the end (both pools pinned, decode −1 then +1: the budget forbids +1 first), so both numbers of the last
line come from the same run: ``ratio: <median flip total_s / median cold start s>``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.cluster.role_flip import settled, wait_until
from bench.cluster_run import init_ray

MACHINE = f"{platform.node()} {platform.processor() or platform.machine()}"
OUT_DIR = Path("build/bench/autoscale")
BUDGET = 3


@dataclass(frozen=True)
class Phase:
    name: str
    clients: int
    prompt_len: int
    max_tokens: int
    max_s: float  # the phase fails if its move has not happened by then
    settle_s: float  # and runs on this long after it did (the split must hold)


@dataclass(frozen=True)
class Plan:
    prefill_heavy: Phase
    decode_heavy: Phase
    ttft_slo_s: float
    itl_slo_s: float
    vocab: int = 500


# SmolLM2 on a shared 2-vCPU machine, one torch thread per worker: a prefill worker measured 140-190 prompt
# tokens per busy second, a decode worker ~0.2 s per step of 16 sequences (docs/benchmarks.md). Phase 1's
# pressure is its queued prompt tokens (4k on one worker > 1,000); the TTFT SLO is loose on purpose, so that in
# phase 2 the short prompts do not look like prefill pressure on a machine whose cores all workers share.
PLANS = {
    "smollm2": Plan(Phase("long prompts", clients=8, prompt_len=512, max_tokens=1, max_s=120, settle_s=12),
                    Phase("long outputs", clients=16, prompt_len=24, max_tokens=128, max_s=120, settle_s=10),
                    ttft_slo_s=8.0, itl_slo_s=0.1, vocab=40000),
    "tiny": Plan(Phase("long prompts", clients=24, prompt_len=700, max_tokens=1, max_s=180, settle_s=10),
                 Phase("long outputs", clients=16, prompt_len=20, max_tokens=160, max_s=180, settle_s=6),
                 ttft_slo_s=8.0, itl_slo_s=0.05),
}


def overrides(model: str, plan: Plan) -> dict:
    return {
        "model": model, "prefill.num_workers": 1, "decode.num_workers": 1, "router.grpc_port": None,
        "router.local_prefill_max_tokens": 0, "prefill.num_cpus": 0.5, "decode.num_cpus": 0.5,
        "prefill.torch_threads": 1, "decode.torch_threads": 1, "engine.num_blocks": 512,
        "autoscaler.enabled": True, "autoscaler.interval_s": 1.5, "autoscaler.warmup_s": 3,
        "autoscaler.min_prefill": 1, "autoscaler.max_prefill": 2, "autoscaler.min_decode": 1,
        "autoscaler.max_decode": 2, "autoscaler.max_total_workers": BUDGET,
        "autoscaler.prefill_queued_tokens_high": 1000, "autoscaler.decode_running_high": 6,
        "autoscaler.ttft_slo_s": plan.ttft_slo_s, "autoscaler.itl_slo_s": plan.itl_slo_s,
    }


class Clients:
    """Closed-loop clients on the cluster's loop: each sends a request, reads it to its end, sends the next."""

    def __init__(self, backend, phase: Phase, vocab: int, seed: int) -> None:
        self.backend, self.phase, self.vocab = backend, phase, vocab
        self.rng, self.tag = random.Random(seed), f"phase{seed + 1}"
        self.done = self.failed = 0
        self.errors: list[str] = []
        self.ttft_s: list[float] = []
        self.itl_s: list[float] = []  # per token: the gap before the output that carried it / its tokens
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _client(self, i: int) -> None:
        from engine.request import SamplingParams

        params = SamplingParams(max_tokens=self.phase.max_tokens, temperature=0, ignore_eos=True)
        n = 0
        while not self._stop.is_set():
            ids = [self.rng.randrange(3, self.vocab) for _ in range(self.phase.prompt_len)]
            t0 = last_t = time.perf_counter()
            first, last = True, None
            try:
                async for out in self.backend.generate(f"{self.tag}-{i}-{n}", ids, params):
                    last, now = out, time.perf_counter()
                    if out.new_token_ids:
                        if first:
                            self.ttft_s.append(now - t0)
                        else:
                            self.itl_s.extend([(now - last_t) / len(out.new_token_ids)] * len(out.new_token_ids))
                        first, last_t = False, now
            except Exception as e:  # noqa: BLE001 - counted and reported
                self.errors.append(repr(e))
            if last is None or not last.finished or last.finish_reason not in ("stop", "length"):
                self.failed += 1
                self.errors.append(getattr(last, "error", None) or "no final output")
            else:
                self.done += 1
            n += 1

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.phase.clients)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def result(self, t0: float, t1: float) -> dict:
        def pct(xs: list[float], q: float) -> float | None:
            return round(statistics.quantiles(xs, n=100, method="inclusive")[q - 1], 4) if len(xs) > 1 else None

        return {"phase": self.phase.name, **{k: v for k, v in asdict(self.phase).items() if k != "name"}, "from_s": round(t0, 2), "to_s": round(t1, 2),
                "done": self.done, "failed": self.failed, "errors": self.errors[:5],
                "ttft_p50_s": pct(self.ttft_s, 50), "ttft_p90_s": pct(self.ttft_s, 90),
                "itl_p50_s": pct(self.itl_s, 50), "itl_p90_s": pct(self.itl_s, 90)}


async def sample_pools(pools, t_start: float, series: list[dict]) -> None:
    """Once a second: each pool's ready / starting / draining workers, its target, the latest decision's code."""
    from router.routing.policy import Role

    while True:
        row = {"t_s": round(time.monotonic() - t_start, 1)}
        for role in (Role.PREFILL, Role.DECODE):
            view = pools.pool_view(role)
            last = pools.last_decision.get(role)
            row[role.value] = {k: view[k] for k in ("target", "ready", "starting", "draining")}
            row[role.value]["code"] = last[1].code if last else None
            row[role.value]["load_workers"] = last[1].signals.get(f"{role.value}_load_workers") if last else None
        series.append(row)
        await asyncio.sleep(1.0)


async def run(model: str, plan: Plan) -> dict:
    """The two phases on a fresh cluster; the record (see the module's docstring), not yet checked."""
    from cluster.config import ClusterConfig
    from cluster.launcher import Cluster
    from router.routing.policy import Role

    cluster = await Cluster.start(ClusterConfig.load(None, overrides(model, plan)))
    pools, t_start, wall_start = cluster.pools, time.monotonic(), time.time()
    series: list[dict] = []
    sampler = asyncio.create_task(sample_pools(pools, t_start, series))
    phases = []
    ready = lambda role: len(cluster.registry.ready(role))  # noqa: E731
    try:
        for seed, (phase, grown) in enumerate(((plan.prefill_heavy, lambda: ready(Role.PREFILL) >= 2),
                                               (plan.decode_heavy, lambda: ready(Role.DECODE) >= 2))):
            clients = Clients(cluster.backend, phase, plan.vocab, seed)
            t0 = time.monotonic() - t_start
            await clients.start()
            try:
                with contextlib.suppress(TimeoutError):  # recorded as a failed check below, with all the run saw
                    await wait_until(grown, phase.max_s)
                    await asyncio.sleep(phase.settle_s)
            finally:
                await clients.stop()
            phases.append(clients.result(t0, time.monotonic() - t_start))
            if not grown():
                break
        deliberate = None
        if not pools.cold_starts:
            deliberate = await measure_cold_start(cluster)
        view = pools.autoscaler_view()
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        await cluster.stop()
    decisions = [{**d, "t_s": round(d["at"] - wall_start, 2)} for d in reversed(view["decisions"])]
    return {"machine": MACHINE, "model": model, "plan": asdict(plan), "overrides": overrides(model, plan),
            "budget": BUDGET, "phases": phases, "series": series, "decisions": decisions,
            "flips": view["role_flip"]["flips"], "cold_starts": view["role_flip"]["cold_starts"],
            "flip_blockers": view["role_flip"]["blockers"], "counters": view["counters"],
            "deliberate_cold_start": deliberate}


async def measure_cold_start(cluster) -> bool:
    """One cold start at the end of the run: both pools pinned (the autoscaler leaves them), decode −1, then +1
    (at the budget +1 cannot come first). False when the decode pool has no worker to spare."""
    from router.routing.policy import Role

    pools = cluster.pools
    p, d = pools.targets[Role.PREFILL], pools.targets[Role.DECODE]
    if d < 2:
        return False
    pools.set_target(Role.PREFILL, pin=True)
    pools.set_target(Role.DECODE, d - 1, pin=True)
    await wait_until(lambda: settled(cluster, p, d - 1))
    pools.set_target(Role.DECODE, d)
    await wait_until(lambda: settled(cluster, p, d))
    return True


def check(record: dict) -> list[str]:
    """What the run must show; the failed checks' messages (empty: passed)."""
    problems = []
    phases = record["phases"]
    for ph in phases:
        if ph["failed"]:
            problems.append(f"{ph['failed']} request(s) failed in phase '{ph['phase']}': {ph['errors'][:2]}")
        if not ph["done"]:
            problems.append(f"no request finished in phase '{ph['phase']}'")
    if len(phases) < 2:
        return problems + [f"the prefill pool did not grow to 2 in phase 1 (max {phases[0]['max_s']} s)"]
    p2_from, p2_to = phases[1]["from_s"], phases[1]["to_s"]
    rows = [r for r in record["series"] if p2_from <= r["t_s"] <= p2_to]
    start_d = rows[0]["decode"]["ready"] if rows else 1
    if not rows or max(r["decode"]["ready"] for r in rows) <= start_d:
        problems.append(f"the decode pool did not grow in phase 2 (ready {start_d} at its start)")
    over = [r["t_s"] for r in record["series"] if r["prefill"]["target"] + r["decode"]["target"] > record["budget"]]
    if over:
        problems.append(f"the targets exceeded the budget of {record['budget']} at t={over[:3]}")
    moves = phase2_moves(record)
    if not moves:
        problems.append("no decision moved capacity into the decode pool in phase 2")
    for d in moves:
        named = named_signals(d)
        if not named:
            problems.append(f"the phase-2 move's reason names none of its signals: {d['reason']!r}")
    return problems


def phase2_moves(record: dict) -> list[dict]:
    p2 = record["phases"][1] if len(record["phases"]) > 1 else None
    return [d for d in record["decisions"] if p2 and d["role"] == "decode" and d["direction"] == "up"
            and p2["from_s"] <= d["t_s"] <= p2["to_s"]]


def named_signals(decision: dict) -> list[str]:
    """The decision's signals that its reason names (by their keys, or their words: "queued prefill tokens")."""
    return [k for k in decision["signals"] if "_" in k and (k in decision["reason"]
                                                           or k.replace("_", " ") in decision["reason"])]


def report(record: dict) -> list[str]:
    lines = [f"machine: {record['machine']}; model: {record['model']}; budget {record['budget']} workers"]
    for ph in record["phases"]:
        lines.append(f"phase '{ph['phase']}' ({ph['clients']} clients, prompt {ph['prompt_len']}, max_tokens "
                     f"{ph['max_tokens']}) t={ph['from_s']:.0f}-{ph['to_s']:.0f} s: {ph['done']} done, "
                     f"{ph['failed']} failed; TTFT p50/p90 {ph['ttft_p50_s']}/{ph['ttft_p90_s']} s, "
                     f"ITL p50/p90 {ph['itl_p50_s']}/{ph['itl_p90_s']} s")
    changes, last = [], None
    for r in record["series"]:
        now = (r["prefill"]["ready"], r["decode"]["ready"])
        if now != last:
            changes.append(f"t={r['t_s']:.0f}s {now[0]}P+{now[1]}D")
            last = now
    lines.append("ready pools: " + ", ".join(changes))
    for d in record["decisions"]:
        lines.append(f"decision t={d['t_s']:.1f}s {d['role']} {d['direction']} -> {d['target']} [{d['code']}] "
                     f"{d['reason']}" + (f" (names {', '.join(named_signals(d))})" if named_signals(d) else ""))
    for f in record["flips"]:
        lines.append(f"flip {f['worker']} {f['from']} -> {f['to']} as {f['as']}: drain {f['drain_s']:.2f} s + "
                     f"flip {f['flip_s']:.3f} s = {f['total_s']:.2f} s")
    for c in record["cold_starts"]:
        lines.append(f"cold start {c['worker']} ({c['role']}): {c['cold_start_s']:.2f} s"
                     + (" (measured deliberately at the end)" if record["deliberate_cold_start"] else ""))
    lines.append(f"counters: {dict(sorted(record['counters'].items()))}")
    flips = [f["total_s"] for f in record["flips"]]
    colds = [c["cold_start_s"] for c in record["cold_starts"]]
    if flips and colds:
        lines.append(f"ratio: {statistics.median(flips) / statistics.median(colds):.3f} (median flip total_s "
                     f"{statistics.median(flips):.2f} s, drain included / median cold start "
                     f"{statistics.median(colds):.2f} s)")
    else:
        lines.append(f"ratio: n/a ({len(flips)} flip(s), {len(colds)} cold start(s))")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny random Llama instead of SmolLM2-135M")
    args = ap.parse_args(argv)
    if args.tiny:
        from bench.engine.throughput import make_bench_tiny_model

        model, plan = make_bench_tiny_model(), PLANS["tiny"]
    else:
        from engine.loading.default_model import default_model_path

        model, plan = str(default_model_path()), PLANS["smollm2"]
    init_ray(4)
    record = asyncio.run(run(model, plan))
    problems = check(record)
    record["problems"] = problems
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    out = OUT_DIR / f"{'tiny' if args.tiny else 'smollm2'}.json"
    out.write_text(json.dumps(record, indent=1, default=str))
    lines = report(record)
    print("\n".join(lines[:-1] + [f"wrote {out}"] + [f"FAILED: {p}" for p in problems] + lines[-1:]))
    if problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
