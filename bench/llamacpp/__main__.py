"""make bench-llamacpp: duet against llama.cpp built from source, on the same GGUF files, the same 2 threads, in one run.

    python -m bench.llamacpp [--small] [--models smollm2-q4_1,smollm2-q8_0,synthetic-1.5b-q4_k_m]
                             [--parts engine,serve] [--rounds N] [--report-only]

1. llama.cpp is built once into .cache/llama.cpp (bench/llamacpp/build.sh: the llama-cpp-python sdist's source,
   ``GGML_NATIVE``; a no-op once llama-bench, llama-server and llama-quantize exist).
2. The model files (bench/llamacpp/models.py): SmolLM2-135M-Instruct Q4_1 (duet's default file), the same weights
   at Q8_0, a synthetic Llama of 1.56 B parameters at Q4_K_M.
3. Per model, ``engine`` (bench/llamacpp/engine_side.py, llama_bench.py): batch-1 decode of 128 tokens and a
   512-token prefill, duet's engine in this process (``quantized_activations`` fp32, the default, and int8 where
   the file's types have an int8 kernel) against ``llama-bench -t 2``, alternated round by round (duet's modes,
   then llama-bench, for decode, then the same for prefill), best of ``--rounds`` per side; and the memory check
   of must-show 2: resident weight bytes against the file's tensor bytes (limit 1.15x).
4. Per model, ``serve`` (bench/llamacpp/serving.py): `duet serve` (1P+1D as `make run`, then colocated, then both
   again with ``--quantized-activations int8``: llama.cpp's accuracy class) against ``llama-server -np 32
   --cont-batching -t 2`` at 1 / 8 / 32 concurrent streams of the same requests; duet 1P+1D and llama-server are
   up together and alternate level by level, each other duet runs alone; peak RSS and the engines' KV sizes
   recorded. ``--servers`` picks some (disagg, llama, colocated, colocated-int8, disagg-int8).

Results: ``build/bench/llamacpp/<model>.json`` (``small/`` for --small), merged part by part, so one model or one
part can be re-run alone (each part records when it ran). The report (bench/llamacpp/report.py) covers every
model file in that folder; its last line is ``ratio: <batch-1 decode duet / llama.cpp, synthetic 1.5B Q4_K_M>``
(duet's default fp32 activations). Servers are stopped on every exit (error, SIGINT, SIGTERM).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.llamacpp import models as bench_models
from bench.llamacpp import report, serving
from bench.llamacpp.engine_side import decode_tok_s, make_engine, prefill_tok_s, resident_weight_bytes
from bench.llamacpp.llama_bench import run_llama_bench

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "build" / "bench" / "llamacpp"
BIN = REPO / ".cache" / "llama.cpp" / "build" / "bin"
THREADS = 2
DENSE_TYPES = ("F32", "F16", "BF16")


def build_llamacpp() -> None:
    subprocess.run(["bash", str(REPO / "bench" / "llamacpp" / "build.sh")], cwd=REPO, check=True)


def engine_part(model: bench_models.BenchModel, rounds: int) -> tuple[dict, dict]:
    """(the engine rows, the memory check) of ``model``."""
    from kernels.cpu_quant import INT8_FORMATS

    engines = {report.DUET_DEFAULT: make_engine(model.path, "fp32", THREADS)}
    resident = resident_weight_bytes(engines[report.DUET_DEFAULT].runner.model)
    notes = []
    if set(resident.packed_formats) & INT8_FORMATS:
        engines["duet int8"] = make_engine(model.path, "int8", THREADS)
    else:
        notes.append(f"duet int8 not run: the packed types ({', '.join(sorted(resident.packed_formats))}) have no int8 "
                     "kernel (kernels/cpu_quant.py INT8_FORMATS), so they run fp32 activations in either mode")
    for engine in engines.values():  # untimed warm-up: first touches, thread pools
        prefill_tok_s(engine, seed=10_000)
        decode_tok_s(engine, seed=10_001)
    sides = [*engines, report.LLAMA]
    runs = {"decode": {s: [] for s in sides}, "prefill": {s: [] for s in sides}}
    llama = None
    for r in range(rounds):
        for test, n_prompt, n_gen, fn in (("decode", 0, 128, decode_tok_s), ("prefill", 512, 0, prefill_tok_s)):
            for name, engine in engines.items():
                runs[test][name].append(fn(engine, seed=r))
            llama = run_llama_bench(BIN / "llama-bench", model.path, n_prompt=n_prompt, n_gen=n_gen, threads=THREADS)
            runs[test][report.LLAMA].append(llama.tok_s)
        print(f"  round {r + 1}/{rounds}: " + "; ".join(
            f"{t} " + ", ".join(f"{s} {v[-1]:.1f}" for s, v in runs[t].items()) for t in runs), flush=True)
    file_types = bench_models.file_tensor_bytes(model.path)
    file_total = sum(file_types.values())
    quantized = {t for t in file_types if t not in DENSE_TYPES}
    memory = {"resident": {"packed_bytes": resident.packed_bytes, "dense_bytes": resident.dense_bytes,
                           "total_bytes": resident.total_bytes, "packed_formats": resident.packed_formats},
              "file_tensor_bytes": file_total,
              "file_types": ", ".join(f"{t} {b / 2**20:.1f} MiB" for t, b in sorted(file_types.items())),
              "ratio": resident.total_bytes / file_total,
              "dequantized_types": sorted(quantized - set(resident.packed_formats)),
              "dense_over_file_dense": resident.dense_bytes - sum(file_types.get(t, 0) for t in DENSE_TYPES)}
    for engine in engines.values():
        engine.close()
    return {"rounds": rounds, "sides": sides, "threads": THREADS, "notes": notes, "ran_at": _now(),
            "llama_cpp": {"model_type": llama.model_type, "model_bytes": llama.model_bytes, "build": llama.build},
            **runs}, memory


SERVERS = ("disagg", "llama", "colocated", "colocated-int8", "disagg-int8")


def serve_part(model: bench_models.BenchModel, plan: serving.ServePlan, log_dir: Path,
               servers: tuple[str, ...] = SERVERS) -> dict:
    """The serving rows of ``servers`` (``SERVERS``' keys)."""
    from engine.loading.checkpoint import load_model_config

    vocab = load_model_config(str(model.path)).vocab_size
    level_reqs = {c: serving.serve_requests(vocab, n, plan.prompt_lens, plan.output_len, seed=c)
                  for c, n in plan.requests.items()}
    slots = max(plan.requests)
    starts = {"disagg": ("duet 1P+1D", lambda: serving.duet_server(model.path, "disagg", log_dir)),
              "llama": ("llama-server", lambda: serving.llama_server(BIN / "llama-server", model.path, log_dir,
                                                                     slots=slots, slot_context=plan.slot_context,
                                                                     threads=THREADS)),
              "colocated": ("duet colocated", lambda: serving.duet_server(model.path, "colocated", log_dir)),
              "colocated-int8": ("duet colocated int8", lambda: serving.duet_server(model.path, "colocated", log_dir,
                                                                                    activations="int8")),
              "disagg-int8": ("duet 1P+1D int8", lambda: serving.duet_server(model.path, "disagg", log_dir,
                                                                             activations="int8"))}
    # servers up together alternate level by level: duet 1P+1D with llama-server, then each other duet alone
    groups = [dict(starts[k] for k in keys if k in servers)
              for keys in (("disagg", "llama"), ("colocated",), ("colocated-int8",), ("disagg-int8",))]
    plan_doc = {"prompt_lens": plan.prompt_lens, "output_len": plan.output_len, "requests": plan.requests,
                "llama_server_slot_context": plan.slot_context}
    out = {"slo": serving.SLO, "plan": json.loads(json.dumps(plan_doc)),  # as it reads back from the file
           "runs": {}, "memory": {}, "kv": {}, "ready_s": {}, "failed_starts": {}, "killed_after_stop": {},
           "ran_at": _now()}
    for group in [g for g in groups if g]:
        servers = {}
        try:
            for name, start in group.items():
                servers[name], out["ready_s"][name], failed = serving.start_ready(start)
                if failed:
                    out["failed_starts"][name] = failed
            for c, reqs in level_reqs.items():
                for name, server in servers.items():
                    doc = serving.run_level(server, reqs, c, f"{name} x{c}")
                    out["runs"].setdefault(name, {})[str(c)] = doc
                    s = doc["summary"]
                    print(f"  {name:<15} {c:>2} streams: {s['output_throughput']:7.1f} output tok/s, TTFT p50 "
                          f"{s['ttft_s']['p50']:.2f} s, TPOT p50 {1e3 * (s['tpot_s']['p50'] or 0):.0f} ms, in SLO "
                          f"{doc['slo_output_tok_s']:.1f} tok/s" + (f"; {len(doc['count_errors'])} requests wrong: "
                                                                    f"{doc['count_errors'][:3]}" if doc["count_errors"]
                                                                    else ""), flush=True)
            for name, server in servers.items():
                out["memory"][name] = serving.process_tree_memory(server.proc.pid)
        finally:
            for name, server in servers.items():
                out["killed_after_stop"][name] = serving.stop_server(server)
                if name.startswith("duet"):
                    out["kv"][name] = serving.kv_sizes(server.log_path.read_text(errors="replace"))
    return out


def merge_serving(previous: dict | None, new: dict) -> dict:
    """``new`` serving rows over ``previous`` ones: the servers run now replace theirs, the others' stay (a run
    of some servers only); a different plan or SLO discards the previous rows."""
    if not previous or previous.get("plan") != new["plan"] or previous.get("slo") != new["slo"]:
        return new
    merged = dict(previous)
    for key in ("runs", "memory", "kv", "ready_s", "failed_starts", "killed_after_stop"):
        merged[key] = {**previous.get(key, {}), **new[key]}
    merged["ran_at"] = new["ran_at"]
    return merged


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def _sigterm(signum, frame):
    raise SystemExit(f"bench-llamacpp: signal {signum}: stopping the servers")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="a quick run: 2 rounds, short serving levels")
    ap.add_argument("--models", default=",".join(bench_models.MODEL_KEYS))
    ap.add_argument("--parts", default="engine,serve")
    ap.add_argument("--servers", default=",".join(SERVERS), help="the serving rows to run (the others' are kept)")
    ap.add_argument("--rounds", type=int, help="alternating rounds of the engine rows (default 5; --small 2)")
    ap.add_argument("--report-only", action="store_true", help="print the report of the saved results")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGTERM, _sigterm)
    out_dir = OUT / "small" if args.small else OUT
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = [k for k in args.models.split(",") if k]
    parts = set(args.parts.split(","))
    servers = tuple(k for k in args.servers.split(",") if k)
    unknown = [k for k in keys if k not in bench_models.MODEL_KEYS] + sorted(parts - {"engine", "serve"}) + \
        [k for k in servers if k not in SERVERS]
    if unknown:
        sys.exit(f"bench-llamacpp: unknown model or part: {', '.join(unknown)}")
    rounds = args.rounds or (2 if args.small else 5)
    if not args.report_only:
        build_llamacpp()
        for key in keys:
            model = bench_models.ensure_model(key, BIN / "llama-quantize")
            path = out_dir / f"{key}.json"
            res = json.loads(path.read_text()) if path.exists() else {}
            res.update(key=key, label=model.label, path=str(model.path), file_bytes=model.path.stat().st_size)
            print(f"{model.label}: {model.path} ({model.path.stat().st_size / 2**20:.0f} MiB)", flush=True)
            if "engine" in parts:
                res["engine"], res["memory"] = engine_part(model, rounds)
                path.write_text(json.dumps(res, indent=1))
            if "serve" in parts:
                plan = serving.plan_for(key == bench_models.LARGE, args.small)
                res["serving"] = merge_serving(res.get("serving"), serve_part(model, plan, out_dir, servers))
                path.write_text(json.dumps(res, indent=1))
    results = {}
    for key in bench_models.MODEL_KEYS:
        path = out_dir / f"{key}.json"
        if path.exists():
            results[key] = json.loads(path.read_text())
    print("\n".join(report.markdown(results)))
    print()
    print("\n".join(report.ratio_lines(results)))


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
