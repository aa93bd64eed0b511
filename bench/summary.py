"""The serving benchmark's summary: one function shared by the real client and the simulator.

    summary = summarize(requests, duration_s, slo, itl_s=gaps)

``requests`` are per-request records in the benchmark JSON's format (``ok``, ``prompt_tokens``,
``output_tokens``, ``ttft_s``, ``tpot_s``, ``e2e_s``); ``duration_s`` is first send to last completion;
``slo`` is ``{"ttft_s": .., "tpot_s": ..}``. Definitions:

- TPOT of a request = (e2e − ttft) / (output_tokens − 1) (vLLM's); undefined (None) for one output token,
  which then counts as meeting the TPOT target (``tpot_of``).
- goodput = requests that completed and met BOTH targets / duration_s (DistServe's).
- request_throughput = completed / duration_s; output_throughput = output tokens of completed / duration_s.
- ITL statistics are over every inter-token gap (``itl_s``, all requests together, as vLLM's benchmark);
  the per-request records carry no gaps, so without ``itl_s`` the ITL figures are None.
- Percentiles interpolate linearly between order statistics (numpy's default ``linear`` method).

No numpy, no duet imports: a client may copy this file.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

PERCENTILES = (50, 90, 99)


def percentile(samples: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0–100), linear interpolation as ``numpy.percentile``; None for no samples."""
    if not samples:
        return None
    xs = sorted(samples)
    rank = q / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def stats(samples: Iterable[float | None]) -> dict[str, float | None]:
    """``{"mean", "p50", "p90", "p99"}`` of the non-None samples (all None when there are none)."""
    xs = [x for x in samples if x is not None]
    out: dict[str, float | None] = {"mean": sum(xs) / len(xs) if xs else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(xs, q)
    return out


def tpot_of(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """vLLM's time per output token after the first; None for a single output token."""
    if output_tokens <= 1:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def meets_slo(request: Mapping, slo: Mapping[str, float]) -> bool:
    """Completed, TTFT within target, and TPOT within target (or undefined: one output token). With
    ``ttft_per_token_s`` in the SLO the TTFT target grows with the prompt: ``ttft_s + ttft_per_token_s *
    prompt_tokens`` (long-context traces: nobody expects a 100k-token prompt's first token in 2 s)."""
    if not request.get("ok") or request.get("ttft_s") is None:
        return False
    tpot = request.get("tpot_s")
    ttft_target = slo["ttft_s"] + slo.get("ttft_per_token_s", 0.0) * request.get("prompt_tokens", 0)
    return request["ttft_s"] <= ttft_target and (tpot is None or tpot <= slo["tpot_s"])


def summarize(requests: Sequence[Mapping], duration_s: float, slo: Mapping[str, float],
              itl_s: Sequence[float] | None = None) -> dict:
    """The benchmark JSON's ``summary`` object (module docstring)."""
    done = [r for r in requests if r.get("ok")]
    good = sum(1 for r in done if meets_slo(r, slo))
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return {
        "completed": len(done),
        "failed": len(requests) - len(done),
        "output_tokens": sum(r["output_tokens"] for r in done),
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in done),
        "request_throughput": rate(len(done)),
        "output_throughput": rate(sum(r["output_tokens"] for r in done)),
        "goodput": rate(good),
        "good_fraction": good / len(requests) if requests else 0.0,
        "ttft_s": stats(r.get("ttft_s") for r in done),
        "tpot_s": stats(r.get("tpot_s") for r in done),
        "itl_s": stats(itl_s or ()),
        "e2e_s": stats(r.get("e2e_s") for r in done),
    }

