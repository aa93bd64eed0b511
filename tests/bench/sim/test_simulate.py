"""The goodput simulator (bench/sim/__main__.py and its modules): exact timings on hand-computable workloads,
the effects it exists to show (prefix hits, colocated interference, autoscaling), the calibration fit and
the comparison with a real run's JSON. No model runs here: the CPU step model is the committed fit."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import bench.sim.autoscale as sim_autoscale
from bench import workloads
from bench.sim.calibrate import best_of
from bench.sim.calibration_check import calibration_check, deployment_of
from bench.sim.cluster import ClusterSim, Deployment, Hardware
from bench.sim.runs import parse_config
from bench.sim.scenarios import CALIBRATION, cpu_hardware, simulate_run
from bench.sim.step_model import (
    TOKEN_KNOTS,
    FittedStepModel,
    RooflineStepModel,
    StepShape,
    TransferModel,
    feature_names,
    fit,
)
from bench.sim.tiers import SimMover, TierFeed, TierSpec, global_lru_hit_rate, match_total
from bench.summary import percentile, stats, summarize
from bench.workloads import BenchRequest
from cluster.autoscaler import AutoscalerConfig
from engine.kv.events import BlockRemoved, BlockStored, Tier
from engine.kv.hashing import BlockHasher
from engine.kv.tiers import Job, Op
from router.routing.index import PrefixIndex
from router.routing.policy import Role

SLO = {"ttft_s": 2.0, "tpot_s": 0.25}
B = 16


def flat_model(const_s: float = 0.1, per_token_s: float = 0.01) -> FittedStepModel:
    """t = const + per_token * tokens, nothing else: every step is computable by hand."""
    coef = {n: 0.0 for n in feature_names()}
    coef["const"] = const_s + per_token_s  # the constant holds a step's first token
    for a, b in zip(TOKEN_KNOTS, TOKEN_KNOTS[1:]):
        coef[f"tokens_{a}_{b}"] = per_token_s
    return FittedStepModel(coef, "flat")


def hardware(model=None, num_blocks: int = 256, net_s: float = 0.0, fixed_s: float = 0.05, **kw) -> Hardware:
    return Hardware("test", model or flat_model(), TransferModel(1000.0, 1e6, fixed_s), block_size=B,
                    num_blocks=num_blocks, max_num_seqs=64, max_num_batched_tokens=2048, net_s=net_s, **kw)


def prompt(n: int, base: int) -> tuple[int, ...]:
    return tuple(range(base, base + n))


def run(dep: Deployment, reqs, hw=None, autoscaler=None) -> dict:
    return simulate_run(dep, hw or hardware(), reqs, {"name": "test"}, SLO, autoscaler)


def by_index(doc: dict) -> dict[int, dict]:
    return {r["index"]: r for r in doc["requests"]}


# ---- exact timings ---------------------------------------------------------------------------------

def test_colocated_lone_request_is_exact():
    doc = run(parse_config("colocated-1", 64), [BenchRequest(prompt(32, 1000), 3, 0.0)])
    r = doc["requests"][0]
    assert r["ok"] and r["output_tokens"] == 3
    assert r["ttft_s"] == pytest.approx(0.1 + 32 * 0.01)  # one prompt step of 32 tokens
    assert r["tpot_s"] == pytest.approx(0.1 + 0.01)  # then two decode steps of one token
    assert r["e2e_s"] == pytest.approx(0.42 + 2 * 0.11)


def test_disaggregated_lone_request_is_exact():
    hw = hardware(net_s=0.001)
    doc = run(parse_config("1P+1D", 0), [BenchRequest(prompt(40, 1000), 3, 0.0)], hw)
    r = doc["requests"][0]
    # router -> P (1 ms), prefill step, P -> router (1 ms): TTFT
    assert r["ttft_s"] == pytest.approx(0.001 + 0.1 + 40 * 0.01 + 0.001)
    # router -> D (1 ms), pull 3 blocks (fixed 50 ms + 3 * 1000 B / 1 MB/s), two decode steps, D -> router (1 ms)
    transfer = 0.05 + 3 * 1000 / 1e6
    assert r["e2e_s"] - r["ttft_s"] == pytest.approx(0.001 + transfer + 2 * 0.11 + 0.001)
    assert doc["sim"]["counters"]["transferred_blocks"] == 3
    assert doc["config"]["kind"] == "duet-disagg"


def test_lone_request_tpot_is_the_batch_one_decode_step():
    hw = cpu_hardware(CALIBRATION, threads=1)
    n, out = 100, 6
    doc = run(parse_config("colocated-1", 64), [BenchRequest(prompt(n, 1000), out, 0.0)],
              dataclasses.replace(hw, net_s=0.0))
    steps = [hw.step_model.step_time_s(StepShape(num_tokens=1, num_decode_seqs=1, decode_ctx_tokens=n + k,
                                                 num_sampled=1)) for k in range(1, out)]
    assert doc["requests"][0]["tpot_s"] == pytest.approx(sum(steps) / len(steps))
    assert 0.01 < steps[0] < 1.0  # a plausible CPU decode step


# ---- effects ----------------------------------------------------------------------------------------

def test_cache_aware_finds_more_prefix_hits_than_round_robin():
    reqs = workloads.shared_prefix_requests(vocab=5000, num=48, num_prefixes=4, prefix_len=256, suffix_len=16,
                                            output_len=2, seed=1)
    reqs = [dataclasses.replace(r, arrival_s=0.5 * i) for i, r in enumerate(reqs)]
    rates = {}
    for policy in ("cache_aware", "round_robin"):
        doc = run(parse_config("colocated-4", 64, policy), reqs, hardware(flat_model(0.01, 0.001)))  # light load
        assert doc["summary"]["completed"] == 48
        rates[policy] = doc["sim"]["prefix_hit_rate"]
    # each prefix misses once with cache_aware; once per worker with round robin
    assert rates["cache_aware"] > rates["round_robin"] + 0.15


def test_long_prefill_slows_decode_when_colocated_not_when_disaggregated():
    decoding = BenchRequest(prompt(32, 1000), 30, 0.0)
    long_prompt = BenchRequest(prompt(1500, 50_000), 1, 1.0)  # arrives while the first one decodes
    tpot = {}
    for name in ("colocated-1", "1P+1D"):
        dep = parse_config(name, 64)
        alone = by_index(run(dep, [decoding]))[0]["tpot_s"]
        mixed = by_index(run(dep, [decoding, long_prompt]))
        assert mixed[1]["ok"]
        tpot[name] = (alone, mixed[0]["tpot_s"])
    alone, mixed = tpot["colocated-1"]
    assert mixed > alone + 0.5 / 29  # the 1,500-token step (15+ s) lands in one of its 29 gaps
    alone, mixed = tpot["1P+1D"]
    assert mixed == pytest.approx(alone)  # the prefill ran on the prefill worker


def test_autoscaler_runs_the_real_policy_and_scales_up_an_overloaded_prefill_pool(monkeypatch):
    calls = []
    real_decide = sim_autoscale.decide

    def spy(history, pools, config):
        calls.append(len(history))
        return real_decide(history, pools, config)

    monkeypatch.setattr(sim_autoscale, "decide", spy)
    # 60 long prompts, 1 output token each, 4 per second: far more prefill than one worker does (~2.5 s each)
    reqs = [BenchRequest(prompt(240, 10_000 * (i + 1)), 1, 0.25 * i) for i in range(60)]
    cfg = AutoscalerConfig(enabled=True, interval_s=2.0, min_prefill=1, max_prefill=3, min_decode=1, max_decode=3,
                           max_total_workers=4, ttft_slo_s=2.0, itl_slo_s=0.25, warmup_s=1.0)
    doc = run(Deployment("auto", 1, 1), reqs, hardware(startup_s=3.0), autoscaler=cfg)
    auto = doc["sim"]["autoscaler"]
    assert calls and doc["summary"]["completed"] == 60
    ups = [d for d in auto["decisions"] if d["role"] == "prefill" and d["direction"] == "up"]
    assert ups and ups[0]["code"] in ("queued_prefill_tokens", "ttft_slo", "prefill_queue_slo")
    assert auto["final"]["prefill"] + auto["final"]["decode"] <= 4
    assert max(t["prefill_ready"] for t in auto["timeline"]) >= 2  # the new worker became ready and served


def test_pools_are_exact_after_a_trace_run():
    reqs = workloads.scaled_trace(vocab=49152, limit=40, time_scale=4.0)
    sim = ClusterSim(parse_config("2P+2D", 64), hardware(num_blocks=200), reqs)
    res = sim.run()
    assert all(f.done_s is not None for f in res.flights)
    for engine in res.engines:
        engine.pool.check()
        assert engine.pool.num_used_blocks == 0 and engine.is_idle()


# ---- calibration --------------------------------------------------------------------------------------

def test_committed_calibration_fit_reproduces_its_measurements():
    data = json.loads(CALIBRATION.read_text())
    assert data["features"] == feature_names()
    for threads, f in data["fits"].items():
        best = best_of(f["measurements"])
        train = [m for m in best if m["kind"] in f["trained_on"]]
        shapes, times = [StepShape(**m["shape"]) for m in train], [m["time_s"] for m in train]
        assert fit(shapes, times) == pytest.approx(f["coefficients"])  # the stored fit is this data's fit
        model = FittedStepModel(f["coefficients"])
        errs = [abs(model.step_time_s(s) / t - 1) for s, t in zip(shapes, times)]
        assert float(np.median(errs)) < 0.10, threads
        mixed = [abs(model.step_time_s(StepShape(**m["shape"])) / m["time_s"] - 1) for m in best if m["kind"] == "mixed"]
        assert float(np.median(mixed)) < 0.25, threads  # held out: the parts add up


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound():
    m = RooflineStepModel()
    decode = StepShape(num_tokens=1, num_decode_seqs=1, decode_ctx_tokens=1000, num_sampled=1)
    weights_s = m.model.weight_bytes / (m.gpu.hbm_efficiency * m.gpu.hbm_bytes_per_s)
    assert m.step_time_s(decode) == pytest.approx(m.gpu.step_overhead_s + weights_s, rel=0.05)  # ~7 ms
    prefill = StepShape(num_tokens=8192, num_prefill_seqs=1, prefill_attn_pairs=8192 * 4096.5,
                        prefill_ctx_tokens=8192, num_sampled=1)
    assert m.flops(prefill) / (m.gpu.mfu * m.gpu.peak_flops) > m.bytes(prefill) / (m.gpu.hbm_efficiency * m.gpu.hbm_bytes_per_s)
    assert 0.1 < m.step_time_s(prefill) < 0.4


# ---- the benchmark format and the calibration check ------------------------------------------------------------

def test_summary_matches_numpy_and_counts_goodput_on_both_slos():
    xs = list(np.random.default_rng(0).exponential(size=37))
    for q in (50, 90, 99):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    rs = [{"ok": True, "prompt_tokens": 5, "output_tokens": 3, "ttft_s": 1.0, "tpot_s": 0.1, "e2e_s": 1.2},
          {"ok": True, "prompt_tokens": 5, "output_tokens": 1, "ttft_s": 1.0, "tpot_s": None, "e2e_s": 1.0},
          {"ok": True, "prompt_tokens": 5, "output_tokens": 3, "ttft_s": 3.0, "tpot_s": 0.1, "e2e_s": 3.2},
          {"ok": True, "prompt_tokens": 5, "output_tokens": 3, "ttft_s": 1.0, "tpot_s": 0.3, "e2e_s": 1.6},
          {"ok": False, "prompt_tokens": 5, "output_tokens": 0, "ttft_s": None, "tpot_s": None, "e2e_s": None}]
    s = summarize(rs, 2.0, SLO)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (4, 1, 10)
    assert s["goodput"] == pytest.approx(2 / 2.0)  # the first two; one-token TPOT counts as met
    assert s["request_throughput"] == pytest.approx(2.0)


def test_simulated_run_has_the_benchmark_format():
    doc = run(parse_config("1P+1D", 64), workloads.scaled_trace(vocab=49152, limit=8, time_scale=4.0))
    assert set(doc) >= {"config", "workload", "slo", "duration_s", "summary", "requests"}
    assert {"name", "kind", "prefill", "decode"} <= set(doc["config"])
    assert set(doc["summary"]) >= {"completed", "failed", "output_tokens", "prompt_tokens", "request_throughput",
                                   "output_throughput", "goodput", "ttft_s", "tpot_s", "itl_s", "e2e_s"}
    assert set(doc["requests"][0]) == {"index", "arrival_s", "prompt_tokens", "output_tokens", "ttft_s", "tpot_s",
                                       "e2e_s", "ok", "error"}
    json.dumps(doc)


def test_calibration_check_reads_a_real_run_and_reports_relative_errors(tmp_path):
    w = {"name": "mooncake-conversation", "limit": 10, "start": 0, "block_tokens": 16, "output_scale": 1 / 16,
         "max_output": 64, "max_input": 2048, "time_scale": 8.0, "seed": 0}
    reqs = workloads.scaled_trace(vocab=32000, **{k: v for k, v in w.items() if k != "name"})
    cfg = {"name": "duet-disagg-1p1d", "kind": "duet-disagg", "prefill": 1, "decode": 1, "extra_args": []}
    dep, in_process = deployment_of(cfg)
    assert (dep.prefill, dep.decode, dep.local_prefill_max_tokens, in_process) == (1, 1, 64, False)
    real = simulate_run(dep, cpu_hardware(CALIBRATION, 1), reqs, w, SLO)  # a "real" run the simulator matches
    real["config"] = cfg
    for r in real["requests"]:
        r["arrival_s"] = reqs[r["index"]].arrival_s
    path = tmp_path / "real.json"
    path.write_text(json.dumps(real))
    rows = {r["metric"]: r for r in calibration_check(path, None, None, CALIBRATION, tmp_path)["rows"]}
    assert all(r["rel_err"] == pytest.approx(0, abs=1e-9) for r in rows.values() if r["rel_err"] is not None)
    real["summary"]["ttft_s"]["p50"] *= 2  # the simulator is then 50 % low on it
    path.write_text(json.dumps(real))
    rows = {r["metric"]: r for r in calibration_check(path, None, None, CALIBRATION, tmp_path)["rows"]}
    assert rows["ttft p50"]["rel_err"] == pytest.approx(-0.5)
    colocated, in_process = deployment_of({"name": "duet-colocated", "kind": "duet-colocated", "prefill": 0,
                                           "decode": 0, "extra_args": []})
    assert (colocated.prefill, colocated.decode, in_process) == (0, 1, True)
    routed, _ = deployment_of({"name": "x", "kind": "duet-disagg", "prefill": 2, "decode": 1,
                               "extra_args": ["--prefill-policy", "round_robin", "--local-prefill-max-tokens", "0"]})
    assert (routed.prefill_policy, routed.decode_policy, routed.local_prefill_max_tokens) == ("round_robin",
                                                                                             "cache_aware", 0)


def test_calibration_check_rebuilds_a_random_workload_from_the_real_lengths(tmp_path):
    reqs = [BenchRequest(prompt(100 + 10 * i, 1000 * (i + 1)), 8, 2.0 * i) for i in range(6)]
    cfg = {"name": "duet-disagg-1p1d", "kind": "duet-disagg", "prefill": 1, "decode": 1, "extra_args": []}
    real = simulate_run(deployment_of(cfg)[0], cpu_hardware(CALIBRATION, 1), reqs,
                        {"name": "random", "input_len": 100, "output_len": 8, "num_requests": 6}, SLO)
    real["config"] = cfg
    path = tmp_path / "real.json"
    path.write_text(json.dumps(real))
    result = calibration_check(path, None, None, CALIBRATION, tmp_path)
    assert result["workload_rebuilt"].startswith("lengths only")
    assert all(r["rel_err"] == pytest.approx(0, abs=1e-9) for r in result["rows"] if r["rel_err"] is not None)
    path.write_text(json.dumps({"summary": {}}))
    with pytest.raises(ValueError, match="not a benchmark document"):
        calibration_check(path, None, None, CALIBRATION, tmp_path)


# ---- lower KV tiers and peer fetches (bench/sim/tiers.py) ----------------------------------------------

def test_sim_mover_finishes_a_job_when_the_clock_passes_bytes_over_bandwidth():
    spec = TierSpec(host_blocks=8, pcie_bytes_per_s=1e9, disk_write_bytes_per_s=1e8, rdma_bytes_per_s=2e9,
                    peer_fixed_s=1e-3)
    mover = SimMover(spec, bytes_per_block=1e6)
    loads = Job(0, [Op("load", h, (h,), 0, 0) for h in range(3)])  # 3 MB over PCIe: 3 ms
    mover.submit(loads)
    mover.submit(Job(1, [Op("spill", 9, (9,), 1)]))  # then 1 MB to disk at 100 MB/s: done at 13 ms
    mover.submit(Job(2, [Op("fetch", 7, (7,), 2)] * 4), "nic")  # its own channel: 1 ms + 4 MB / 2 GB/s = 3 ms
    mover.advance_to(0.0029)
    assert mover.completions() == []
    mover.advance_to(0.003)
    assert [c.job_id for c in mover.completions()] == [0, 2]
    assert mover.next_completion_s() == pytest.approx(0.013)
    mover.advance_to(mover.next_completion_s())
    assert [c.job_id for c in mover.completions()] == [1] and mover.next_completion_s() is None


def test_an_int8_host_tier_holds_more_blocks_and_moves_fewer_bytes():
    """Arm (e): the same host bytes hold 256 / 132 the blocks of a bf16 device cache (GPU scenario: head_dim 128),
    and each store, load and peer fetch moves the int8 block's bytes."""
    from bench.sim.scenarios import gpu_scenario
    from bench.sim.tiers_study import arm_spec, int8_scale

    scale = int8_scale(gpu_scenario())
    assert scale == pytest.approx(132 / 256)
    c, e = arm_spec("c", 2048, 0), arm_spec("e", 2048, 0, scale)
    assert e.peers and e.host_blocks == int(2048 * 256 / 132) and c.lower_bytes_scale == 1.0
    full, small = SimMover(c, bytes_per_block=1e6), SimMover(e, bytes_per_block=1e6)
    load = Op("load", 0, (0,), 0, 0)
    assert small.op_time_s(load) == pytest.approx(full.op_time_s(load) * scale)
    fetch = Job(0, [Op("fetch", 7, (7,), 2)] * 4)
    assert small.job_time_s(fetch, "nic") - e.peer_fixed_s == pytest.approx(
        (full.job_time_s(fetch, "nic") - c.peer_fixed_s) * scale)


def _tier_workload(num_prefixes: int = 8, rounds: int = 3) -> list[BenchRequest]:
    """Each prefix (16 blocks) comes back every ``num_prefixes`` requests: too late for a 48-block device
    cache, in time for a host tier."""
    reqs = workloads.shared_prefix_requests(vocab=5000, num=num_prefixes, num_prefixes=num_prefixes, prefix_len=256,
                                            suffix_len=16, output_len=2, seed=3)
    return [dataclasses.replace(reqs[i % num_prefixes], arrival_s=1.0 * i) for i in range(num_prefixes * rounds)]


def _tier_run(dep: Deployment, tiers: TierSpec | None, reqs) -> tuple[dict, ClusterSim]:
    hw = dataclasses.replace(hardware(flat_model(0.01, 0.001), num_blocks=48), tiers=tiers)
    sim = ClusterSim(dep, hw, reqs)
    res = sim.run()
    assert all(f.done_s is not None for f in res.flights)
    for engine in res.engines:  # every copy landed, every block back: the accounting is exact
        engine.pool.check()
        assert engine.pool.num_used_blocks == 0 and engine.is_idle()
        if engine.tiers is not None:
            engine.tiers.check()
            assert engine.tiers.num_jobs_in_flight == 0 and not engine.scheduler.loading
    return {"hit": res.prefix_hit_rate(), **res.hit_sources(), **res.counters}, sim


def test_a_host_tier_raises_the_hit_rate_and_its_loads_complete():
    reqs = _tier_workload()
    without, _ = _tier_run(parse_config("colocated-1", 64), None, reqs)
    with_host, sim = _tier_run(parse_config("colocated-1", 64), TierSpec(host_blocks=256, pcie_bytes_per_s=1e6), reqs)
    assert without["hit"] == pytest.approx(0.0)  # the device cache never holds a prefix when it returns
    # rounds 2 and 3 load back the 16 prefix blocks (a prompt is 17 blocks; the last holds the last prompt token)
    assert with_host["tiers"] > 0.5 and with_host["hit"] == pytest.approx(with_host["tiers"] + with_host["device"])
    assert with_host["tier_loads"] == 16 and with_host["tier_loaded_host_blocks"] == 16 * 16
    assert sim.workers["decode-0"].engine.load("both").tiers[0].blocks_total == 256  # the router sees the tier


def test_peer_fetch_brings_a_prefix_another_worker_holds():
    reqs = _tier_workload(num_prefixes=3, rounds=2)  # round robin puts each prefix's 2nd use on the other worker
    dep = parse_config("colocated-2", 64, "round_robin")
    no_peers, _ = _tier_run(dep, TierSpec(host_blocks=256), reqs)
    peers, _ = _tier_run(dep, TierSpec(host_blocks=256, peers=True), reqs)
    assert no_peers["hit"] == pytest.approx(0.0) and no_peers["peer_fetches"] == 0
    assert peers["peer_fetches"] == 3 and peers["peer_blocks"] == 3 * 16
    assert peers["peer"] == pytest.approx(peers["hit"]) and peers["hit"] > 0.4


def test_tier_feed_keeps_a_block_indexed_while_some_tier_holds_it():
    index, feed = PrefixIndex(), TierFeed()
    index.apply_all(feed.forward([BlockStored("w", (1, 2), None), BlockStored("w", (1, 2), None, Tier.HOST)]))
    index.apply_all(feed.forward([BlockRemoved("w", (1, 2))]))  # evicted from the device: still on the host
    assert match_total(index.match([1, 2]).get("w", 0)) == 2
    index.apply_all(feed.forward([BlockRemoved("w", (2,), Tier.HOST)]))
    assert match_total(index.match([1, 2]).get("w", 0)) == 1


def test_global_lru_reference_counts_token_hits_like_the_scheduler():
    B = 4
    a, b = tuple(range(1, 13)), tuple(range(100, 112))  # 3 blocks each
    hasher = BlockHasher(B)
    prompts = [(p, hasher(p)) for p in (a, b, a)]
    # capacity 6: the second `a` finds its blocks; only 2 of 3 count (the last prompt token's block is computed)
    assert global_lru_hit_rate(prompts, 6, B) == pytest.approx(2 * B / 36)
    assert global_lru_hit_rate(prompts, 3, B) == 0.0  # `b` evicted all of `a`


def test_a_draining_prefill_workers_handoffs_go_first_on_a_full_decode_worker():
    """As decode_worker/worker.py's ``pull_first``: the decode worker holds one request at a time (5 blocks) and the
    handoffs of both prefill workers wait for it. By default they are admitted in the order they came to wait;
    once a prefill worker drains, every handoff of it — those still queued on it included — goes before the other
    worker's, which came earlier. Every request completes."""
    reqs = [BenchRequest(prompt(40, 1000 * (i + 1)), 30, 0.01 * i) for i in range(8)]

    def run_sim(drain: bool) -> tuple[list[str], list[str], dict[str, str]]:
        sim = ClusterSim(parse_config("2P+1D", 0), hardware(num_blocks=5, net_s=0.001), reqs)
        waiting: list[str] = []

        def look(now):  # the handoffs waiting at decode now; the last one's prefill worker (maybe) drains
            (d,) = [w for w in sim.workers.values() if w.role == Role.DECODE]
            waiting.extend(f.rid for f in d.waiting_handoffs)
            if drain:
                sim.workers[sim.by_rid[waiting[-1]].prefill_worker].state = "draining"

        sim.at(2.0, look)
        res = sim.run()
        assert all(f.done_s is not None for f in res.flights)
        done = [f.rid for f in sorted(res.flights, key=lambda f: f.done_s)]
        return waiting, done, {f.rid: f.prefill_worker for f in res.flights}

    waiting, done, source = run_sim(drain=False)
    assert len({source[r] for r in waiting}) == 2  # both prefill workers' handoffs wait
    assert done == [f"r{i}" for i in range(len(reqs))]  # one at a time, in arrival order

    waiting, done, source = run_sim(drain=True)
    drained = source[waiting[-1]]
    (other, *_) = [r for r in waiting if source[r] != drained]  # waited before the drain began
    assert max(done.index(r) for r in source if source[r] == drained) < done.index(other)
