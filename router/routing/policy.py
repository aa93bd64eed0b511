"""Routing policies: which worker of a pool gets a request. Decide only — dispatching is someone else's job.

A policy is a pure function of (the prefix index's answer for the request, the predicted loads, the
request's prompt length) plus, for round robin, a counter. Prefill and decode workers are chosen
separately with the same interface; the role picks the load term:

    load(w) [blocks] = queued_prefill_tokens(w) / B     for a prefill worker (blocks of prefill work)
                     = kv_blocks_used(w)                for a decode worker (blocks of KV it streams per step)

Both are in blocks, the unit of the cache term, so ``alpha`` is dimensionless. See docs/routing.md for the
measurements behind the default ``alpha``.

KV tiers and peers (DESIGN.md "KV tiers and the cluster pool"). The index answers, per worker, how many
leading blocks it holds on any tier and on which tier is the fastest copy of each (``TierMatch``). A
block on a lower tier is worth less than a device hit (it must be copied up first), so the cache term
credits device, host and disk blocks with separate weights; blocks that another worker holds beyond the
candidate's own prefix can be pulled from that peer over NIXL instead of recomputed, and are credited
with a fourth weight. The peer of a candidate is the other worker (any role: the index sees every
worker) with the longest match. The decision names it (``RoutingDecision.peer`` / ``peer_blocks``) so
that dispatch can tell the worker where the blocks are.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from functools import partial
from operator import itemgetter
from typing import NamedTuple

from engine.errors import DuetError
from router.routing.index import NO_MATCH, PrefixIndex, TierMatch
from router.routing.load import IDLE, LoadEstimate, LoadTracker

logger = logging.getLogger(__name__)

DEFAULT_ALPHA = 4.0  # measured on the Mooncake conversation trace: docs/routing.md


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class NoWorkersError(DuetError, RuntimeError):
    """There is no worker of the requested role to route to."""


@dataclass(frozen=True)
class TierWeights:
    """What one leading block is worth, as a fraction of a block held on the candidate's device (1.0):
    on its host tier, on its disk tier, or held only by its peer. 0 <= disk <= host <= 1, 0 <= peer <= 1.
    Defaults (host 1.0, disk 1.0, peer 0.5): the simulator's sweep, docs/routing.md "Choosing the tier
    weights" (Dynamo's router uses host 0.75, disk 0.25, shared pool 0.5)."""
    host: float = 1.0
    disk: float = 1.0
    peer: float = 0.5

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"tier weight {f.name!r} must be a number in [0, 1], got {value!r}")
        if self.disk > self.host:
            raise ValueError(f"tier weight disk ({self.disk}) > host ({self.host}): a disk hit cannot be worth more")

    @classmethod
    def from_mapping(cls, values: Mapping[str, float]) -> TierWeights:
        """From a config mapping (``{host: .., disk: .., peer: ..}``, any subset); unknown keys refused. A
        missing disk weight is the default's, or the host weight given if that is lower (``{host: 0.5}`` ->
        disk 0.5: the default disk weight 1.0 would exceed it)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown tier weight(s) {unknown}; known: {sorted(known)}")
        values = dict(values)
        host = values.get("host")
        if "disk" not in values and isinstance(host, (int, float)) and not isinstance(host, bool):
            values["disk"] = min(cls.disk, host)
        return cls(**values)


# host 1.0, disk 1.0, peer 0.5: `python -m bench.sim tier-weights` (GPU model, 7 runs over 3 loads and
# 4 trace windows, 2026-11-24; table in docs/routing.md "Choosing the tier weights"). Against Dynamo's
# (0.75, 0.25, 0.5): goodput 1.075x on average (0.97-1.21x per run), a higher hit rate in all 7 runs, lower
# mean TTFT in 4. A host or disk block is loaded back in 1.3 ms (PCIe) / 9.6 ms (NVMe) against 17-40 ms to
# recompute its 512 tokens: nearly a device hit. Peer 0.5 and 0 tie on goodput (0.5 has the lower TTFT), 1.0
# is worse; 0.5 (Dynamo's) is kept.
DEFAULT_TIER_WEIGHTS = TierWeights()
# For a deployment (or a simulation) whose workers cannot pull blocks from a peer: crediting peer blocks
# there would model a transfer that never happens (the worker recomputes them).
NO_PEER_FETCH = dataclasses.replace(DEFAULT_TIER_WEIGHTS, peer=0.0)


class WorkerCost(NamedTuple):
    """One candidate's terms. ``cost`` is the policy's score (lower wins); units are blocks. (A NamedTuple,
    not a frozen dataclass: 64 of these are built per decision and a frozen dataclass costs 4x more.)"""
    worker: str
    tiers: TierMatch  # leading prompt blocks the worker holds, by the fastest tier (from the prefix index)
    peer: str | None  # the other worker holding the longest prefix, when it holds more than this one
    peer_blocks: int  # leading blocks the peer holds beyond this worker's own (0 when peer is None)
    uncached_prefill_tokens: int  # prompt tokens the worker holds on no tier (it computes them, or fetches)
    effective_uncached_tokens: float  # the cache term's tokens: CacheAwarePolicy's docstring
    cache_term: float  # alpha * effective_uncached_tokens / B (0 for policies that ignore the cache)
    load_term: float  # load(w) in blocks, see the module docstring
    cost: float

    @property
    def overlap_blocks(self) -> int:
        """Leading prompt blocks the worker holds on any tier."""
        return self.tiers.total


# WorkerCost without its generated __new__ (a Python-level call; a decision builds one per candidate)
_new_cost = partial(tuple.__new__, WorkerCost)
_COST = itemgetter(WorkerCost._fields.index("cost"))
_COST_THEN_LOAD = itemgetter(WorkerCost._fields.index("cost"), WorkerCost._fields.index("load_term"))


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

    @property
    def peer(self) -> str | None:
        """Where the chosen worker can fetch ``peer_blocks`` leading blocks it lacks (None: nowhere)."""
        return self.chosen.peer

    @property
    def peer_blocks(self) -> int:
        """Blocks to fetch from ``peer``: the peer's match minus the chosen worker's own."""
        return self.chosen.peer_blocks


def best_two(matches: Mapping[str, TierMatch]) -> tuple[tuple[str, TierMatch] | None, tuple[str, TierMatch] | None]:
    """The two workers holding the longest prefixes, best first (ties: more device blocks, then the
    smaller name, so that routers with equal indexes agree); None where there are fewer."""
    first = second = None  # (total, device, worker, match)
    floor = (-1, -1)  # (total, device) of the second: anything below it cannot place
    for worker, m in matches.items():
        total = m[0] + m[1] + m[2]
        if (total, m[0]) < floor:
            continue
        entry = (total, m[0], worker, m)
        if first is None or _beats(entry, first):
            first, second = entry, first
        elif second is None or _beats(entry, second):
            second = entry
        if second is not None:
            floor = second[:2]
    return (first and (first[2], first[3])), (second and (second[2], second[3]))


def _beats(a: tuple, b: tuple) -> bool:
    return a[:2] > b[:2] or (a[:2] == b[:2] and a[2] < b[2])


class RoutingPolicy(ABC):
    name: str = "abstract"

    def __init__(self, block_size: int, tier_weights: TierWeights = DEFAULT_TIER_WEIGHTS) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.tier_weights = tier_weights

    @abstractmethod
    def choose(
        self,
        role: Role,
        workers: Sequence[str],
        num_prompt_tokens: int,
        matches: Mapping[str, TierMatch],
        loads: Mapping[str, LoadEstimate],
        peers: Collection[str] | None = None,
    ) -> RoutingDecision:
        """Pick one of ``workers`` (order = the stable tie-break order). ``matches`` is
        ``PrefixIndex.match`` over every worker the index knows, candidates or not (absent worker: holds
        nothing); ``loads`` the predicted loads (absent worker: idle); ``peers`` the workers a candidate can
        fetch blocks from (None: any the index knows; empty: none — no peer term)."""

    def _terms(self, role: Role, workers: Sequence[str], num_prompt_tokens: int, matches: Mapping[str, TierMatch],
               loads: Mapping[str, LoadEstimate], alpha: float,
               peers: Collection[str] | None = None) -> list[WorkerCost]:
        if not workers:
            raise NoWorkersError(f"no {role} worker to route to")
        B, w = self.block_size, self.tier_weights
        w_host, w_disk, w_peer = w.host, w.disk, w.peer
        first, second = best_two(matches if peers is None else {p: m for p, m in matches.items() if p in peers})
        first_name, first_total = (first[0], first[1].total) if first else (None, 0)
        second_name, second_total = (second[0], second[1].total) if second else (None, 0)
        get_match, get_load = matches.get, loads.get
        prefill = Role(role) is Role.PREFILL
        out = []
        for worker in workers:  # the hot loop of a decision: plain arithmetic, no calls it can avoid
            m = get_match(worker, NO_MATCH)
            device, host, disk = m
            own = device + host + disk
            peer, peer_blocks = (first_name, first_total - own) if first_name != worker else (
                second_name, second_total - own)
            if peer_blocks <= 0:
                peer, peer_blocks = None, 0
            effective = num_prompt_tokens - B * (device + w_host * host + w_disk * disk + w_peer * peer_blocks)
            effective = effective if effective > 0 else 0.0
            uncached = num_prompt_tokens - B * own
            load = get_load(worker, IDLE)  # load(w) of the module docstring, in blocks:
            load_term = load.queued_prefill_tokens / B if prefill else float(load.kv_blocks_used)
            cache_term = alpha * effective / B
            out.append(_new_cost((worker, m, peer, peer_blocks, uncached if uncached > 0 else 0, effective,
                                 cache_term, load_term, cache_term + load_term)))
        return out

    def _decide(self, role: Role, costs: list[WorkerCost], best: WorkerCost) -> RoutingDecision:
        decision = RoutingDecision(best.worker, Role(role), self.name, tuple(costs))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s %s -> %s | %s", self.name, role, best.worker, " ".join(
                f"{c.worker}:dev={c.tiers.device},host={c.tiers.host},disk={c.tiers.disk},"
                f"peer={c.peer}+{c.peer_blocks},uncached_tok={c.uncached_prefill_tokens},"
                f"effective_tok={c.effective_uncached_tokens:.1f},cache={c.cache_term:.2f},"
                f"load={c.load_term:.2f},cost={c.cost:.2f}" for c in costs))
        return decision


class CacheAwarePolicy(RoutingPolicy):
    """cost(w) = alpha * effective_uncached_tokens(w) / B + load(w); the lowest cost wins.

    effective_uncached_tokens(w) = N - B * (device(w) + w_host * host(w) + w_disk * disk(w)
                                            + w_peer * peer_blocks(w)), at least 0

    which is the same as: the prompt tokens held neither by w (on any tier) nor by its peer, plus
    (1 - w_host) of the tokens on w's host tier, (1 - w_disk) of those on its disk tier and (1 - w_peer)
    of those only the peer holds. N is the prompt's length in tokens; device/host/disk(w) are w's leading
    prompt blocks by the fastest tier it holds each on (a contiguous prefix across tiers, from the prefix
    index); peer_blocks(w) = max(0, total(p) - total(w)) for the peer p, the other worker with the
    longest prefix (any role). A device block has weight 1; ``TierWeights`` holds the others. load(w) is
    in blocks (module docstring). Ties in cost go to the lower load(w), then to the earlier worker in the
    order given.

    With alpha = 1 on prefill workers and every weight 1 the cost is the prefill work (in blocks) that
    must finish before this request's first token on w — the queue ahead plus its own uncached part — so
    the policy picks the worker with the earliest predicted first token. alpha > 1 also values what a hit
    is worth later (the session's next turn finds its prefix, less compute queued for others); the default
    4 gave the best simulated mean TTFT on the Mooncake trace (docs/routing.md).
    """
    name = "cache_aware"

    def __init__(self, block_size: int, alpha: float = DEFAULT_ALPHA,
                 tier_weights: TierWeights = DEFAULT_TIER_WEIGHTS) -> None:
        super().__init__(block_size, tier_weights)
        if alpha < 0:
            raise ValueError("alpha must be >= 0")
        self.alpha = alpha

    def choose(self, role, workers, num_prompt_tokens, matches, loads, peers=None) -> RoutingDecision:
        costs = self._terms(role, workers, num_prompt_tokens, matches, loads, self.alpha, peers)
        best = min(costs, key=_COST_THEN_LOAD)  # min keeps the first of equals
        return self._decide(role, costs, best)


class LeastLoadedPolicy(RoutingPolicy):
    """cost(w) = load(w) (blocks, module docstring); the lowest wins, ties to the earlier worker. The cache
    is ignored in the choice; tiers, peer and uncached tokens are still reported."""
    name = "least_loaded"

    def choose(self, role, workers, num_prompt_tokens, matches, loads, peers=None) -> RoutingDecision:
        costs = self._terms(role, workers, num_prompt_tokens, matches, loads, 0.0, peers)  # cost = load
        return self._decide(role, costs, min(costs, key=_COST))


class RoundRobinPolicy(RoutingPolicy):
    """The k-th request of a role goes to ``workers[k % len(workers)]`` (one counter per role); cost is 0."""
    name = "round_robin"

    def __init__(self, block_size: int, tier_weights: TierWeights = DEFAULT_TIER_WEIGHTS) -> None:
        super().__init__(block_size, tier_weights)
        self._counters = {role: itertools.count() for role in Role}

    def choose(self, role, workers, num_prompt_tokens, matches, loads, peers=None) -> RoutingDecision:
        terms = self._terms(role, workers, num_prompt_tokens, matches, loads, 0.0, peers)
        costs = [c._replace(cost=0.0) for c in terms]
        return self._decide(role, costs, costs[next(self._counters[role]) % len(costs)])


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (CacheAwarePolicy, LeastLoadedPolicy, RoundRobinPolicy)
}


def make_policy(name: str, block_size: int, *, alpha: float = DEFAULT_ALPHA,
                tier_weights: TierWeights = DEFAULT_TIER_WEIGHTS) -> RoutingPolicy:
    """The policy called ``name`` (a key of POLICIES); ``alpha`` is cache_aware's only."""
    if name == CacheAwarePolicy.name:
        return CacheAwarePolicy(block_size, alpha, tier_weights)
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name](block_size, tier_weights)


def route(
    policy: RoutingPolicy,
    index: PrefixIndex,
    loads: LoadTracker,
    role: Role,
    workers: Sequence[str],
    block_hashes: Sequence[int],
    num_prompt_tokens: int,
    peers: Collection[str] | None = None,
) -> RoutingDecision:
    """Ask the index and the load tracker, then the policy (the one place that glues the three). ``peers``: the
    workers the chosen one may fetch blocks from (None: any; ``()``: none)."""
    return policy.choose(role, workers, num_prompt_tokens, index.match(block_hashes), loads.estimates(workers),
                         peers)
