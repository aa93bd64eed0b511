"""DistServe goodput, one definition for the real server (bench/serve/__main__.py) and the simulator
(bench/sim/goodput_study.py).

A run at some request rate has an **attainment**: the fraction of its requests (failed ones included) that
completed with TTFT and TPOT within their targets (``bench.summary.meets_slo``; the summary's
``good_fraction``). A rate **passes** when its attainment is >= ``ATTAINMENT`` (90 %). **Goodput** is the
highest passing rate, attainment assumed to fall as the rate grows — found by search, because a fixed sweep
only measures its own ceiling when every rate in it passes.

Two searches over that definition, because a probe costs very differently:

- ``highest`` (the simulator): rates on a fixed geometric grid, a probe per grid index, cached; exponential
  steps from a guess in either direction, then bisection. Simulated runs are cheap, so it searches far.
- ``search_rate`` (the real server): every probe is a minute or more of real load, so the search is bounded.
  It starts at ``start_rps`` and multiplies the rate by ``growth`` while the probes pass (never above
  ``ceiling_rps``); after the first failing probe it bisects geometrically (the midpoint is ``sqrt(lo * hi)``)
  between the last passing and the first failing rate until they are within ``resolution`` of each other;
  it never probes more than ``max_probes`` times. It does not search below a failing first probe: the
  result is then "below ``start_rps``" and counts as 0, never an invented number.

Noise makes attainment non-monotone near the knee. Both searches only ever probe between the highest rate
known to pass and the lowest known to fail, so the answer is always "the highest passing rate below the
lowest failing one": a rate above a failure that would pass again is never probed, and the same
measurements always give the same answer.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

ATTAINMENT = 0.9


def passes(attainment: float) -> bool:
    return attainment >= ATTAINMENT


def highest(pred: Callable[[int], bool], guess: int, max_steps: int = 60) -> int | None:
    """The largest grid index k with pred(k), pred assumed to hold below some k and fail above; None: none
    within ``max_steps`` below the guess."""
    if pred(guess):
        lo, step = guess, 1
        while step <= max_steps and pred(guess + step):
            lo, step = guess + step, step * 2
        hi = guess + step  # fails (or is past the search)
    else:
        hi, step = guess, 1
        while True:
            if step > max_steps:
                return None
            if pred(guess - step):
                lo = guess - step
                break
            hi, step = guess - step, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class RateSearch:
    """The bounds of one ``search_rate``: rates in req/s."""

    start_rps: float
    growth: float = 1.5
    resolution: float = 1.1  # stop bisecting when lowest failing / highest passing <= this
    ceiling_rps: float = 8.0
    max_probes: int = 8

    def __post_init__(self):
        if not (self.start_rps > 0 and self.growth > 1 and self.resolution > 1 and self.max_probes >= 1
                and self.ceiling_rps >= self.start_rps):
            raise ValueError(f"bad rate search {self}")


@dataclass(frozen=True)
class Probe:
    rate_rps: float
    attainment: float

    @property
    def passed(self) -> bool:
        return passes(self.attainment)


# why a search stopped
RESOLVED = "resolved"  # lowest failing / highest passing <= resolution
FIRST_FAILED = "first probe failed"  # goodput < start_rps
CEILING = "ceiling"  # passed at ceiling_rps: goodput >= ceiling
MAX_PROBES = "probe limit"  # out of probes before resolving (or before any failure: goodput >= it)


@dataclass(frozen=True)
class SearchResult:
    goodput_rps: float | None  # the highest passing rate below the lowest failing one; None: no probe passed
    lowest_failing_rps: float | None  # None: no probe failed
    stopped: str
    probes: tuple[Probe, ...]

    @property
    def ratio_rps(self) -> float:
        """The goodput a ratio uses: 0 when even the first probe failed (a lower bound when never failed)."""
        return self.goodput_rps or 0.0

    def label(self) -> str:
        """``1.38``, ``< 0.5``, ``>= 8`` (req/s) — a bound shown as a bound."""
        if self.goodput_rps is None:
            return f"< {self.lowest_failing_rps:.3g}" if self.lowest_failing_rps is not None else "-"
        return f"{'>= ' if self.lowest_failing_rps is None else ''}{self.goodput_rps:.3g}"

    def to_dict(self) -> dict:
        return {"goodput_rps": self.goodput_rps, "lowest_failing_rps": self.lowest_failing_rps,
                "stopped": self.stopped, "label": self.label(),
                "probes": [{"rate_rps": p.rate_rps, "attainment": p.attainment} for p in self.probes]}


def _round(rate: float) -> float:
    return float(f"{rate:.3g}")  # readable probe rates (file names, tables); 0.1 % is far below the resolution


def search_rate(measure: Callable[[float], float], params: RateSearch) -> SearchResult:
    """Goodput by probing: ``measure(rate_rps)`` runs the load at that rate and returns its attainment."""
    probes: list[Probe] = []

    def probe(rate: float) -> bool:
        probes.append(Probe(rate, measure(rate)))
        return probes[-1].passed

    def done(lo: float | None, hi: float | None, why: str) -> SearchResult:
        return SearchResult(lo, hi, why, tuple(probes))

    lo: float | None = None
    rate = _round(params.start_rps)
    while True:  # grow until a probe fails
        if len(probes) == params.max_probes:
            return done(lo, None, MAX_PROBES)
        if not probe(rate):
            hi = rate
            break
        lo = rate
        if rate >= params.ceiling_rps:
            return done(lo, None, CEILING)
        rate = min(_round(rate * params.growth), params.ceiling_rps)
    if lo is None:
        return done(None, hi, FIRST_FAILED)
    while hi / lo > params.resolution:
        if len(probes) == params.max_probes:
            return done(lo, hi, MAX_PROBES)
        mid = _round(math.sqrt(lo * hi))
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return done(lo, hi, RESOLVED)
