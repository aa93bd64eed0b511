"""A TTFT's target per request (autoscaler.ttft_slo_per_token_s): a long prompt's own compute is no prefill
pressure; the same TTFT on a short prompt is (cluster/autoscale_signals.py)."""
from __future__ import annotations

import dataclasses

import pytest

from cluster.autoscale_signals import distress, misfit, signals, ttft_targets
from cluster.autoscaler import AutoscalerConfig, Observation, PoolState, WorkerSample, decide
from engine.errors import ConfigError
from router.routing.policy import Role

P, D = Role.PREFILL, Role.DECODE
FLAT = AutoscalerConfig(enabled=True, interval_s=2, ttft_slo_s=2.0, itl_slo_s=0.1, warmup_s=5)
PER_TOKEN = dataclasses.replace(FLAT, ttft_slo_per_token_s=0.01)  # 2 s + 10 ms per prompt token
POOLS = {P: PoolState(target=1, ready=1), D: PoolState(target=1, ready=1)}


def interval(ttft, tokens, queue=()) -> Observation:
    return Observation(0.0, (WorkerSample("p0", warm=True, kv_blocks_total=100),),
                       (WorkerSample("d0", warm=True, kv_blocks_total=100),), ttft_s=tuple(ttft),
                       ttft_prompt_tokens=tuple(tokens), prefill_queue_s=tuple(queue))


def test_each_ttft_is_judged_against_its_own_prompts_target():
    o = interval([0.5] * 8 + [14.0] * 2, [100] * 8 + [2048] * 2)
    assert ttft_targets(o, PER_TOKEN) == pytest.approx([3.0] * 8 + [22.48] * 2)
    # one target for all: the long prompt's 14 s is p90 and breaks it; its own target (22.5 s) it meets
    assert decide([o], POOLS, FLAT)[P].code == "ttft_slo"
    assert decide([o], POOLS, PER_TOKEN)[P].direction == "hold"
    assert signals(P, o, PER_TOKEN)["ttft_over_target_p90"] == pytest.approx(14.0 / 22.48)
    assert distress(P, o, FLAT) is not None and distress(P, o, PER_TOKEN) is None
    # the same 14 s on short prompts is waiting that more prefill workers shorten
    short = interval([0.5] * 8 + [14.0] * 2, [100] * 10)
    d = decide([short], POOLS, PER_TOKEN)[P]
    assert (d.direction, d.code) == ("up", "ttft_slo") and "TTFT 14" in d.reason


def test_the_queue_is_judged_against_the_interval_targets_p90():
    long_prompts = interval([20.0] * 10, [2000] * 10, queue=[5.0] * 10)  # targets 22 s: 5 s of queue is no breach
    assert decide([long_prompts], POOLS, PER_TOKEN)[P].direction == "hold"
    short = interval([5.5] * 10, [100] * 10, queue=[5.0] * 10)  # targets 3 s
    assert decide([short], POOLS, PER_TOKEN)[P].code == "ttft_slo"
    queued = interval([2.5] * 10, [100] * 10, queue=[5.0] * 10)
    assert decide([queued], POOLS, PER_TOKEN)[P].code == "prefill_queue_slo"
    assert misfit(P, queued, 1, PER_TOKEN) is not None  # N - 1 would not carry it
    assert misfit(P, long_prompts, 1, dataclasses.replace(PER_TOKEN, scale_down_fraction=0.99)) is None


def test_a_per_token_target_needs_the_samples_prompt_lengths():
    with pytest.raises(ValueError, match="prompt lengths"):
        interval([1.0, 2.0], [100])
    bare = Observation(0.0, ttft_s=(1.0,))
    assert ttft_targets(bare, FLAT) == [2.0]  # no per-token term: no lengths needed
    with pytest.raises(ValueError, match="prompt tokens"):
        ttft_targets(bare, PER_TOKEN)
    for bad in (-0.01, float("inf"), "0.01"):
        with pytest.raises(ConfigError, match="ttft_slo_per_token_s"):
            AutoscalerConfig(ttft_slo_per_token_s=bad)
