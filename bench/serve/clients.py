"""bench-serve's clients: vLLM's own benchmark client (``vllm.benchmarks.serve``, run in vLLM's venv) and
``duet bench`` (bench/client.py), both returning duet bench's run document (per-request records and the
summary of bench/summary.py), and the comparison of the two on one workload."""
from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
from pathlib import Path

from bench import summary as metrics
from bench import workloads
from bench.client import RequestResult
from bench.client import run as duet_bench_run
from bench.hf_model import DEFAULT_DIR as HF_DIR
from bench.serve.servers import MODEL_NAME, REPO, VLLM_VENV, Server
from bench.summary import percentile, tpot_of

# vLLM's client as a module call: its `vllm` console script fails on a distribution-metadata lookup here
VLLM_CLIENT = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
               "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
               "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def run_vllm_client(server: Server, workload: dict, rate: float, slo: dict, out_json: Path, *,
                    num: int, seed: int = 0, max_concurrency: int | None = None, warmups: int = 1) -> dict:
    """vLLM's benchmark client against ``server``; returns its result converted to duet bench's document."""
    args = ["--backend", "openai", "--endpoint", "/v1/completions", "--base-url", server.base_url,
            "--model", MODEL_NAME, "--tokenizer", str(HF_DIR), "--num-prompts", str(num),
            "--request-rate", "inf" if math.isinf(rate) else str(rate), "--seed", str(seed), "--ignore-eos",
            "--temperature", "0", "--num-warmups", str(warmups),
            "--goodput", f"ttft:{slo['ttft_s'] * 1000:g}", f"tpot:{slo['tpot_s'] * 1000:g}",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(out_json.parent),
            "--result-filename", out_json.name + ".vllm.json", "--ready-check-timeout-sec", "0"]
    if max_concurrency:
        args += ["--max-concurrency", str(max_concurrency)]
    name = workload["name"]
    if name == "random":
        args += ["--dataset-name", "random", "--random-input-len", str(workload["input_len"]),
                 "--random-output-len", str(workload["output_len"]), "--random-range-ratio", "0"]
    elif name == "shared-prefix":
        args += ["--dataset-name", "prefix_repetition",
                 "--prefix-repetition-prefix-len", str(workload["prefix_len"]),
                 "--prefix-repetition-suffix-len", str(workload["suffix_len"]),
                 "--prefix-repetition-num-prefixes", str(workload["num_prefixes"]),
                 "--prefix-repetition-output-len", str(workload["output_len"])]
    elif name == "file":
        args += ["--dataset-name", "custom", "--dataset-path", workload["path"], "--skip-chat-template",
                 "--custom-output-len", "-1"]
    else:
        raise ValueError(f"vLLM's client has no dataset for {name!r}")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    log = out_json.with_suffix(".client.log")
    with open(log, "w") as f:
        p = subprocess.run([str(VLLM_VENV / "bin" / "python"), "-c", VLLM_CLIENT, *args], stdout=f,
                           stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(f"vLLM's client failed ({p.returncode}); see {log}:\n"
                           + "\n".join(log.read_text().splitlines()[-20:]))
    raw = json.loads((out_json.parent / (out_json.name + ".vllm.json")).read_text())
    return from_vllm_result(raw, slo, workload, rate)


def from_vllm_result(raw: dict, slo: dict, workload: dict, rate: float) -> dict:
    """vLLM's detailed result → duet bench's document (same per-request fields, same summary code)."""
    starts = raw["start_times"]
    t0 = min(starts) if starts else 0.0
    results = []
    for i, (ttft, itl, lat, out, inp, err) in enumerate(zip(raw["ttfts"], raw["itls"], raw["latencies"],
                                                          raw["output_lens"], raw["input_lens"], raw["errors"])):
        ok = not err and ttft is not None and ttft > 0
        results.append(RequestResult(i, starts[i] - t0, inp, out if ok else 0, ttft if ok else None,
                                     tpot_of(lat, ttft, out) if ok else None, lat if ok else None,
                                     list(itl) if ok else [], ok, err or None))
    doc = {"client": "vllm.benchmarks.serve", "slo": slo, "duration_s": raw["duration"],
           "schedule": {"request_rate": "inf" if math.isinf(rate) else rate},
           "summary": metrics.summarize([r.__dict__ for r in results], raw["duration"], slo),
           "vllm_summary": {k: raw.get(k) for k in ("completed", "failed", "request_throughput", "request_goodput",
                                                   "output_throughput", "mean_ttft_ms", "mean_tpot_ms",
                                                   "mean_itl_ms", "median_ttft_ms", "p99_ttft_ms")},
           "requests": [r.__dict__ for r in results], "workload": workload}
    return doc


def run_duet_client(server: Server, reqs: list, workload: dict, slo: dict, out_json: Path, *, rate: float = math.inf,
                    max_concurrency: int | None = None, warmups: int = 1, label: str = "") -> dict:
    doc = asyncio.run(duet_bench_run(server.base_url, reqs, model=MODEL_NAME, rate=rate,
                                     max_concurrency=max_concurrency, slo_ttft_s=slo["ttft_s"],
                                     slo_tpot_s=slo["tpot_s"], warmups=warmups, label=label))
    doc["client"] = "duet bench"
    doc["workload"] = workload
    # judged like vLLM's client's runs: the whole SLO (a TTFT target that grows with the prompt included)
    doc["slo"], doc["summary"] = slo, metrics.summarize(doc["requests"], doc["duration_s"], slo)
    return doc


def agreement_workload(path: Path, num: int, input_len: int, output_len: int, seed: int = 7) -> Path:
    """The common workload of the client comparison, in vLLM's `custom` format: text prompts (random token
    ids decoded by the model's tokenizer), each with its output length."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(HF_DIR / "tokenizer.json"))
    reqs = workloads.random_requests(vocab=tok.get_vocab_size(), num=num, input_len=input_len,
                                     output_len=output_len, seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps({"prompt": tok.decode(list(r.prompt)), "output_tokens": r.output_len}) + "\n")
    return path


def compare_clients(docs: dict[str, list[dict]]) -> dict:
    """Per client and metric (mean TTFT / TPOT / ITL, output throughput): every run's value; the gap between
    the clients' medians, ``(duet bench - vLLM) / vLLM``; and the noise, the largest spread
    ``(max - min) / median`` of one client's own runs: the yardstick the gap is judged against."""
    keys = {"ttft_mean_s": lambda s: s["ttft_s"]["mean"], "tpot_mean_s": lambda s: s["tpot_s"]["mean"],
            "itl_mean_s": lambda s: s["itl_s"]["mean"], "output_throughput": lambda s: s["output_throughput"]}
    table = {client: {k: [f(r["summary"]) for r in runs] for k, f in keys.items()} for client, runs in docs.items()}
    out = {"per_run": table, "gap": {}, "noise": {}}
    a, b = table["duet bench"], table["vllm.benchmarks.serve"]
    for k in keys:
        out["gap"][k] = (_median(a[k]) - _median(b[k])) / _median(b[k])
        out["noise"][k] = max((max(v) - min(v)) / _median(v) for v in (a[k], b[k])) if len(a[k]) > 1 else None
    return out


def _median(xs: list[float]) -> float:
    return percentile(xs, 50)
