"""The speculation-length policy (engine/speculative/policy.py): the step-cost fit, acceptance estimates with
shadow trials, and the choice of drafts per sequence that maximises expected tokens per second."""
from __future__ import annotations

import itertools
import random

import pytest

from engine.speculative.policy import MIN_GAIN, Acceptance, StepCost, choose_lengths


def expected_rate(alphas, ks, base_tokens, a, b) -> float:
    tokens = sum(sum(al ** j for j in range(k + 1)) for al, k in zip(alphas, ks))
    return tokens / (a + b * (base_tokens + sum(ks)))


def test_step_cost_recovers_a_line_from_noisy_steps():
    rng = random.Random(0)
    cost = StepCost()
    for _ in range(400):
        n = rng.randint(1, 40)
        cost.observe(n, 0.02 + 0.003 * n + rng.gauss(0, 0.0005))
    a, b = cost.fit()
    assert a == pytest.approx(0.02, rel=0.1) and b == pytest.approx(0.003, rel=0.1)


def test_step_cost_prior_before_sizes_differ_and_forgetting():
    cost = StepCost()
    assert cost.fit() is None
    for _ in range(50):
        cost.observe(4, 0.04)  # one size only: a and b cannot be told apart
    a, b = cost.fit()
    assert a + 4 * b == pytest.approx(0.04)  # the mean is kept ...
    assert 0 < b < 0.04 / 4  # ... and b is the prior's share, optimistic enough to try drafts
    for _ in range(300):  # the machine got slower per token: the newest steps decide
        for n in (4, 12):
            cost.observe(n, 0.01 + 0.01 * n)
    a, b = cost.fit()
    assert b == pytest.approx(0.01, rel=0.05) and a == pytest.approx(0.01, rel=0.2)


def test_acceptance_shrinks_to_the_worker_rate_and_forgets():
    acc = Acceptance()
    assert acc.alpha("new") == pytest.approx(0.5)
    for _ in range(30):
        acc.observe("good", 4, 4)
        acc.observe("bad", 1, 0)
    assert acc.alpha("good") > 0.85 and acc.alpha("bad") < 0.15
    assert 0.15 < acc.alpha("new") < 0.85  # the worker's rate, between the two
    acc.forget("good")
    assert "good" not in acc.requests


@pytest.mark.parametrize("a,b", [(0.05, 0.0005), (0.02, 0.004), (0.01, 0.01)])
def test_choice_is_the_best_allocation_by_exhaustive_search(a, b):
    """For small cases every allocation (k_i <= available_i) is tried: none beats the greedy choice by more than
    the MIN_GAIN margin allows."""
    rng = random.Random(1)
    for _ in range(40):
        n = rng.randint(1, 3)
        alphas = [rng.uniform(0.05, 0.95) for _ in range(n)]
        avail = [rng.randint(0, 4) for _ in range(n)]
        ks = choose_lengths(alphas, avail, n, (a, b))
        assert all(0 <= k <= m for k, m in zip(ks, avail))
        best = max(expected_rate(alphas, c, n, a, b)
                   for c in itertools.product(*[range(m + 1) for m in avail]))
        assert expected_rate(alphas, ks, n, a, b) * MIN_GAIN >= best, (alphas, avail, ks)


def test_speculation_turns_down_with_batch_and_off_where_it_cannot_pay():
    a, b = 0.02, 0.002  # a CPU-like step: each token costs a tenth of the fixed part
    one = choose_lengths([0.7], [8], 1, (a, b))
    many = choose_lengths([0.7] * 32, [8] * 32, 32, (a, b))
    assert sum(one) >= 3  # batch 1: several drafts pay
    assert sum(many) / 32 < sum(one)  # batch 32: fewer per sequence
    assert choose_lengths([0.05] * 4, [8] * 4, 4, (a, b)) == [0, 0, 0, 0]  # drafts that are never accepted
    assert choose_lengths([0.7], [8], 1, (0.0, 0.01)) == [0]  # every token costs the same: nothing to gain
    assert choose_lengths([0.9, 0.9], [8, 8], 2, (0.05, 0.0)) == [8, 8]  # tokens are free (a GPU at batch 1-2)
    assert choose_lengths([0.9, 0.2], [3, 3], 2, None) == [3, 3]  # nothing measured yet: all
    assert choose_lengths([0.9, 0.9], [3, 3], 2, None, max_tokens=4) == [3, 1]
