"""Calibration check: simulate the workload and configuration of a real run and compare, field by field.

    python -m bench.sim calibration-check --real REAL.json [--workload W.jsonl] [--threads N]

``REAL.json`` is what ``duet bench`` writes (bench/client.py). From it:
- the configuration: ``config.kind`` ``duet-colocated`` with no pool sizes is ``duet serve --colocated``,
  ONE in-process engine; otherwise ``config.prefill`` P + ``config.decode`` D Ray workers of 1 thread each;
  routing policies and ``--local-prefill-max-tokens`` from ``config`` or its ``extra_args`` (default:
  cache_aware, 64 — ``duet serve``'s defaults). The step model is the 1-thread fit in both cases
  (``--threads`` to change): the in-process engine runs torch's default 2 threads, but beside the HTTP
  server in its process and the client on the same 2 cores it ran like the 1-thread fit (on the
  ``random`` runs of bench/serve/__main__.py, TPOT within 9–17 %; the 2-thread fit was 40–70 % fast);
- the workload: ``--workload`` (bench.workloads JSONL); for the Mooncake trace, ``scaled_trace`` rebuilt from
  ``workload``'s parameters (exact); ``shared-prefix``: the same structure from bench.workloads (which request
  drew which prefix may differ); anything else (``random``): prompts of the recorded lengths that share
  nothing. Prompt lengths must match the real requests;
- arrivals: the real requests' ``arrival_s`` (when the client actually sent them);
- the SLOs: ``slo``.
Reported: relative error (sim − real) / real of TTFT and TPOT mean/p50/p90, of request and output
throughput and of goodput; the simulated document is written beside the comparison.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

from bench import workloads
from bench.sim.cluster import Deployment
from bench.sim.scenarios import SMOLLM2_VOCAB, cpu_hardware, simulate_run
from bench.workloads import BenchRequest

METRICS = [("ttft_s", q) for q in ("mean", "p50", "p90")] + [("tpot_s", q) for q in ("mean", "p50", "p90")]
RATES = ("request_throughput", "output_throughput", "goodput")
DUET_DEFAULT_LOCAL_PREFILL = 64  # RouterConfig.local_prefill_max_tokens


def _extra(cfg: dict, flag: str) -> str | None:
    args = list(cfg.get("extra_args") or ())
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def deployment_of(cfg: dict) -> tuple[Deployment, bool]:
    """(the simulated deployment, whether it is one in-process engine) for a real run's ``config``."""
    policy = lambda role: cfg.get(f"{role}_policy") or _extra(cfg, f"--{role}-policy") or "cache_aware"  # noqa: E731
    local = cfg.get("local_prefill_max_tokens")
    if local is None:
        local = _extra(cfg, "--local-prefill-max-tokens")
    local = DUET_DEFAULT_LOCAL_PREFILL if local is None else int(local)
    p, d = int(cfg.get("prefill") or 0), int(cfg.get("decode") or 0)
    if cfg.get("kind") == "duet-colocated":
        in_process = d == 0
        return Deployment(cfg.get("name", "colocated"), 0, max(d, 1), policy("prefill"), policy("decode"), local), \
            in_process
    if d < 1:
        raise ValueError(f"config {cfg.get('name')!r}: a disaggregated run needs decode >= 1")
    return Deployment(cfg.get("name", f"{p}P+{d}D"), p, d, policy("prefill"), policy("decode"), local), False


def workload_of(real: dict, workload_file: Path | None) -> tuple[list, str]:
    """(the real run's requests as BenchRequests with its send times, how exactly they were rebuilt)."""
    w = dict(real["workload"])
    real_reqs = sorted(real["requests"], key=lambda r: r["index"])
    if workload_file is not None:
        reqs, how = workloads.load(workload_file), "exact (workload file)"
    elif str(w.get("name", "")).startswith("mooncake"):
        known = set(inspect.signature(workloads.scaled_trace).parameters)
        kw = {k: v for k, v in w.items() if k in known and k != "path"}
        kw.setdefault("vocab", SMOLLM2_VOCAB)
        reqs, how = workloads.scaled_trace(**kw), "exact (scaled_trace rebuilt from its parameters)"
    elif w.get("name") == "shared-prefix":
        reqs = workloads.shared_prefix_requests(
            vocab=w.get("vocab", SMOLLM2_VOCAB), num=len(real_reqs), num_prefixes=w["num_prefixes"],
            prefix_len=w["prefix_len"], suffix_len=w["suffix_len"], output_len=w["output_len"], seed=w.get("seed", 0))
        how = "same structure (which request got which prefix may differ from the client's)"
    else:  # random prompts share nothing: their lengths are all that matters
        out_len = w.get("output_len")
        reqs = [BenchRequest(tuple(_unique_tokens(r["index"], r["prompt_tokens"])),
                             out_len or max(1, r["output_tokens"])) for r in real_reqs]
        how = "lengths only (prompts that share no prefix)"
    if len(real_reqs) != len(reqs):
        raise ValueError(f"the real run has {len(real_reqs)} requests, the workload {len(reqs)}")
    out = []
    for req, rr in zip(reqs, real_reqs):
        if rr.get("prompt_tokens") not in (None, len(req.prompt)):
            raise ValueError(f"request {rr['index']}: real prompt {rr['prompt_tokens']} tokens, workload {len(req.prompt)}")
        out.append(dataclasses.replace(req, arrival_s=rr.get("arrival_s", req.arrival_s)))
    return out, how


def _unique_tokens(index: int, n: int) -> range:
    return range(1 + index * 1_000_003, 1 + index * 1_000_003 + n)


def compare(real: dict, sim: dict) -> list[dict]:
    rows = []
    for key, q in METRICS:
        rows.append(_err(f"{key[:-2]} {q}", real["summary"][key][q], sim["summary"][key][q]))
    for key in RATES:
        rows.append(_err(key, real["summary"][key], sim["summary"][key]))
    return rows


def _err(name: str, real: float | None, sim: float | None) -> dict:
    rel = (sim - real) / real if real not in (None, 0) and sim is not None else None
    return {"metric": name, "real": real, "sim": sim, "rel_err": rel}


def calibration_check(real_path: Path, workload_file: Path | None, threads: int | None, calibration: Path,
                      out_dir: Path) -> dict:
    real = json.loads(Path(real_path).read_text())
    missing = {"config", "workload", "slo", "summary", "requests"} - set(real)
    if missing:
        raise ValueError(f"{real_path} is not a benchmark document (duet bench's JSON): no {sorted(missing)}")
    dep, in_process = deployment_of(real["config"])
    threads = threads or 1  # in-process too: module docstring
    hw = cpu_hardware(calibration, threads)
    kv_bytes = real["config"].get("kv_cache_bytes_per_engine")
    if kv_bytes:  # bench_serve gives every engine the same KV budget: simulate that many blocks
        hw = dataclasses.replace(hw, num_blocks=max(2, kv_bytes // hw.transfer.bytes_per_block))
    if in_process:  # no Ray between router and engine: an asyncio hop
        hw = dataclasses.replace(hw, net_s=1e-4)
    reqs, how = workload_of(real, workload_file)
    sim = simulate_run(dep, hw, reqs, real["workload"], real["slo"])
    rows = compare(real, sim)
    print(f"calibration check: {real_path} ({real['config'].get('name')}, {len(reqs)} requests) vs simulated "
          f"{dep.prefill}P+{dep.decode}D{' in-process' if in_process else ''}, {threads} thread(s)/worker; "
          f"workload: {how}")
    print("| metric | real | sim | (sim-real)/real |\n|---|---|---|---|")
    for r in rows:
        fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        rel = "-" if r["rel_err"] is None else f"{r['rel_err']:+.0%}"
        print(f"| {r['metric']} | {fmt(r['real'])} | {fmt(r['sim'])} | {rel} |")
    result = {"real": str(real_path), "config": real["config"], "threads": threads, "workload_rebuilt": how,
              "rows": rows, "sim": sim}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"calibration-check-{Path(real_path).stem}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return result
