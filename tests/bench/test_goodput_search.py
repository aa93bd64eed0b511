"""DistServe goodput's searches (bench/goodput_search.py) against synthetic attainment curves: the
simulator's grid search and the real server's bounded rate search (knee within resolution, all fail, all
pass up to the ceiling, the probe limit, non-monotone noise)."""
from __future__ import annotations

import math

import pytest

from bench.goodput_search import (
    ATTAINMENT,
    CEILING,
    FIRST_FAILED,
    MAX_PROBES,
    RESOLVED,
    RateSearch,
    highest,
    search_rate,
)


def test_highest_finds_the_last_passing_grid_index_from_any_guess():
    for edge in (-7, 0, 3, 40):
        for guess in (-3, 0, 5):
            calls = []

            def pred(k, edge=edge):
                calls.append(k)
                return k <= edge

            assert highest(pred, guess) == edge
            assert len(set(calls)) <= 14  # exponential steps then bisection, not a scan
    assert highest(lambda k: False, 0) is None


def knee(at_rps: float):
    """Attainment 0.97 up to ``at_rps``, below 90 % above it and falling (0 at twice the rate)."""
    return lambda rate: 0.97 if rate <= at_rps else max(0.0, 0.89 - 0.89 * (rate - at_rps) / at_rps)


@pytest.mark.parametrize("at_rps", [0.3, 0.61, 1.0, 1.37, 2.9, 5.5])
def test_search_rate_finds_the_knee_within_resolution(at_rps):
    params = RateSearch(start_rps=0.25, growth=2.0, resolution=1.1, ceiling_rps=8.0, max_probes=12)
    res = search_rate(knee(at_rps), params)
    assert res.stopped == RESOLVED
    assert res.goodput_rps <= at_rps < res.lowest_failing_rps
    assert res.lowest_failing_rps / res.goodput_rps <= params.resolution
    assert res.goodput_rps == max(p.rate_rps for p in res.probes if p.passed)
    assert len(res.probes) <= 9  # growth then bisection: few probes, each a minute of real load


def test_search_rate_when_even_the_first_probe_fails():
    res = search_rate(lambda rate: 0.5, RateSearch(start_rps=0.5))
    assert (res.goodput_rps, res.lowest_failing_rps, res.stopped) == (None, 0.5, FIRST_FAILED)
    assert len(res.probes) == 1  # never searches below the start
    assert res.label() == "< 0.5" and res.ratio_rps == 0.0


def test_search_rate_stops_at_the_ceiling_when_everything_passes():
    rates = []

    def measure(rate):
        rates.append(rate)
        return 1.0

    res = search_rate(measure, RateSearch(start_rps=0.25, growth=2.0, ceiling_rps=3.0, max_probes=20))
    assert rates == [0.25, 0.5, 1.0, 2.0, 3.0]  # the last step is cut to the ceiling
    assert (res.goodput_rps, res.lowest_failing_rps, res.stopped) == (3.0, None, CEILING)
    assert res.label() == ">= 3"


def test_search_rate_probe_limit_keeps_what_was_measured():
    grow = search_rate(lambda rate: 1.0, RateSearch(start_rps=0.5, growth=2.0, max_probes=3))
    assert (grow.goodput_rps, grow.lowest_failing_rps, grow.stopped) == (2.0, None, MAX_PROBES)
    assert grow.label() == ">= 2"
    bisect = search_rate(knee(1.3), RateSearch(start_rps=0.5, growth=2.0, resolution=1.01, max_probes=4))
    assert bisect.stopped == MAX_PROBES and len(bisect.probes) == 4
    assert bisect.goodput_rps <= 1.3 < bisect.lowest_failing_rps


def test_search_rate_threshold_is_inclusive():
    res = search_rate(lambda rate: ATTAINMENT if rate <= 1.0 else ATTAINMENT - 0.01,
                      RateSearch(start_rps=1.0, growth=2.0, resolution=1.5))
    assert res.goodput_rps >= 1.0 and res.probes[0].passed


def test_search_rate_with_noise_is_deterministic_and_never_reaches_past_a_failure():
    """A noisy dip at 0.5 req/s fails although 1 and 2 req/s would pass: the search only bisects below the
    lowest failing rate, so the goodput is under 0.5, and the same measurements give the same answer."""
    def noisy(rate):
        if 0.45 <= rate <= 0.55:
            return 0.85
        return knee(2.0)(rate) - 0.02 * math.sin(rate * 37)  # jitter that never crosses 0.9 away from the dip

    params = RateSearch(start_rps=0.25, growth=2.0, resolution=1.1, max_probes=10)
    a, b = search_rate(noisy, params), search_rate(noisy, params)
    assert a == b
    assert a.lowest_failing_rps <= 0.5 and a.goodput_rps < 0.5
    assert all(p.rate_rps <= 0.5 for p in a.probes)


def test_bad_bounds_are_refused():
    for bad in ({"start_rps": 0}, {"start_rps": 1, "growth": 1.0}, {"start_rps": 1, "resolution": 1.0},
                {"start_rps": 1, "max_probes": 0}, {"start_rps": 4, "ceiling_rps": 2}):
        with pytest.raises(ValueError):
            RateSearch(**bad)
