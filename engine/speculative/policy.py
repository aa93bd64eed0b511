"""How many drafts to verify per sequence per step: speculation where it pays, off where it cannot.

Verifying k drafts of a sequence costs k more tokens in the step's forward; it returns, in expectation,
alpha + alpha^2 + ... + alpha^k more tokens, where alpha is the chance a draft is accepted (a geometric model:
each draft is tried only if every one before it was accepted). Both sides are measured online:

- **Step cost** (:class:`StepCost`): the wall time of a decode / verify step as ``a + b * tokens``, fitted by
  exponentially forgotten least squares over the engine's recent steps that ran no prompt chunk. ``a`` is
  what a step costs whatever its size (weights read once per step on a GPU, Python, sampling), ``b`` what each
  token adds (on a CPU mostly the GEMMs). Until the steps seen differ enough in size to tell ``a`` from ``b``,
  ``b`` is pulled towards a tenth of the mean cost per token (``PRIOR_TOKEN_SHARE``): optimistic enough that
  drafts get tried, after which the steps of different sizes measure ``b``.
- **Acceptance** (:class:`Acceptance`): per request, decayed counts of drafts tried and accepted, shrunk
  towards the worker's rate. When a sequence verifies no drafts its proposer's first draft is still compared
  with the token sampled (a *shadow* trial: the sampled token equals a one-hot draft exactly when verification
  would have accepted it, for greedy and sampled requests alike), so a request whose drafts stopped being
  verified keeps being measured and speculation comes back when its drafts start to match.

:func:`choose_lengths` then maximises the step's expected tokens per second: drafts are added one at a time,
always the one with the largest expected gain (the next position of the sequence with the best acceptance),
while that draft's own rate (gain / b) beats the step's (E / T) by ``MIN_GAIN``, which is when adding it raises
E / T; gains fall along a sequence, so this greedy order is optimal for the model. A large batch makes the step cost ``b
* tokens``-dominated and turns speculation down by itself; a batch of one on a GPU (``b`` ~ 0) verifies every draft.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

PRIOR_TOKEN_SHARE = 0.1  # b's prior: this share of the mean step cost per token
PRIOR_SPREAD = 0.25  # the prior's weight, as a variance of token counts (tokens^2)
MIN_GAIN = 1.1  # a draft is verified only if its own expected tokens per second beat the step's by 10 %
ALPHA_PRIOR_WEIGHT = 2.0  # trials of the worker's rate a request's own estimate starts from
ALPHA_MIN, ALPHA_MAX = 0.01, 0.99


class StepCost:
    """Seconds per decode / verify step as ``a + b * tokens``, from the steps observed (newest weigh most)."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.w, self.sx, self.sy = self.w * d + 1, self.sx * d + tokens, self.sy * d + seconds
        self.sxx, self.sxy = self.sxx * d + tokens * tokens, self.sxy * d + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None before any step was observed."""
        if self.w < 1:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = max(self.sxx / self.w - mx * mx, 0.0)
        cov = self.sxy / self.w - mx * my
        b_prior = PRIOR_TOKEN_SHARE * my / max(mx, 1.0)
        b = max((cov + PRIOR_SPREAD * b_prior) / (var + PRIOR_SPREAD), 0.0)
        a = max(my - b * mx, 0.0)
        return a, b


@dataclass
class _Counts:
    tried: float = 0.0
    accepted: float = 0.0


@dataclass
class Acceptance:
    """A draft's chance of acceptance: per request (decayed), shrunk towards the worker's."""

    decay: float = 0.9
    worker: _Counts = field(default_factory=lambda: _Counts(2.0, 1.0))  # starts at 0.5 from 2 trials
    requests: dict[str, _Counts] = field(default_factory=dict)

    def observe(self, request_id: str, tried: int, accepted: int) -> None:
        if tried <= 0:
            return
        c = self.requests.setdefault(request_id, _Counts())
        c.tried, c.accepted = c.tried * self.decay + tried, c.accepted * self.decay + accepted
        w = self.worker
        w.tried, w.accepted = w.tried * 0.99 + tried, w.accepted * 0.99 + accepted

    def alpha(self, request_id: str) -> float:
        g = self.worker.accepted / self.worker.tried
        c = self.requests.get(request_id)
        est = g if c is None else (c.accepted + ALPHA_PRIOR_WEIGHT * g) / (c.tried + ALPHA_PRIOR_WEIGHT)
        return min(max(est, ALPHA_MIN), ALPHA_MAX)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


def choose_lengths(alphas: Sequence[float], available: Sequence[int], base_tokens: int,
                   cost: tuple[float, float] | None, max_tokens: int | None = None) -> list[int]:
    """Drafts to verify per sequence (``<= available[i]``) for a step of ``base_tokens`` tokens without
    drafts (one per decoding sequence, plus prompt chunks) with ``len(alphas)`` decoding sequences.
    ``cost``: StepCost.fit(); None (nothing measured yet): every available draft, up to ``max_tokens`` more
    tokens in all. See the module docstring."""
    k = [0] * len(alphas)
    if cost is None:
        left = max_tokens if max_tokens is not None else sum(available)
        for i, n in enumerate(available):
            k[i] = min(n, left)
            left -= k[i]
        return k
    a, b = cost
    expected, tokens = float(len(alphas)), base_tokens
    heap = [(-alphas[i], i) for i in range(len(alphas)) if available[i] > 0]
    heapq.heapify(heap)
    while heap and (max_tokens is None or tokens - base_tokens < max_tokens):
        neg_gain, i = heap[0]
        gain = -neg_gain
        # the draft's tokens per second (gain / b) must beat the step's (E / T) by MIN_GAIN: then E / T grows
        if gain * (a + b * tokens) <= MIN_GAIN * b * expected:
            break
        heapq.heappop(heap)
        k[i] += 1
        expected += gain
        tokens += 1
        if k[i] < available[i]:
            heapq.heappush(heap, (-gain * alphas[i], i))
    return k
