import logging
import random

import pytest

from engine.hashing import BlockHasher
from engine.kv_events import BlockStored
from router.index import PrefixIndex
from router.load import LoadEstimate, LoadTracker
from router.policy import (
    CacheAwarePolicy,
    LeastLoadedPolicy,
    NoWorkersError,
    Role,
    RoundRobinPolicy,
    WorkerCost,
    route,
)

B = 4
P, D = Role.PREFILL, Role.DECODE


def q(tokens):
    return LoadEstimate(queued_prefill_tokens=tokens)


def test_docstring_states_the_formula_the_code_uses():
    assert "cost(w) = alpha * uncached_prefill_tokens(w) / B + load(w)" in CacheAwarePolicy.__doc__


def test_cache_aware_costs_by_hand():
    workers = ["w0", "w1", "w2"]
    overlap = {"w0": 3, "w1": 1}  # w2 holds nothing
    loads = {"w0": q(24), "w1": q(0), "w2": q(8)}
    # alpha=2, 20 prompt tokens: w0 2*(20-12)/4 + 24/4 = 10; w1 2*16/4 + 0 = 8; w2 2*20/4 + 8/4 = 12
    d = CacheAwarePolicy(B, alpha=2).choose(P, workers, 20, overlap, loads)
    assert d.worker == "w1" and d.role is P and d.policy == "cache_aware"
    assert d.costs == (
        WorkerCost("w0", 3, 8, 4.0, 6.0, 10.0),
        WorkerCost("w1", 1, 16, 8.0, 0.0, 8.0),
        WorkerCost("w2", 0, 20, 10.0, 2.0, 12.0),
    )
    assert d.overlap_blocks == 1 and d.uncached_prefill_tokens == 16
    # alpha=4 values the cache more: w0 8+6=14, w1 16+0=16, w2 20+2=22
    d = CacheAwarePolicy(B, alpha=4).choose(P, workers, 20, overlap, loads)
    assert d.worker == "w0" and [c.cost for c in d.costs] == [14.0, 16.0, 22.0]


def test_decode_load_is_active_kv_blocks():
    loads = {"d0": LoadEstimate(queued_prefill_tokens=999, kv_blocks_used=10), "d1": LoadEstimate(kv_blocks_used=3)}
    d = CacheAwarePolicy(B, alpha=1).choose(D, ["d0", "d1"], 8, {"d0": 2}, loads)
    # d0: 1*(8-8)/4 + 10 = 10; d1: 1*8/4 + 3 = 5
    assert d.worker == "d1" and [c.cost for c in d.costs] == [10.0, 5.0]
    assert d.costs[0].load_term == 10.0  # queued prefill tokens do not count for a decode worker


def test_ties_go_to_lower_load_then_given_order():
    # equal cost 4: w0 = 1*8/4 + 8/4, w1 = 1*16/4 + 0 -> the less loaded w1 wins although listed second
    d = CacheAwarePolicy(B, alpha=1).choose(P, ["w0", "w1"], 16, {"w0": 2}, {"w0": q(8)})
    assert [c.cost for c in d.costs] == [4.0, 4.0] and d.worker == "w1"
    # a complete tie goes to the first in the order given
    assert CacheAwarePolicy(B).choose(P, ["b", "a"], 16, {}, {}).worker == "b"
    assert CacheAwarePolicy(B).choose(P, ["a", "b"], 16, {}, {}).worker == "a"


def test_cache_aware_matches_docstring_formula_on_random_cases():
    rng = random.Random(1)
    for _ in range(300):
        alpha = rng.choice([0.0, 0.5, 1.0, 3.0])
        role = rng.choice([P, D])
        workers = [f"w{i}" for i in range(rng.randint(1, 6))]
        n_tok = rng.randint(1, 64)
        overlap = {w: rng.randint(0, n_tok // B) for w in workers if rng.random() < 0.7}
        loads = {w: LoadEstimate(rng.randint(0, 40), rng.randint(0, 5), rng.randint(0, 30)) for w in workers}

        def expected(w):
            uncached = n_tok - B * overlap.get(w, 0)
            load = loads[w].queued_prefill_tokens / B if role is P else loads[w].kv_blocks_used
            return (alpha * uncached / B + load, load, workers.index(w))

        d = CacheAwarePolicy(B, alpha).choose(role, workers, n_tok, overlap, loads)
        assert d.worker == min(workers, key=expected)
        assert [c.cost for c in d.costs] == pytest.approx([expected(w)[0] for w in workers])


def test_least_loaded_ignores_cache_but_reports_it():
    d = LeastLoadedPolicy(B).choose(P, ["w0", "w1", "w2"], 16, {"w0": 4}, {"w0": q(40), "w1": q(4), "w2": q(4)})
    assert d.worker == "w1"  # w1 and w2 tie on load; first listed wins
    assert d.costs[0] == WorkerCost("w0", 4, 0, 0.0, 10.0, 10.0)
    d = LeastLoadedPolicy(B).choose(D, ["d0", "d1"], 16, {}, {"d0": LoadEstimate(kv_blocks_used=2)})
    assert d.worker == "d1"


def test_round_robin_cycles_per_role():
    rr = RoundRobinPolicy(B)
    ws = ["a", "b", "c"]
    assert [rr.choose(P, ws, 8, {"c": 2}, {}).worker for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.choose(D, ws, 8, {}, {}).worker == "a"  # decode has its own counter
    assert rr.choose(P, ws, 8, {}, {}).worker == "b"
    assert all(c.cost == 0.0 for c in rr.choose(P, ws, 8, {}, {}).costs)


def test_no_workers_and_bad_parameters():
    for policy in (CacheAwarePolicy(B), LeastLoadedPolicy(B), RoundRobinPolicy(B)):
        with pytest.raises(NoWorkersError):
            policy.choose(P, [], 8, {}, {})
    with pytest.raises(ValueError):
        CacheAwarePolicy(B, alpha=-1)
    with pytest.raises(ValueError):
        CacheAwarePolicy(0)


def test_decision_logged_at_debug_with_every_term(caplog):
    with caplog.at_level(logging.DEBUG, logger="router.policy"):
        CacheAwarePolicy(B, alpha=2).choose(P, ["w0", "w1"], 20, {"w0": 3}, {"w0": q(24)})
    msg = caplog.records[-1].getMessage()
    assert "cache_aware prefill -> w1" in msg
    assert "w0:overlap=3,uncached_tok=8,cache=4.00,load=6.00,cost=10.00" in msg
    assert "w1:overlap=0,uncached_tok=20,cache=10.00,load=0.00,cost=10.00" in msg


def test_route_glues_index_loads_and_policy():
    hasher = BlockHasher(B)
    toks = list(range(16))
    hs = hasher(toks)
    index, tracker = PrefixIndex(), LoadTracker()
    index.apply(BlockStored("p0", tuple(hs[:3]), None))
    tracker.dispatch("busy", "p1", num_prefill_tokens=4, num_kv_blocks=1)
    d = route(CacheAwarePolicy(B, alpha=1), index, tracker, P, ["p0", "p1", "p2"], hs, len(toks))
    # p0: (16-12)/4 + 0 = 1; p1: 16/4 + 1 = 5; p2: 16/4 + 0 = 4
    assert d.worker == "p0" and [c.cost for c in d.costs] == [1.0, 5.0, 4.0]
