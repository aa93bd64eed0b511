"""Workloads shared by the serving benchmark (`duet bench`, `make bench-serve`) and the simulator.

Every workload is a list of :class:`BenchRequest`: an arrival time (or none: closed loop), prompt token
ids, and the number of output tokens to generate (sent with ``ignore_eos``, so every server generates
exactly that many). Prompts are token ids, sent as a token-id ``prompt`` to ``/v1/completions``, so no
server re-tokenizes them differently.

**The Mooncake trace, scaled for a CPU** (``scaled_trace``). ../shared/traces/conversation_trace.jsonl
gives, per request, an arrival time in ms, ``input_length``, ``output_length`` and ``hash_ids``: one id per
512-token prefix block, equal ids at equal positions meaning the same reusable prefix. Scaling:

- each hash id becomes one fixed block of ``block_tokens`` synthetic token ids (deterministic per id,
  drawn from ``[TOKEN_LO, vocab)``), so the sharing structure is exactly the trace's; the prompt is the
  concatenation of its blocks, cut to ``ceil(input_length * block_tokens / 512)`` tokens (the last block
  stays partial, as in the trace), then to ``max_input`` tokens;
- ``output = clamp(round(output_length * output_scale), 1, max_output)``;
- arrival ``= (timestamp - first timestamp) / 1000 * time_scale`` seconds (``time_scale`` > 1 slows the
  trace down to what a CPU can serve).

``scaled_trace`` takes a window of ``limit`` requests starting at ``start``.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
SHARED = next((p for p in (_REPO / "shared", _REPO.parent / "shared") if p.is_dir()), _REPO.parent / "shared")
TRACE = SHARED / "traces" / "conversation_trace.jsonl"
TRACE_BLOCK_TOKENS = 512
TOKEN_LO = 256  # synthetic ids start above every special token of the models we serve


@dataclass(frozen=True)
class BenchRequest:
    prompt: tuple[int, ...] | str  # token ids, or a text the server tokenizes
    output_len: int
    arrival_s: float | None = None  # None: the client's schedule (rate or concurrency) decides
    hash_ids: tuple[int, ...] = field(default=(), compare=False)  # trace prefix blocks (trace workloads)
    prefix_id: int | None = field(default=None, compare=False)  # shared-prefix workloads

    def to_json(self) -> dict:
        d = {"prompt": list(self.prompt) if isinstance(self.prompt, tuple) else self.prompt,
             "output_len": self.output_len}
        if self.arrival_s is not None:
            d["arrival_s"] = self.arrival_s
        if self.hash_ids:
            d["hash_ids"] = list(self.hash_ids)
        if self.prefix_id is not None:
            d["prefix_id"] = self.prefix_id
        return d

    @classmethod
    def from_json(cls, d: dict, default_output_len: int | None = None) -> BenchRequest:
        """Ours (``to_json``) or vLLM's ``custom`` dataset line: ``{"prompt": text, "output_tokens": n}``."""
        if not isinstance(d, dict):
            raise ValueError("a workload line must be a JSON object")
        unknown = set(d) - {"prompt", "output_len", "output_tokens", "arrival_s", "hash_ids", "prefix_id"}
        if unknown:
            raise ValueError(f"unknown workload fields: {sorted(unknown)}")
        if "output_len" in d and "output_tokens" in d:
            raise ValueError("a workload line has both 'output_len' and 'output_tokens'")
        prompt = d.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
            prompt = tuple(prompt)
        elif not (isinstance(prompt, str) and prompt):
            raise ValueError("workload 'prompt' must be a non-empty text or list of token ids")
        out = d.get("output_len", d.get("output_tokens", default_output_len))
        if not isinstance(out, int) or isinstance(out, bool) or out < 1:
            raise ValueError("workload 'output_len' / 'output_tokens' must be an integer >= 1")
        arrival = d.get("arrival_s")
        if arrival is not None and (not isinstance(arrival, (int, float)) or arrival < 0):
            raise ValueError("workload 'arrival_s' must be a number >= 0")
        return cls(prompt, out, arrival, tuple(d.get("hash_ids", ())), d.get("prefix_id"))


def _block(hash_id: int, block_tokens: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random((seed << 40) ^ (hash_id * 0x9E3779B97F4A7C15 & ((1 << 64) - 1)))
    return [rng.randrange(TOKEN_LO, vocab) for _ in range(block_tokens)]


def scaled_trace(*, vocab: int, limit: int = 64, start: int = 0, block_tokens: int = 16,
                 output_scale: float = 1 / 16, max_output: int = 64, max_input: int = 2048,
                 time_scale: float = 1.0, seed: int = 0, path: Path = TRACE) -> list[BenchRequest]:
    """A window of the Mooncake conversation trace, scaled as the module docstring says."""
    if block_tokens < 1 or limit < 1 or start < 0 or time_scale <= 0 or max_output < 1 or max_input < 1:
        raise ValueError("scaled_trace: block_tokens, limit, max_output, max_input >= 1; start >= 0; time_scale > 0")
    recs = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if len(recs) >= limit:
                break
            recs.append(json.loads(line))
    if not recs:
        raise ValueError(f"no trace records from {start} in {path}")
    t0 = recs[0]["timestamp"]
    cache: dict[int, list[int]] = {}
    out = []
    for r in recs:
        ids = tuple(r["hash_ids"])
        tokens: list[int] = []
        for h in ids:
            if h not in cache:
                cache[h] = _block(h, block_tokens, vocab, seed)
            tokens.extend(cache[h])
        n = min(max(1, math.ceil(r["input_length"] * block_tokens / TRACE_BLOCK_TOKENS)), len(tokens), max_input)
        out_len = min(max(1, round(r["output_length"] * output_scale)), max_output)
        out.append(BenchRequest(tuple(tokens[:n]), out_len, (r["timestamp"] - t0) / 1000.0 * time_scale, ids))
    return out


def random_requests(*, vocab: int, num: int, input_len: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """``num`` prompts of ``input_len`` uniformly random token ids, each asking for ``output_len`` tokens."""
    rng = random.Random(seed)
    return [BenchRequest(tuple(rng.randrange(TOKEN_LO, vocab) for _ in range(input_len)), output_len)
            for _ in range(num)]


def shared_prefix_requests(*, vocab: int, num: int, num_prefixes: int, prefix_len: int, suffix_len: int,
                           output_len: int, seed: int = 0) -> list[BenchRequest]:
    """``num_prefixes`` long shared prefixes (a system prompt, a document), each request one of them plus a
    random suffix; shuffled. The shape of vLLM's ``prefix_repetition`` dataset."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(TOKEN_LO, vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    reqs = []
    for i in range(num):
        p = i % num_prefixes
        reqs.append(BenchRequest(tuple(prefixes[p] + [rng.randrange(TOKEN_LO, vocab) for _ in range(suffix_len)]),
                                 output_len, prefix_id=p))
    rng.shuffle(reqs)
    return reqs


def save(requests: list[BenchRequest], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(r.to_json()) + "\n")


def load(path: Path, default_output_len: int | None = None) -> list[BenchRequest]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(BenchRequest.from_json(json.loads(line), default_output_len))
                except (ValueError, KeyError) as e:
                    raise ValueError(f"{path}:{n}: {e}") from None
    return out
