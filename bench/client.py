"""``duet bench``: drive an OpenAI-compatible server (duet, vLLM, anything) with a workload and measure it.

    duet bench --base-url http://127.0.0.1:8000 --workload random --num-requests 48 --input-len 256 \
        --output-len 64 --request-rate 1 --slo-ttft-s 2 --slo-tpot-s 0.25 --result-file out.json
    duet bench --workload trace --trace-limit 64 --time-scale 4      # Mooncake trace at its own arrival times
    duet bench --workload-file prompts.jsonl --max-concurrency 4     # ours, or vLLM's `custom` JSONL format

Each request is a streaming ``/v1/completions`` call (``stream_options.include_usage``, ``ignore_eos``,
temperature 0) with a token-id or text prompt. The metrics are defined exactly as vLLM's
``vllm.benchmarks.serve`` defines them, so the two clients can be compared on one workload:

- TTFT: send → the first SSE chunk that carries ``choices`` (even with empty text);
- ITL: the gaps between consecutive ``choices`` chunks;
- end-to-end latency: send → the last ``choices`` chunk;
- output tokens: the server's ``usage.completion_tokens`` (1 if it sent none), in a chunk of its own (duet, vLLM)
  or in the last chunk with ``choices`` (llama-server);
- TPOT: ``(e2e - TTFT) / (output tokens - 1)`` for requests with more than one output token;
- duration: the start of the run → the last request done; throughput = tokens / duration;
- goodput: requests that meet both ``--slo-ttft-s`` and ``--slo-tpot-s`` (a request with one output token
  meets any TPOT target), per second of duration. Failed requests are never good.

Schedule: a trace workload is sent at its own arrival times; otherwise ``--request-rate`` (Poisson, or
gamma with ``--burstiness``; ``inf`` = all at once), in both cases at most ``--max-concurrency`` in flight.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import summary as metrics
from bench import workloads
from bench.workloads import BenchRequest


@dataclass
class RequestResult:
    index: int
    arrival_s: float  # when it was sent, from the start of the run
    prompt_tokens: int | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    ok: bool = False
    error: str | None = None


def summarize(results: list[RequestResult], duration_s: float, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """bench/summary.py's summary (shared with the simulator) of this run's results."""
    return metrics.summarize([asdict(r) for r in results], duration_s, {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
                             itl_s=[x for r in results if r.ok for x in r.itl_s])


class BenchError(Exception):
    pass


async def _one(client, url: str, model: str, req: BenchRequest, res: RequestResult, timeout_s: float,
               headers: dict) -> None:
    payload = {"model": model, "prompt": list(req.prompt) if isinstance(req.prompt, tuple) else req.prompt,
               "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}, "ignore_eos": True}
    st = time.perf_counter()
    last = st
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=payload, headers=headers) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode("utf-8", "replace")
                    res.error = f"HTTP {resp.status_code}: {body[:300]}"
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    msg = json.loads(data)
                    if "error" in msg:
                        res.error = f"stream error: {json.dumps(msg['error'])[:300]}"
                        return
                    if msg.get("choices"):
                        now = time.perf_counter()
                        if res.ttft_s is None:
                            res.ttft_s = now - st
                        else:
                            res.itl_s.append(now - last)
                        last = now
                    if msg.get("usage"):  # its own chunk (duet, vLLM) or the last one with choices (llama-server)
                        res.output_tokens = msg["usage"].get("completion_tokens") or 0
                        res.prompt_tokens = msg["usage"].get("prompt_tokens")
    except TimeoutError:
        res.error = f"no end after {timeout_s} s"
        return
    except Exception as e:  # a connection reset, a bad chunk: the request failed, the run goes on
        res.error = f"{type(e).__name__}: {e}"
        return
    if res.ttft_s is None:
        res.error = "the stream ended without a token"
        return
    res.ok = True
    res.e2e_s = last - st
    res.output_tokens = res.output_tokens or 1
    res.tpot_s = metrics.tpot_of(res.e2e_s, res.ttft_s, res.output_tokens)


def _send_offsets(requests: list[BenchRequest], rate: float, burstiness: float, seed: int,
                  time_scale: float) -> list[float]:
    if all(r.arrival_s is not None for r in requests):
        return [r.arrival_s * time_scale for r in requests]
    if any(r.arrival_s is not None for r in requests):
        raise BenchError("either every request of the workload has an arrival time or none has")
    if math.isinf(rate):
        return [0.0] * len(requests)
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in requests:
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out


async def run(base_url: str, requests: list[BenchRequest], *, model: str | None = None, rate: float = math.inf,
              max_concurrency: int | None = None, burstiness: float = 1.0, seed: int = 0, time_scale: float = 1.0,
              slo_ttft_s: float = 2.0, slo_tpot_s: float = 0.25, timeout_s: float = 600.0, warmups: int = 0,
              api_key: str | None = None, progress: bool = True, label: str = "") -> dict:
    """Send ``requests`` to the server at ``base_url`` and return the result document (module docstring)."""
    import httpx

    if not requests:
        raise BenchError("the workload is empty")
    if max_concurrency is not None and max_concurrency < 1:
        raise BenchError("--max-concurrency must be >= 1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        if model is None:
            r = await client.get(f"{base}/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        url = f"{base}/v1/completions"
        for i in range(warmups):
            w = RequestResult(-1 - i, 0.0)
            await _one(client, url, model, requests[i % len(requests)], w, timeout_s, headers)
            if not w.ok:
                raise BenchError(f"warm-up request failed: {w.error}")
        offsets = _send_offsets(requests, rate, burstiness, seed, time_scale)
        results = [RequestResult(i, 0.0) for i in range(len(requests))]
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(requests), desc=label or "requests", unit="req", file=sys.stderr, leave=False)
        start = time.perf_counter()

        async def go(i: int) -> None:
            delay = offsets[i] - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem:
                await sem.acquire()
            try:
                results[i].arrival_s = time.perf_counter() - start
                await _one(client, url, model, requests[i], results[i], timeout_s, headers)
                if not results[i].ok:
                    results[i].prompt_tokens = results[i].prompt_tokens or _prompt_len(requests[i])
            finally:
                if sem:
                    sem.release()
                if bar:
                    bar.update(1)

        await asyncio.gather(*(go(i) for i in range(len(requests))))
        duration = time.perf_counter() - start
        if bar:
            bar.close()
    return {
        "model": model, "base_url": base,
        "schedule": {"request_rate": rate if not math.isinf(rate) else "inf", "burstiness": burstiness,
                     "max_concurrency": max_concurrency, "seed": seed, "time_scale": time_scale,
                     "trace_arrivals": all(r.arrival_s is not None for r in requests)},
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "duration_s": duration,
        "summary": summarize(results, duration, slo_ttft_s, slo_tpot_s),
        "requests": [asdict(r) for r in results],
    }


def _prompt_len(req: BenchRequest) -> int | None:
    return len(req.prompt) if isinstance(req.prompt, tuple) else None


def build_workload(args: argparse.Namespace) -> tuple[list[BenchRequest], dict]:
    if args.workload_file:
        reqs = workloads.load(Path(args.workload_file), default_output_len=args.output_len)
        return reqs, {"name": "file", "path": str(args.workload_file), "num_requests": len(reqs)}
    if args.workload == "random":
        desc = {"name": "random", "num_requests": args.num_requests, "input_len": args.input_len,
                "output_len": args.output_len, "seed": args.seed}
        return workloads.random_requests(vocab=args.vocab, num=args.num_requests, input_len=args.input_len,
                                         output_len=args.output_len, seed=args.seed), desc
    if args.workload == "shared-prefix":
        desc = {"name": "shared-prefix", "num_requests": args.num_requests, "num_prefixes": args.num_prefixes,
                "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "output_len": args.output_len,
                "seed": args.seed}
        return workloads.shared_prefix_requests(
            vocab=args.vocab, num=args.num_requests, num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
            suffix_len=args.suffix_len, output_len=args.output_len, seed=args.seed), desc
    if args.workload == "trace":
        desc = {"name": "mooncake-conversation", "limit": args.trace_limit, "start": args.trace_start,
                "block_tokens": args.block_tokens, "output_scale": args.output_scale,
                "max_output": args.max_output, "max_input": args.max_input, "time_scale": args.time_scale,
                "seed": args.seed}
        return workloads.scaled_trace(
            vocab=args.vocab, limit=args.trace_limit, start=args.trace_start, block_tokens=args.block_tokens,
            output_scale=args.output_scale, max_output=args.max_output, max_input=args.max_input,
            time_scale=args.time_scale, seed=args.seed), desc
    raise BenchError(f"unknown workload {args.workload!r}")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key")
    p.add_argument("--workload", default="random", choices=["random", "shared-prefix", "trace"])
    p.add_argument("--workload-file", help="JSONL: duet's format (bench/workloads.py) or vLLM's `custom` "
                   "format ({\"prompt\": text, \"output_tokens\": n})")
    p.add_argument("--vocab", type=int, default=32000,
                   help="random token ids are drawn from [256, vocab) (default 32000: inside every served vocabulary)")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--trace-limit", type=int, default=64)
    p.add_argument("--trace-start", type=int, default=0)
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per trace block (the trace's are 512)")
    p.add_argument("--output-scale", type=float, default=1 / 16)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--max-input", type=int, default=2048)
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply trace arrival times (> 1: slower)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmups", type=int, default=0)
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.25)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--result-file", help="write the result document (JSON) here")
    p.add_argument("--label", default="")
    p.add_argument("--no-progress", action="store_true")


def format_summary(doc: dict) -> str:
    s = doc["summary"]

    def ms(d: dict, k: str) -> str:
        return "-" if d[k] is None else f"{d[k] * 1000:.0f}"

    lines = [f"duration {doc['duration_s']:.1f} s, completed {s['completed']}, failed {s['failed']}",
             f"throughput {s['request_throughput']:.3f} req/s, {s['output_throughput']:.1f} output tok/s; "
             f"goodput {s['goodput']:.3f} req/s (TTFT <= {doc['slo']['ttft_s']} s, TPOT <= {doc['slo']['tpot_s']} s)",
             f"{'ms':<6}{'mean':>8}{'p50':>8}{'p90':>8}{'p99':>8}"]
    for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        lines.append(f"{k[:-2].upper():<6}" + "".join(f"{ms(s[k], q):>8}" for q in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import httpx

    try:
        reqs, desc = build_workload(args)
        doc = asyncio.run(run(args.base_url, reqs, model=args.model, rate=args.request_rate,
                              max_concurrency=args.max_concurrency, burstiness=args.burstiness, seed=args.seed,
                              time_scale=1.0, slo_ttft_s=args.slo_ttft_s, slo_tpot_s=args.slo_tpot_s,
                              timeout_s=args.request_timeout_s, warmups=args.warmups, api_key=args.api_key,
                              progress=not args.no_progress, label=args.label))
    except (BenchError, ValueError, OSError, httpx.HTTPError) as e:
        print(f"duet bench: error: {e}", file=sys.stderr)
        return 2
    doc["workload"] = desc
    print(format_summary(doc))
    if args.result_file:
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(doc, indent=1))
    return 0 if doc["summary"]["completed"] else 1
