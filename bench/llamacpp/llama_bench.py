"""llama.cpp's side of the engine rows: ``llama-bench`` run once per round (``-r 1``: the alternation and the best of
N are bench-llamacpp's, not llama-bench's own repetitions), its JSON parsed.

    llama-bench -m FILE -p 0 -n 128 -t 2 -r 1 -o json     # batch-1 decode: 128 tokens from an empty context
    llama-bench -m FILE -p 512 -n 0 -t 2 -r 1 -o json     # prefill: one 512-token batch (n_ubatch 512)

llama-bench runs one untimed warm-up of each test first (its default) and reports ``avg_ts`` = tokens / seconds of
the timed run; llama.cpp's defaults otherwise (flash attention auto, F16 KV, mmap, repacked weights).
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

REQUIRED = ("n_prompt", "n_gen", "n_threads", "avg_ts", "samples_ts", "model_type", "model_size")


@dataclass(frozen=True)
class LlamaBenchResult:
    n_prompt: int
    n_gen: int
    n_threads: int
    tok_s: float  # avg_ts: tokens per second of the timed run(s)
    samples_tok_s: tuple[float, ...]
    model_type: str  # llama.cpp's description, e.g. "llama 256M Q4_1"
    model_bytes: int  # llama.cpp's model_size: bytes of its weights
    build: str

    @property
    def test(self) -> str:
        """llama-bench's own name of the test: pp512, tg128."""
        return f"pp{self.n_prompt}" if self.n_gen == 0 else f"tg{self.n_gen}"


def parse_results(text: str) -> list[LlamaBenchResult]:
    """``llama-bench -o json``'s output: a JSON list of one object per test."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench's output is not JSON ({e}): {text[:200]!r}") from None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"llama-bench's JSON is not a non-empty list of tests: {text[:200]!r}")
    out = []
    for row in rows:
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise ValueError(f"llama-bench's JSON test lacks {', '.join(missing)}: {json.dumps(row)[:200]}")
        if (row["n_prompt"] > 0) == (row["n_gen"] > 0):
            raise ValueError(f"a llama-bench test is prompt-only or generation-only here, got n_prompt "
                             f"{row['n_prompt']} and n_gen {row['n_gen']}")
        out.append(LlamaBenchResult(int(row["n_prompt"]), int(row["n_gen"]), int(row["n_threads"]),
                                    float(row["avg_ts"]), tuple(float(x) for x in row["samples_ts"]),
                                    str(row["model_type"]), int(row["model_size"]),
                                    f"{row.get('build_commit', '?')} ({row.get('build_number', '?')})"))
    return out


def run_llama_bench(binary: Path, model: Path, *, n_prompt: int, n_gen: int, threads: int,
                    timeout_s: float = 1800) -> LlamaBenchResult:
    """One llama-bench test (one of ``n_prompt`` / ``n_gen`` is 0), one timed repetition after its warm-up."""
    argv = [str(binary), "-m", str(model), "-p", str(n_prompt), "-n", str(n_gen), "-t", str(threads),
            "-r", "1", "-o", "json"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    (result,) = parse_results(p.stdout)
    if result.n_threads != threads:
        raise RuntimeError(f"llama-bench ran {result.n_threads} threads, asked for {threads}")
    return result
