"""A small replay of the Mooncake trace through the real index, policies, load tracker and block pools."""
import pytest

from bench.sim.trace_replay import load_trace, oracle_hit_blocks, simulate
from bench.workloads import TRACE
from router.routing.policy import NO_PEER_FETCH, CacheAwarePolicy, LeastLoadedPolicy, RoundRobinPolicy

# The trace ships in shared/ beside the checkout (CI has it): a missing trace is a failure, not a skip.
assert TRACE.exists(), f"Mooncake trace not found at {TRACE}"

B = 16


@pytest.fixture(scope="module")
def reqs():
    return load_trace(TRACE, limit=500, block_size=B)


def test_cache_aware_beats_round_robin_and_pools_stay_exact(reqs):
    results = {}
    for policy in (CacheAwarePolicy(B, tier_weights=NO_PEER_FETCH), LeastLoadedPolicy(B), RoundRobinPolicy(B)):
        res = simulate(reqs, policy, num_workers=8, capacity_blocks=1024, block_size=B)
        for pool in res.pools:
            pool.check()
            assert pool.num_used_blocks == 0  # drained: every block free or only in the prefix cache
        assert len(res.ttft_s) == len(reqs)  # every request finished
        results[policy.name] = res
    oracle = oracle_hit_blocks(reqs) / results["round_robin"].total_blocks
    ca, rr = results["cache_aware"].hit_rate, results["round_robin"].hit_rate
    assert ca > 2 * rr
    assert ca > 2 * results["least_loaded"].hit_rate
    assert ca <= oracle
    assert results["cache_aware"].imbalance_prompt < 1.5
