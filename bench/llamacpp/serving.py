"""bench-llamacpp's serving rows: `duet serve` vs ``llama-server`` on the same GGUF file, the same requests, the same
client (``duet bench``'s, bench/client.py: streaming ``/v1/completions`` with ``ignore_eos``, temperature 0, token-id
prompts, output tokens from the server's ``usage``), closed loop at 1 / 8 / 32 concurrent streams.

Servers (each in its own process group, its log in the output folder; bench/serve/servers.py ``ServerProcess``):
- ``duet 1P+1D``: what `make run` starts (``--prefill 1 --decode 1 --local-prefill-max-tokens 0``): two engine
  workers (Ray actors, 1 torch thread each: 2 threads in all), every prompt handed over prefill -> decode.
- ``duet colocated``: ``--colocated``, one engine in the server process, torch's 2 threads.
- ``llama-server``: ``-np 32 -c <32 x slot context> --cont-batching -t 2`` (``-tb`` defaults to ``-t``).
Plans (``ServePlan``): prompts of 128-256 random token ids, 128 output tokens, 8 / 32 / 64 requests at 1 / 8 / 32
streams (``FULL``); the 1.5B gets one wave per level (2 / 8 / 32 requests) of 64 output tokens (``FULL_LARGE``);
``--small``: 64-128-token prompts, 32 (1.5B: 16) output tokens.
Neither duet layout gets a KV size: each engine sizes its cache from the RAM left (engine/kv/sizing.py; the
server log's ``KV cache:`` lines are kept in the results), which is must-show 2's "serves with its KV budget from
what is left". Every request must return exactly its ``output_len`` tokens (``output_count_errors``).

``slo_output_tok_s``: output tokens of the requests that met both SLOs (bench/summary.py ``meets_slo``) per second
of the run: the throughput the SLOs let through, the same SLOs for every server. ``process_tree_memory``: peak
RSS (the kernel's VmHWM) and PSS of the server's processes, read at the end of its last (32-stream) level.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.summary import meets_slo
from bench.workloads import TOKEN_LO, BenchRequest

log = logging.getLogger(__name__)
# the project's CPU SLOs (bench/serve's defaults, the simulator's): TTFT 2 s + 10 ms per prompt token, TPOT 0.25 s
SLO = {"ttft_s": 2.0, "ttft_per_token_s": 0.01, "tpot_s": 0.25}
MODEL_NAME = "bench-model"
KV_LINE = re.compile(r"KV cache: (\d+) blocks of (\d+) tokens \(([^)]*)\) on (\w+): (.*)")  # an engine's own
WORKER_KV_LINE = re.compile(r"worker (\S+): (\d+) KV blocks of (\d+) tokens, context (\d+) tokens")  # the launcher's


@dataclass(frozen=True)
class ServePlan:
    prompt_lens: tuple[int, int] = (128, 256)  # uniform, inclusive
    output_len: int = 128
    requests: Mapping[int, int] = field(default_factory=lambda: {1: 8, 8: 32, 32: 64})  # per concurrency

    @property
    def slot_context(self) -> int:
        """llama-server's context per slot: the longest prompt and its output, in 16-token pages."""
        return -(-(self.prompt_lens[1] + self.output_len) // 16) * 16


FULL = ServePlan()
SMALL = ServePlan(prompt_lens=(64, 128), output_len=32, requests={1: 4, 8: 16, 32: 32})
# the 1.5B decodes ~10x slower here (2-15 tok/s at one stream): one wave of requests per level, shorter outputs
FULL_LARGE = ServePlan(output_len=64, requests={1: 2, 8: 8, 32: 32})
SMALL_LARGE = ServePlan(prompt_lens=(64, 128), output_len=16, requests={1: 2, 8: 8, 32: 32})


def plan_for(large: bool, small: bool) -> ServePlan:
    return {(False, False): FULL, (False, True): SMALL, (True, False): FULL_LARGE, (True, True): SMALL_LARGE}[
        (large, small)]


def serve_requests(vocab: int, num: int, prompt_lens: tuple[int, int], output_len: int,
                   seed: int) -> list[BenchRequest]:
    """``num`` prompts of uniformly random token ids and lengths in ``prompt_lens``, each asking ``output_len``."""
    rng = random.Random(seed)
    return [BenchRequest(tuple(rng.randrange(TOKEN_LO, vocab) for _ in range(rng.randint(*prompt_lens))), output_len)
            for _ in range(num)]


def slo_output_tok_s(requests: Sequence[Mapping], duration_s: float, slo: Mapping[str, float]) -> float:
    """Output tokens of the requests that met ``slo`` (completed, TTFT and TPOT within target) per second."""
    if duration_s <= 0:
        return 0.0
    return sum(r["output_tokens"] for r in requests if meets_slo(r, slo)) / duration_s


def output_count_errors(requests: Sequence[Mapping], asked: Sequence[BenchRequest]) -> list[str]:
    """One line per request that failed or returned another number of tokens than it asked for."""
    out = []
    for r, want in zip(requests, asked):
        if not r["ok"]:
            out.append(f"request {r['index']}: {r['error']}")
        elif r["output_tokens"] != want.output_len:
            out.append(f"request {r['index']}: {r['output_tokens']} tokens, asked {want.output_len}")
    return out


def kv_sizes(log_text: str) -> list[dict]:
    """The KV cache sizes a server's log states: an engine's ``KV cache:`` line (engine/kv/sizing.py: a colocated
    engine logs it in the server's log) or, for worker pools, the launcher's line per worker (cluster/launcher.py;
    the workers' own lines, with the reason, stay in Ray's worker logs)."""
    out = [{"engine": "colocated", "blocks": int(m[1]), "block_tokens": int(m[2]), "size": m[3], "reason": m[5].strip()}
           for m in KV_LINE.finditer(log_text)]
    return out + [{"engine": m[1], "blocks": int(m[2]), "block_tokens": int(m[3]), "context_tokens": int(m[4])}
                  for m in WORKER_KV_LINE.finditer(log_text)]


def duet_server(model: Path, layout: str, log_dir: Path, *, activations: str = "fp32"):
    from bench.serve.servers import REPO, ServerProcess, free_port
    from engine.model_runner import with_huge_page_malloc

    port = free_port()
    argv = [str(REPO / ".venv" / "bin" / "duet"), "serve", "--model", str(model), "--served-model-name", MODEL_NAME,
            "--port", str(port), "--grpc-port", str(free_port()), "--quantized-activations", activations]
    argv += ["--colocated"] if layout == "colocated" else \
        ["--prefill", "1", "--decode", "1", "--local-prefill-max-tokens", "0"]  # `make run`'s layout
    env = with_huge_page_malloc(dict(os.environ, RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="2"))
    tag = layout + ("" if activations == "fp32" else f"-{activations}")
    return ServerProcess(f"duet-{tag}", argv, port, log_dir / f"server-duet-{tag}-{model.stem}.log",
                         MODEL_NAME, env=env, starts_ray=layout != "colocated")


def llama_server(binary: Path, model: Path, log_dir: Path, *, slots: int, slot_context: int, threads: int):
    from bench.serve.servers import ServerProcess, free_port

    port = free_port()
    argv = [str(binary), "-m", str(model), "--alias", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * slot_context), "--cont-batching", "-t", str(threads)]
    return ServerProcess("llama-server", argv, port, log_dir / f"server-llama-{model.stem}.log", MODEL_NAME)


def start_ready(start, timeout_s: float = 900) -> tuple[object, float, list[str]]:
    """``start()``'s server once it is ready: (server, seconds to ready, the failed starts' logs). A server that
    exits while starting is started once more (logged, and returned for the results): `duet serve` died once
    here at start-up with glibc's "munmap_chunk(): invalid pointer" before its first log line, and started
    the next time."""
    failures: list[str] = []
    for attempt in range(2):
        server = start()
        try:
            return server, server.wait_ready(timeout_s), failures
        except RuntimeError as e:
            stop_server(server)
            if server.proc.poll() is None or attempt == 1:  # not ready in time, or the second exit: give up
                raise
            failures.append(str(e))
            log.warning("%s exited while starting; starting it once more: %s", server.name, e)
    raise AssertionError("unreachable")


def run_level(server, reqs: list[BenchRequest], concurrency: int, label: str) -> dict:
    """One closed-loop run of ``reqs`` at ``concurrency`` streams (one warm-up request first)."""
    from bench.client import run

    doc = asyncio.run(run(server.base_url, reqs, model=MODEL_NAME, max_concurrency=concurrency,
                          slo_ttft_s=SLO["ttft_s"], slo_tpot_s=SLO["tpot_s"], warmups=1, progress=False,
                          label=label))
    from bench.summary import summarize

    doc["slo"], doc["summary"] = SLO, summarize(doc["requests"], doc["duration_s"], SLO)
    doc["slo_output_tok_s"] = slo_output_tok_s(doc["requests"], doc["duration_s"], SLO)
    doc["count_errors"] = output_count_errors(doc["requests"], reqs)
    return doc


def process_tree_memory(pid: int) -> dict:
    """Peak RSS (VmHWM) and PSS now of ``pid`` and its descendants, each process and summed."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"processes": [], "hwm_bytes": 0, "pss_bytes": 0}
    rows = []
    for p in procs:
        try:
            status = Path(f"/proc/{p.pid}/status").read_text()
            hwm = int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) * 1024
            pss = p.memory_full_info().pss
            rows.append({"pid": p.pid, "name": " ".join(p.cmdline()[:3])[:120], "hwm_bytes": hwm, "pss_bytes": pss})
        except (psutil.Error, OSError, TypeError):  # ended meanwhile
            continue
    return {"processes": rows, "hwm_bytes": sum(r["hwm_bytes"] for r in rows),
            "pss_bytes": sum(r["pss_bytes"] for r in rows)}


def stop_server(server) -> list[int]:
    """SIGINT the server's group (its own shutdown ends the Ray it started), then SIGKILL any process of its tree
    still alive, by pid; those pids returned. Never ``ray stop``: another session's Ray may run here."""
    import psutil

    try:
        tree = psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    server.stop(stop_ray=False)
    killed = []
    for p in tree:
        try:
            p.kill()
            killed.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return killed
