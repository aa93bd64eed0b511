"""The whole server under load, side by side: duet disaggregated, duet colocated and vLLM's CPU build,
compared by DistServe goodput found by search.

    make bench-serve            # python -m bench.serve [--small] [--only duet-colocated,vllm-cpu] [--skip-vllm]
                                #   [--start-rate R] [--max-probes N] [--ceiling-rate R] [--replot]

Every configuration serves the same model (SmolLM2-135M-Instruct, the default GGUF dequantized to an fp32
Hugging Face directory: bench/hf_model.py) on this machine, one at a time (bench/serve/servers.py), and gets
the same workloads through the same clients (bench/serve/clients.py):

- ``random`` (fixed input/output lengths) and ``shared-prefix`` (a few long shared prefixes + a short
  suffix), driven by **vLLM's own client** (``vllm.benchmarks.serve``, datasets ``random`` and
  ``prefix_repetition``), Poisson arrivals at rates chosen by the **goodput search** below;
- ``trace``: the Mooncake conversation trace, scaled (bench/workloads.py), replayed at its own arrival
  times by **``duet bench``** (bench/client.py), which no established client does offline: its attainment
  and goodput at those times are reported, no rate is searched;
- ``agreement``: both clients on one common workload (the same text prompts, vLLM's ``custom`` format,
  closed loop at a fixed concurrency) against the same server, twice each, alternating, so the difference
  between clients can be told from run-to-run noise;
- ``routing``: duet with 2 prefill + 1 decode workers, ``cache_aware`` vs ``round_robin`` prefill routing
  on a shared-prefix workload with more prefixes than one worker's cache holds comfortably.

**Goodput is DistServe's** (bench/goodput_search.py, the definition the simulator uses too): the highest
request rate at which >= 90 % of requests meet both TTFT <= ``--slo-ttft-s`` + ``--slo-ttft-per-token-s`` x the
prompt's tokens and TPOT <= ``--slo-tpot-s`` (the simulator's CPU SLOs: 2 s + 10 ms/token, 0.25 s).
Per configuration and workload the rate is searched (``goodput_search.search_rate``): from ``start_rps``
multiplied by ``growth`` while probes pass, then bisected between the last passing and the first failing
rate until they are ``resolution`` apart, at most ``max_probes`` probes, never above ``ceiling_rps``
(``make_plan`` has the numbers). Each probe is one run of vLLM's client of at least ``probe_min_requests``
requests and ``probe_min_s`` seconds of arrivals, on prompts of its own (a new seed per probe, the same
seeds for every server), so no probe starts on a prefix cache warmed by the previous one. A search whose
first probe fails reports "< start" (0 in a ratio); one that passes at the ceiling, ">= ceiling".

Outputs under ``build/bench/serve/``: one JSON per run (every probe), ``report.json`` (everything, with
each search's probes), ``report.md`` (the tables; bench/serve/report.py), and PNG plots (attainment vs rate
with the 90 % line, latency CDFs, per-config bars, routing; bench/serve/plots.py). Printed at the end: one
line per workload with each configuration's goodput, then, last, ``ratio: <duet's best goodput
(disaggregated or colocated) / vLLM CPU's goodput>`` on the shared-prefix workload.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench import workloads
from bench.client import run as duet_bench_run
from bench.goodput_search import RateSearch, search_rate
from bench.hf_model import DEFAULT_DIR as HF_DIR
from bench.hf_model import ensure_hf_model
from bench.serve.clients import agreement_workload, compare_clients, run_duet_client, run_vllm_client
from bench.serve.report import machine, markdown, ms_text, summary_lines
from bench.serve.servers import MODEL_NAME, REPO, VLLM_VENV, Server, ServerSpec, prefill_stats

OUT = REPO / "build" / "bench" / "serve"


@dataclass(frozen=True)
class Plan:
    search: RateSearch
    probe_min_requests: int  # per probe: at least this many requests ...
    probe_min_s: float  # ... and at least this many seconds of arrivals at the probe's rate
    random: dict
    shared: dict
    trace: dict
    agreement_num: int
    agreement_input_len: int
    agreement_output_len: int
    agreement_concurrencies: list[int]
    routing: dict
    routing_rate: float

    def probe_requests(self, rate_rps: float) -> int:
        return max(self.probe_min_requests, math.ceil(rate_rps * self.probe_min_s))


def make_plan(small: bool, *, start_rps: float | None = None, max_probes: int | None = None,
              ceiling_rps: float | None = None) -> Plan:
    if small:
        plan = Plan(search=RateSearch(start_rps=0.5, growth=2.0, resolution=1.25, ceiling_rps=8.0, max_probes=5),
                    probe_min_requests=16, probe_min_s=20.0,
                    random={"name": "random", "input_len": 256, "output_len": 32},
                    shared={"name": "shared-prefix", "num_prefixes": 2, "prefix_len": 512, "suffix_len": 32,
                            "output_len": 32},
                    trace={"limit": 16, "time_scale": 6.0}, agreement_num=8, agreement_input_len=128,
                    agreement_output_len=16, agreement_concurrencies=[1],
                    routing={"num": 16, "num_prefixes": 4, "prefix_len": 512, "suffix_len": 32, "output_len": 8},
                    routing_rate=2.0)
    else:
        # the old fixed sweep (0.25-2 req/s) put the knees between 0.5 and 2 req/s on this CPU: start below
        plan = Plan(search=RateSearch(start_rps=0.25, growth=2.0, resolution=1.1, ceiling_rps=8.0, max_probes=9),
                    probe_min_requests=40, probe_min_s=60.0,
                    random={"name": "random", "input_len": 256, "output_len": 64},
                    shared={"name": "shared-prefix", "num_prefixes": 4, "prefix_len": 512, "suffix_len": 32,
                            "output_len": 64},
                    trace={"limit": 40, "time_scale": 8.0}, agreement_num=24, agreement_input_len=256,
                    agreement_output_len=32, agreement_concurrencies=[1, 4],
                    routing={"num": 48, "num_prefixes": 8, "prefix_len": 512, "suffix_len": 32, "output_len": 16},
                    routing_rate=1.0)
    bounds = {k: v for k, v in (("start_rps", start_rps), ("max_probes", max_probes), ("ceiling_rps", ceiling_rps))
              if v is not None}
    return dataclasses.replace(plan, search=dataclasses.replace(plan.search, **bounds)) if bounds else plan


class Bench:
    def __init__(self, args):
        self.args = args
        self.plan = make_plan(args.small, start_rps=args.start_rate, max_probes=args.max_probes,
                              ceiling_rps=args.ceiling_rate)
        self.slo = {"ttft_s": args.slo_ttft_s, "ttft_per_token_s": args.slo_ttft_per_token_s, "tpot_s": args.slo_tpot_s}
        # the trace's prompts run to 2,048 tokens (a few seconds of prefill on a CPU): its own TTFT target
        self.trace_slo = self.slo
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.runs: list[dict] = []
        self.searches: dict[str, dict[str, dict]] = {}  # workload -> config -> search (goodput and probes)
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
        self.say(f"  {name}: {s['completed']}/{s['completed'] + s['failed']} ok, attainment "
                 f"{s['good_fraction'] * 100:.0f} %, goodput {s['goodput']:.3f} req/s, "
                 f"{s['output_throughput']:.1f} tok/s, TTFT p50 {ms_text(s['ttft_s']['p50'])}, "
                 f"TPOT p50 {ms_text(s['tpot_s']['p50'])}")
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
            for short, workload in (("random", p.random), ("shared", p.shared)):
                self.search(server, spec, short, workload)
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

    def search(self, server: Server, spec: ServerSpec, short: str, workload: dict) -> dict:
        """``spec``'s DistServe goodput on ``workload``: probes chosen by ``search_rate``, each a run of
        vLLM's client on prompts of its own (seed = probe number: the same seeds for every server)."""
        probes: list[dict] = []

        def measure(rate_rps: float) -> float:
            i, num = len(probes), self.plan.probe_requests(rate_rps)
            name = f"{spec.name}-{short}-p{i}-{rate_rps:g}"
            self.say(f"{spec.name}: {workload['name']} probe {i + 1}, x{num} at {rate_rps:g} req/s (vLLM's client)")
            doc = run_vllm_client(server, dict(workload, num_requests=num), rate_rps, self.slo,
                                  self.out / f"{name}.json", num=num, seed=i)
            self.record(spec, doc, name, rate=rate_rps, probe=i)
            s = doc["summary"]
            probes.append({"rate_rps": rate_rps, "attainment": s["good_fraction"], "num_requests": num,
                           "ttft_p90_s": s["ttft_s"]["p90"], "tpot_p90_s": s["tpot_s"]["p90"], "file": f"{name}.json"})
            return s["good_fraction"]

        result = search_rate(measure, self.plan.search)
        found = {**result.to_dict(), "probes": probes}
        self.searches.setdefault(workload["name"], {})[spec.name] = found
        self.say(f"  {spec.name} {workload['name']}: goodput {result.label()} req/s ({result.stopped}, "
                 f"{len(probes)} probes)")
        return found

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
                  "searches": {}, "agreement": self.agreement_result, "routing": None}
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
        from bench.serve.plots import plot_all
        pngs = plot_all(report, self.out)
        self.say("plots: " + ", ".join(str(p) for p in pngs))
        print(report["markdown"])
        print("\n".join(report["workload_lines"]))
        print(report["ratio_line"])
        return 0

    def report(self, elapsed_s: float) -> dict:
        report = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "elapsed_s": elapsed_s,
                  "command": " ".join(sys.argv), "slo": self.slo, "trace_slo": self.trace_slo,
                  "plan": dataclasses.asdict(self.plan), "runs": self.runs, "searches": self.searches,
                  "agreement": self.agreement_result, "routing": self.routing_result}
        *report["workload_lines"], report["ratio_line"] = summary_lines(report)
        report["markdown"] = markdown(report)
        (self.out / "report.json").write_text(json.dumps(report, indent=1))
        (self.out / "report.md").write_text("\n".join([report["markdown"], "", *report["workload_lines"],
                                                       report["ratio_line"]]) + "\n")
        return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true",
                   help="fewer requests per probe, fewer probes, coarser resolution (about 35-40 minutes)")
    p.add_argument("--only", help="comma-separated config names (duet-disagg-1p1d, duet-colocated, vllm-cpu)")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-agreement", action="store_true")
    p.add_argument("--agreement-only", action="store_true",
                   help="only the client comparison on duet-colocated (agreement.json / agreement.md in --out)")
    p.add_argument("--skip-routing", action="store_true")
    # the simulator's CPU SLOs (bench/sim/goodput_study.py GOODPUT_SLO): TTFT <= 2 s + 10 ms x prompt tokens,
    # TPOT 0.25 s — a flat 2 s failed duet's first probe at 0.25 req/s: one 256-token prefill takes ~1 s on 2 vCPUs, two
    # that collide break it (docs/benchmarks.md)
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-ttft-per-token-s", type=float, default=0.01)
    p.add_argument("--slo-tpot-s", type=float, default=0.25)
    p.add_argument("--start-rate", type=float, help="the goodput search's first probe rate, req/s")
    p.add_argument("--max-probes", type=int, help="probes per goodput search (configuration x workload)")
    p.add_argument("--ceiling-rate", type=float, help="the goodput search never probes above this rate, req/s")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--replot", action="store_true", help="only redraw the plots of the report in --out")
    args = p.parse_args(argv)
    if args.replot:
        from bench.serve.plots import plot_all
        report = json.loads((Path(args.out) / "report.json").read_text())
        print("\n".join(str(x) for x in plot_all(report, Path(args.out))))
        print(report["markdown"])
        print("\n".join(report.get("workload_lines", [])))
        print(report["ratio_line"])
        return 0
    # vLLM's venv runs vLLM's client too (random, shared-prefix, agreement), so --skip-vllm still needs it
    if not (VLLM_VENV / "bin" / "python").exists():
        print(f"vLLM's venv is missing: run bench/install_vllm.sh {VLLM_VENV} (make bench-serve does)", file=sys.stderr)
        return 2
    return Bench(args).main()


if __name__ == "__main__":
    sys.exit(main())
