import logging
import random

import pytest

from engine.kv.events import BlockStored
from engine.kv.hashing import BlockHasher
from router.routing.index import PrefixIndex, TierMatch
from router.routing.load import LoadEstimate, LoadTracker
from router.routing.policy import (
    DEFAULT_TIER_WEIGHTS,
    NO_PEER_FETCH,
    CacheAwarePolicy,
    LeastLoadedPolicy,
    NoWorkersError,
    Role,
    RoundRobinPolicy,
    TierWeights,
    WorkerCost,
    make_policy,
    route,
)

B = 4
P, D = Role.PREFILL, Role.DECODE
NO_PEER = TierWeights(peer=0)
DYNAMO = TierWeights(host=0.75, disk=0.25, peer=0.5)  # Dynamo's router's weights: the formula tests' numbers


def q(tokens):
    return LoadEstimate(queued_prefill_tokens=tokens)


def dev(**blocks):
    """Matches of workers holding device blocks only: dev(w0=3) == {"w0": TierMatch(device=3)}."""
    return {w: TierMatch(device=n) for w, n in blocks.items()}


def test_docstring_states_the_formula_the_code_uses():
    assert "cost(w) = alpha * effective_uncached_tokens(w) / B + load(w)" in CacheAwarePolicy.__doc__
    assert ("effective_uncached_tokens(w) = N - B * (device(w) + w_host * host(w) + w_disk * disk(w)"
            in CacheAwarePolicy.__doc__)


def test_cache_aware_costs_by_hand():
    workers = ["w0", "w1", "w2"]
    overlap = dev(w0=3, w1=1)  # w2 holds nothing
    loads = {"w0": q(24), "w1": q(0), "w2": q(8)}
    # alpha=2, 20 prompt tokens: w0 2*(20-12)/4 + 24/4 = 10; w1 2*16/4 + 0 = 8; w2 2*20/4 + 8/4 = 12
    d = CacheAwarePolicy(B, alpha=2, tier_weights=TierWeights(peer=0)).choose(P, workers, 20, overlap, loads)
    assert d.worker == "w1" and d.role is P and d.policy == "cache_aware"
    # w0 holds the longest prefix, so it is the peer of w1 and w2: credited at w_peer = 0 here
    d = CacheAwarePolicy(B, alpha=2, tier_weights=TierWeights(peer=0)).choose(P, workers, 20, overlap, loads)
    assert d.costs == (
        WorkerCost("w0", TierMatch(3), None, 0, 8, 8.0, 4.0, 6.0, 10.0),
        WorkerCost("w1", TierMatch(1), "w0", 2, 16, 16.0, 8.0, 0.0, 8.0),
        WorkerCost("w2", TierMatch(0), "w0", 3, 20, 20.0, 10.0, 2.0, 12.0),
    )
    assert d.worker == "w1"
    assert d.overlap_blocks == 1 and d.uncached_prefill_tokens == 16
    # alpha=4 values the cache more: w0 8+6=14, w1 16+0=16, w2 20+2=22
    d = CacheAwarePolicy(B, alpha=4, tier_weights=TierWeights(peer=0)).choose(P, workers, 20, overlap, loads)
    assert d.worker == "w0" and [c.cost for c in d.costs] == [14.0, 16.0, 22.0]


def test_decode_load_is_active_kv_blocks():
    loads = {"d0": LoadEstimate(queued_prefill_tokens=999, kv_blocks_used=10), "d1": LoadEstimate(kv_blocks_used=3)}
    d = CacheAwarePolicy(B, alpha=1, tier_weights=NO_PEER).choose(D, ["d0", "d1"], 8, dev(d0=2), loads)
    # d0: 1*(8-8)/4 + 10 = 10; d1: 1*8/4 + 3 = 5
    assert d.worker == "d1" and [c.cost for c in d.costs] == [10.0, 5.0]
    assert d.costs[0].load_term == 10.0  # queued prefill tokens do not count for a decode worker


def test_ties_go_to_lower_load_then_given_order():
    # equal cost 4: w0 = 1*8/4 + 8/4, w1 = 1*16/4 + 0 -> the less loaded w1 wins although listed second
    d = CacheAwarePolicy(B, alpha=1, tier_weights=NO_PEER).choose(P, ["w0", "w1"], 16, dev(w0=2), {"w0": q(8)})
    assert [c.cost for c in d.costs] == [4.0, 4.0] and d.worker == "w1"
    # a complete tie goes to the first in the order given
    assert CacheAwarePolicy(B).choose(P, ["b", "a"], 16, {}, {}).worker == "b"
    assert CacheAwarePolicy(B).choose(P, ["a", "b"], 16, {}, {}).worker == "a"


def test_cache_aware_matches_docstring_formula_on_random_cases():
    """The docstring's formula, written out independently: effective uncached tokens are the prompt minus
    B x (device + w_host host + w_disk disk + w_peer peer_blocks), the peer being the best other worker."""
    rng = random.Random(1)
    for _ in range(500):
        alpha = rng.choice([0.0, 0.5, 1.0, 3.0])
        role = rng.choice([P, D])
        weights = TierWeights(*sorted((rng.random(), rng.random()), reverse=True), rng.random())
        workers = [f"w{i}" for i in range(rng.randint(1, 6))]
        n_tok = rng.randint(1, 64)
        everyone = [*workers, "other0", "other1"]  # the index also knows workers that are not candidates
        matches = {}
        for w in everyone:
            if rng.random() < 0.7:
                parts = [rng.randint(0, 3) for _ in range(3)]
                while sum(parts) > n_tok // B:
                    parts[rng.randrange(3)] = 0
                if sum(parts):
                    matches[w] = TierMatch(*parts)
        loads = {w: LoadEstimate(rng.randint(0, 40), rng.randint(0, 5), rng.randint(0, 30)) for w in workers}

        def expected(w):
            m = matches.get(w, TierMatch())
            others = [matches[o].total for o in matches if o != w]
            peer_blocks = max([0, *others]) - m.total
            peer_blocks = max(0, peer_blocks)
            tokens_held_by_w_or_peer = B * (m.total + peer_blocks)
            effective = (n_tok - tokens_held_by_w_or_peer + (1 - weights.host) * B * m.host
                         + (1 - weights.disk) * B * m.disk + (1 - weights.peer) * B * peer_blocks)
            load = loads[w].queued_prefill_tokens / B if role is P else loads[w].kv_blocks_used
            return (alpha * effective / B + load, load, workers.index(w)), peer_blocks, effective

        d = CacheAwarePolicy(B, alpha, weights).choose(role, workers, n_tok, matches, loads)
        best = min(expected(w)[0] for w in workers)
        assert expected(d.worker)[0] == pytest.approx(best)  # the cheapest (up to float rounding in ties)
        assert [c.cost for c in d.costs] == pytest.approx([expected(w)[0][0] for w in workers])
        assert [c.peer_blocks for c in d.costs] == [expected(w)[1] for w in workers]
        assert [c.effective_uncached_tokens for c in d.costs] == pytest.approx([expected(w)[2] for w in workers])
        assert [c.uncached_prefill_tokens for c in d.costs] == [
            n_tok - B * matches.get(w, TierMatch()).total for w in workers]


def test_least_loaded_ignores_cache_but_reports_it():
    d = LeastLoadedPolicy(B).choose(P, ["w0", "w1", "w2"], 16, dev(w0=4), {"w0": q(40), "w1": q(4), "w2": q(4)})
    assert d.worker == "w1"  # w1 and w2 tie on load; first listed wins
    assert d.costs[0] == WorkerCost("w0", TierMatch(4), None, 0, 0, 0.0, 0.0, 10.0, 10.0)
    assert d.peer == "w0" and d.peer_blocks == 4  # reported, though it did not weigh in the choice
    d = LeastLoadedPolicy(B).choose(D, ["d0", "d1"], 16, {}, {"d0": LoadEstimate(kv_blocks_used=2)})
    assert d.worker == "d1"


def test_round_robin_cycles_per_role():
    rr = RoundRobinPolicy(B)
    ws = ["a", "b", "c"]
    assert [rr.choose(P, ws, 8, dev(c=2), {}).worker for _ in range(4)] == ["a", "b", "c", "a"]
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
    with caplog.at_level(logging.DEBUG, logger="router.routing.policy"):
        CacheAwarePolicy(B, alpha=2, tier_weights=DYNAMO).choose(P, ["w0", "w1"], 20, {"w0": TierMatch(1, 2, 0)},
                                                           {"w0": q(24)})
    msg = caplog.records[-1].getMessage()
    assert "cache_aware prefill -> w1" in msg
    # w0: 20 - 4 * (1 + 0.75 * 2) = 10 tokens; w1: 20 - 4 * 0.5 * 3 = 14 tokens, from its peer w0
    assert ("w0:dev=1,host=2,disk=0,peer=None+0,uncached_tok=8,effective_tok=10.0,cache=5.00,load=6.00,"
            "cost=11.00") in msg
    assert ("w1:dev=0,host=0,disk=0,peer=w0+3,uncached_tok=20,effective_tok=14.0,cache=7.00,load=0.00,"
            "cost=7.00") in msg


def test_route_glues_index_loads_and_policy():
    hasher = BlockHasher(B)
    toks = list(range(16))
    hs = hasher(toks)
    index, tracker = PrefixIndex(), LoadTracker()
    index.apply(BlockStored("p0", tuple(hs[:3]), None))
    tracker.dispatch("busy", "p1", num_prefill_tokens=4, num_kv_blocks=1)
    d = route(CacheAwarePolicy(B, alpha=1, tier_weights=NO_PEER), index, tracker, P, ["p0", "p1", "p2"], hs, len(toks))
    # p0: (16-12)/4 + 0 = 1; p1: 16/4 + 1 = 5; p2: 16/4 + 0 = 4
    assert d.worker == "p0" and [c.cost for c in d.costs] == [1.0, 5.0, 4.0]


# ---- KV tiers and peers ------------------------------------------------------------------------------
def test_tier_weights_price_lower_tiers_between_a_device_hit_and_a_miss():
    # 32 prompt tokens = 8 blocks, each worker holds 4 leading blocks on a different tier; alpha 1, no load
    matches = {"dev": TierMatch(device=4), "host": TierMatch(host=4), "disk": TierMatch(disk=4)}
    d = CacheAwarePolicy(B, alpha=1, tier_weights=DYNAMO).choose(P, ["disk", "host", "dev", "none"], 32, matches, {})
    # the peer of everyone but "dev" is "dev" (most device blocks among equal totals), holding nothing more
    # none: 32 - 4 * 0.5 * 4 = 24 tokens; disk: 32 - 4 * 0.25 * 4 = 28; host: 32 - 4 * 0.75 * 4 = 20; dev: 16
    assert [c.effective_uncached_tokens for c in d.costs] == [28.0, 20.0, 16.0, 24.0]
    assert d.worker == "dev" and [c.peer for c in d.costs] == [None, None, None, "dev"]
    weights = TierWeights(host=1.0, disk=1.0, peer=0.0)  # every tier as good as device: a three-way tie
    d = CacheAwarePolicy(B, alpha=1, tier_weights=weights).choose(P, ["disk", "host", "dev"], 32, matches, {})
    assert [c.cost for c in d.costs] == [4.0, 4.0, 4.0] and d.worker == "disk"  # ties: the order given


def test_peer_blocks_beyond_the_own_prefix_are_credited_and_named():
    # p9 is a decode worker (not a candidate) holding 6 blocks; c0 holds 2 on host
    matches = {"c0": TierMatch(host=2), "p9": TierMatch(device=1, disk=5)}
    d = CacheAwarePolicy(B, alpha=1, tier_weights=DYNAMO).choose(P, ["c0", "c1"], 32, matches, {"c0": q(40)})
    c0, c1 = d.costs
    assert (c0.peer, c0.peer_blocks, c1.peer, c1.peer_blocks) == ("p9", 4, "p9", 6)
    # c0: 32 - 4 * (0.75 * 2 + 0.5 * 4) = 18 tokens + load 10; c1: 32 - 4 * 0.5 * 6 = 20 tokens
    assert (c0.effective_uncached_tokens, c1.effective_uncached_tokens) == (18.0, 20.0)
    assert d.worker == "c1" and (d.peer, d.peer_blocks) == ("p9", 6)
    assert d.uncached_prefill_tokens == 32 and d.overlap_blocks == 0  # what c1 itself holds
    assert CacheAwarePolicy(B, alpha=1, tier_weights=NO_PEER).choose(P, ["c0", "c1"], 32, matches, {}).worker == "c0"


def test_peers_restrict_where_blocks_may_come_from():
    """Only workers that lend blocks (prefill workers) are peers; with peers=() there is no peer term at all."""
    matches = {"c0": TierMatch(host=2), "p9": TierMatch(device=1, disk=5), "c1": TierMatch(device=3)}
    d = CacheAwarePolicy(B, alpha=1, tier_weights=DYNAMO).choose(P, ["c0", "c1"], 32, matches, {}, peers={"c0", "c1"})
    assert [(c.worker, c.peer, c.peer_blocks) for c in d.costs] == [("c0", "c1", 1), ("c1", None, 0)]
    none = CacheAwarePolicy(B, alpha=1, tier_weights=DYNAMO).choose(P, ["c0", "c1"], 32, matches, {}, peers=())
    assert [(c.peer, c.peer_blocks) for c in none.costs] == [(None, 0), (None, 0)]
    assert none.costs[0].effective_uncached_tokens == 32 - 4 * 0.75 * 2


def test_the_peer_is_the_best_other_worker_with_stable_ties():
    matches = {"b": TierMatch(host=5), "a": TierMatch(disk=5), "c": TierMatch(device=2, disk=3), "d": TierMatch(1)}
    d = CacheAwarePolicy(B).choose(P, ["a", "b", "c", "d", "e"], 40, matches, {})
    # equal totals of 5: c has the most device blocks, then a before b by name; c's own best other is a
    assert [(c.worker, c.peer, c.peer_blocks) for c in d.costs] == [
        ("a", None, 0), ("b", None, 0), ("c", None, 0), ("d", "c", 4), ("e", "c", 5)]
    alone = CacheAwarePolicy(B).choose(P, ["a"], 40, {"a": TierMatch(2)}, {})
    assert (alone.peer, alone.peer_blocks) == (None, 0)


def test_round_robin_and_least_loaded_ignore_tiers_and_peers_in_the_choice():
    matches = {"w0": TierMatch(device=4), "w2": TierMatch(disk=1)}
    loads = {"w0": q(40), "w1": q(8), "w2": q(8)}
    weights = (TierWeights(), TierWeights(host=0, disk=0, peer=0), TierWeights(host=1, disk=1, peer=1))
    assert {LeastLoadedPolicy(B, w).choose(P, ["w0", "w1", "w2"], 16, matches, loads).worker for w in weights} == {"w1"}
    for w in weights:
        rr = RoundRobinPolicy(B, w)
        assert [rr.choose(P, ["w0", "w1", "w2"], 16, matches, loads).worker for _ in range(4)] == ["w0", "w1", "w2", "w0"]


@pytest.mark.parametrize("bad", [{"host": 1.5}, {"disk": -0.1}, {"peer": True}, {"peer": "0.5"},
                                 {"host": 0.2, "disk": 0.3}, {"shared": 0.5}])
def test_tier_weights_are_validated(bad):
    with pytest.raises(ValueError):
        TierWeights.from_mapping(bad)


def test_tier_weights_defaults_and_make_policy():
    assert TierWeights() == TierWeights.from_mapping({}) == TierWeights(host=1.0, disk=1.0, peer=0.5)
    assert DEFAULT_TIER_WEIGHTS == TierWeights() and NO_PEER_FETCH == TierWeights(peer=0.0)
    assert TierWeights.from_mapping({"host": 0.5}) == TierWeights(host=0.5, disk=0.5)  # disk <= host
    assert TierWeights.from_mapping({"host": 0.5, "disk": 0.25}).disk == 0.25
    weights = TierWeights.from_mapping({"peer": 0.0})
    policy = make_policy("cache_aware", B, alpha=2.0, tier_weights=weights)
    assert isinstance(policy, CacheAwarePolicy) and policy.alpha == 2.0 and policy.tier_weights == weights
    assert isinstance(make_policy("round_robin", B), RoundRobinPolicy)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", B)
