"""Routing policies: which worker of a pool gets a request. Decide only — dispatching is someone else's job.

A policy is a pure function of (the prefix index's answer for the request, the predicted loads, the
request's prompt length) plus, for round robin, a counter. Prefill and decode workers are chosen
separately with the same interface; the role picks the load term:

    load(w) [blocks] = queued_prefill_tokens(w) / B     for a prefill worker (blocks of prefill work)
                     = kv_blocks_used(w)                for a decode worker (blocks of KV it streams per step)

Both are in blocks, the unit of the cache term, so ``alpha`` is dimensionless. See docs/routing.md for the
measurements behind the default ``alpha``.
"""
from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from engine.errors import DuetError
from router.index import PrefixIndex
from router.load import IDLE, LoadEstimate, LoadTracker

logger = logging.getLogger(__name__)

DEFAULT_ALPHA = 4.0  # measured on the Mooncake conversation trace: docs/routing.md


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class NoWorkersError(DuetError, RuntimeError):
    """There is no worker of the requested role to route to."""


class WorkerCost(NamedTuple):
    """One candidate's terms. ``cost`` is the policy's score (lower wins); units are blocks. (A NamedTuple,
    not a frozen dataclass: 16 of these are built per decision and a frozen dataclass costs 4x more.)"""
    worker: str
    overlap_blocks: int  # leading prompt blocks the worker holds (from the prefix index)
    uncached_prefill_tokens: int  # prompt tokens it would still have to compute
    cache_term: float  # alpha * uncached_prefill_tokens / B (0 for policies that ignore the cache)
    load_term: float  # load(w) in blocks, see the module docstring
    cost: float


@dataclass(frozen=True)
class RoutingDecision:
    worker: str
    role: Role
    policy: str
    costs: tuple[WorkerCost, ...]  # every candidate, in the order they were given

    @property
    def chosen(self) -> WorkerCost:
        return next(c for c in self.costs if c.worker == self.worker)

    @property
    def overlap_blocks(self) -> int:
        return self.chosen.overlap_blocks

    @property
    def uncached_prefill_tokens(self) -> int:
        return self.chosen.uncached_prefill_tokens


def load_blocks(role: Role, load: LoadEstimate, block_size: int) -> float:
    """load(w) of the module docstring, in blocks."""
    if role == Role.PREFILL:
        return load.queued_prefill_tokens / block_size
    return float(load.kv_blocks_used)


class RoutingPolicy(ABC):
    name: str = "abstract"

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size

    @abstractmethod
    def choose(
        self,
        role: Role,
        workers: Sequence[str],
        num_prompt_tokens: int,
        overlap_blocks: Mapping[str, int],
        loads: Mapping[str, LoadEstimate],
    ) -> RoutingDecision:
        """Pick one of ``workers`` (order = the stable tie-break order). ``overlap_blocks`` is
        ``PrefixIndex.match`` (absent worker: 0); ``loads`` the predicted loads (absent worker: idle)."""

    def _terms(self, role: Role, workers: Sequence[str], num_prompt_tokens: int, overlap_blocks: Mapping[str, int],
               loads: Mapping[str, LoadEstimate], alpha: float) -> list[WorkerCost]:
        if not workers:
            raise NoWorkersError(f"no {role} worker to route to")
        out = []
        for w in workers:
            overlap = overlap_blocks.get(w, 0)
            uncached = max(0, num_prompt_tokens - overlap * self.block_size)
            cache_term = alpha * uncached / self.block_size
            load_term = load_blocks(role, loads.get(w, IDLE), self.block_size)
            out.append(WorkerCost(w, overlap, uncached, cache_term, load_term, cache_term + load_term))
        return out

    def _decide(self, role: Role, costs: list[WorkerCost], best: WorkerCost) -> RoutingDecision:
        decision = RoutingDecision(best.worker, Role(role), self.name, tuple(costs))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s %s -> %s | %s", self.name, role, best.worker, " ".join(
                f"{c.worker}:overlap={c.overlap_blocks},uncached_tok={c.uncached_prefill_tokens},"
                f"cache={c.cache_term:.2f},load={c.load_term:.2f},cost={c.cost:.2f}" for c in costs))
        return decision


class CacheAwarePolicy(RoutingPolicy):
    """cost(w) = alpha * uncached_prefill_tokens(w) / B + load(w); the lowest cost wins.

    uncached_prefill_tokens(w) = num_prompt_tokens - B * overlap_blocks(w), overlap_blocks(w) being the
    leading prompt blocks the prefix index says w holds. load(w) is in blocks (module docstring). Ties in
    cost go to the lower load(w), then to the earlier worker in the order given.

    With alpha = 1 on prefill workers the cost is the prefill work (in blocks) that must finish before
    this request's first token on w — the queue ahead plus its own uncached part — so the policy picks
    the worker with the earliest predicted first token. alpha > 1 also values what a hit is worth later
    (the session's next turn finds its prefix, less compute queued for others); the default 4 gave the
    best simulated mean TTFT on the Mooncake trace (docs/routing.md).
    """
    name = "cache_aware"

    def __init__(self, block_size: int, alpha: float = DEFAULT_ALPHA) -> None:
        super().__init__(block_size)
        if alpha < 0:
            raise ValueError("alpha must be >= 0")
        self.alpha = alpha

    def choose(self, role, workers, num_prompt_tokens, overlap_blocks, loads) -> RoutingDecision:
        costs = self._terms(role, workers, num_prompt_tokens, overlap_blocks, loads, self.alpha)
        best = min(costs, key=lambda c: (c.cost, c.load_term))  # min keeps the first of equals
        return self._decide(role, costs, best)


class LeastLoadedPolicy(RoutingPolicy):
    """cost(w) = load(w) (blocks, module docstring); the lowest wins, ties to the earlier worker. The cache
    is ignored in the choice; overlap and uncached tokens are still reported."""
    name = "least_loaded"

    def choose(self, role, workers, num_prompt_tokens, overlap_blocks, loads) -> RoutingDecision:
        costs = self._terms(role, workers, num_prompt_tokens, overlap_blocks, loads, alpha=0.0)  # cost = load
        return self._decide(role, costs, min(costs, key=lambda c: c.cost))


class RoundRobinPolicy(RoutingPolicy):
    """The k-th request of a role goes to ``workers[k % len(workers)]`` (one counter per role); cost is 0."""
    name = "round_robin"

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self._counters = {role: itertools.count() for role in Role}

    def choose(self, role, workers, num_prompt_tokens, overlap_blocks, loads) -> RoutingDecision:
        terms = self._terms(role, workers, num_prompt_tokens, overlap_blocks, loads, alpha=0.0)
        costs = [c._replace(cost=0.0) for c in terms]
        return self._decide(role, costs, costs[next(self._counters[role]) % len(costs)])


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (CacheAwarePolicy, LeastLoadedPolicy, RoundRobinPolicy)
}


def route(
    policy: RoutingPolicy,
    index: PrefixIndex,
    loads: LoadTracker,
    role: Role,
    workers: Sequence[str],
    block_hashes: Sequence[int],
    num_prompt_tokens: int,
) -> RoutingDecision:
    """Ask the index and the load tracker, then the policy (the one place that glues the three)."""
    return policy.choose(role, workers, num_prompt_tokens, index.match(block_hashes), loads.estimates(workers))
