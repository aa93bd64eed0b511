"""The role-flip decision without Ray (cluster/flip.py): when one flip is both pools' next step, when a drain
becomes a flip, when a flip is not cheaper, what makes pools unflippable, and the config switch."""
from __future__ import annotations

import pytest

from cluster.config import ClusterConfig
from cluster.flip import FlipMove, PoolCounts, choose_flip, flip_blockers, prefer_flip
from engine.errors import ConfigError
from router.routing.policy import Role

P, D = Role.PREFILL, Role.DECODE


def pool(target, ready, starting=0, draining=0, acting=False, convertible=0) -> PoolCounts:
    return PoolCounts(target=target, active=ready + starting, ready=ready, draining=draining, acting=acting,
                      convertible=convertible)


def test_a_rebalance_is_one_flip_either_way():
    assert choose_flip(pool(1, 2), pool(2, 1)) == FlipMove(P, D, convert=False)  # autoscaler: P -1, D +1
    assert choose_flip(pool(3, 2), pool(1, 2)) == FlipMove(D, P, convert=False)


@pytest.mark.parametrize("prefill, decode", [
    (pool(2, 2), pool(2, 1)),  # nobody over target: start a worker
    (pool(1, 2), pool(1, 1)),  # nobody short: drain
    (pool(1, 2), pool(2, 1, starting=1)),  # the short pool already starts one
    (pool(1, 2, acting=True), pool(2, 1)),  # the surplus pool is busy with an action that cannot become a flip
    (pool(1, 2, draining=1), pool(2, 1)),  # the surplus pool drains one already (not convertible)
    (pool(1, 2), pool(2, 1, acting=True)),  # the short pool has an action in progress
    (pool(2, 2), pool(2, 2)),
])
def test_no_flip_unless_it_is_both_pools_next_step(prefill, decode):
    assert choose_flip(prefill, decode) is None


def test_a_drain_in_progress_becomes_the_flip_the_short_pool_needs():
    # the admin lowered prefill (a drain started), then raised decode: the drain turns into the flip
    assert choose_flip(pool(1, 1, draining=1, acting=True, convertible=1), pool(2, 1)) == FlipMove(P, D, convert=True)
    # a drain already decided (stopping, or flipping) is not taken twice
    assert choose_flip(pool(1, 1, draining=1, acting=True, convertible=0), pool(2, 1)) is None


def test_a_flip_is_chosen_unless_measured_flips_were_slower_than_cold_starts():
    assert prefer_flip([], [30.0]) is None  # nothing measured: flip (it loads nothing)
    assert prefer_flip([0.5, 0.7], []) is None
    assert prefer_flip([0.4, 0.6, 9.0], [5.0, 6.0]) is None  # medians 0.6 vs 5.5
    why = prefer_flip([40.0, 50.0, 60.0], [5.0, 6.0, 7.0])
    assert why == "measured flips took 50.00 s (median, drain included), cold starts 6.00 s"
    # only the latest PREFER_WINDOW of each count: old slow flips are forgotten
    assert prefer_flip([60.0] * 10 + [1.0] * 5, [5.0]) is None


def config(**overrides) -> ClusterConfig:
    return ClusterConfig.load(None, {"model": "/models/tiny", **overrides})


def test_pools_that_would_build_workers_differently_cannot_flip():
    assert flip_blockers(config()) == []
    assert flip_blockers(config(**{"prefill.torch_threads": 2})) == []  # set on the engine thread by the flip
    blockers = flip_blockers(config(**{"decode.num_blocks": 512}))
    assert len(blockers) == 1 and "num_blocks None != 512" in blockers[0] and "a reload" in blockers[0]
    blockers = flip_blockers(config(**{"prefill.resources": {"duet_prefill": 1}, "decode.num_cpus": 2}))
    assert [b.split(" ")[0] for b in blockers] == ["num_cpus", "resources"]
    assert "keeps the placement" in blockers[1]
    assert flip_blockers(config(**{"prefill.tensor_parallel_size": 2, "decode.tensor_parallel_size": 2})) == []
    blockers = flip_blockers(config(**{"prefill.tensor_parallel_size": 2}))
    assert len(blockers) == 1 and "tensor_parallel_size 2 != 1" in blockers[0]


def test_the_config_switch():
    assert config().lifecycle.role_flip is True
    assert config(**{"lifecycle.role_flip": False}).lifecycle.role_flip is False
    with pytest.raises(ConfigError, match="lifecycle.role_flip must be true or false"):
        config(**{"lifecycle.role_flip": "yes"})
    with pytest.raises(ConfigError, match=r"unknown keys in 'lifecycle': \['role_flips'\]"):
        config(**{"lifecycle.role_flips": True})
