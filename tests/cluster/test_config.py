"""cluster/config.py: the router section's KV tier weights, the transfer section's lease bounds, the lifecycle
section's probe misses, the pools' KV dtypes and the LoRA resolver (validated when the config is built)."""
import pytest

from cluster.config import ClusterConfig
from engine.errors import ConfigError
from router.routing.policy import TierWeights


def test_router_tier_weights_parse_with_defaults_for_missing_keys():
    config = ClusterConfig.from_dict({"model": "m", "router": {"tier_weights": {"host": 0.9, "peer": 0.1}}})
    # the missing disk weight: the default's (1.0), lowered to the host weight given (disk <= host)
    assert config.router.weights == TierWeights(host=0.9, disk=0.9, peer=0.1)
    config = ClusterConfig.from_dict({"model": "m", "router": {"tier_weights": {"peer": 0}}})
    assert config.router.weights == TierWeights(host=1.0, disk=1.0, peer=0.0)
    assert ClusterConfig.from_dict({"model": "m"}).router.weights == TierWeights()


@pytest.mark.parametrize("weights, named", [({"shared_pool": 0.5}, "shared_pool"), ({"host": 2}, "host"),
                                            ({"host": 0.1, "disk": 0.2}, "disk"), ([0.5], "mapping")])
def test_router_tier_weights_refuse_unknown_keys_and_bad_values(weights, named):
    with pytest.raises(ConfigError, match=named):
        ClusterConfig.from_dict({"model": "m", "router": {"tier_weights": weights}})


def test_a_lease_too_short_for_the_pull_margin_is_refused():
    """A pull must end LEASE_CLOCK_MARGIN_S before its lease does: a lease at or under twice that would refuse every
    read (each prompt recomputed): a clear error instead. Just above it is accepted."""
    with pytest.raises(ConfigError, match="lease_timeout_s must exceed 1.0"):
        ClusterConfig.from_dict({"model": "m", "transfer": {"lease_timeout_s": 1.0, "transfer_timeout_s": 0.5}})
    config = ClusterConfig.from_dict({"model": "m", "transfer": {"lease_timeout_s": 1.5, "transfer_timeout_s": 0.5}})
    assert config.transfer.lease_timeout_s == 1.5


@pytest.mark.parametrize("misses", [0, -1, 1.5, True, "2"])
def test_health_misses_is_a_whole_number_of_probes(misses):
    with pytest.raises(ConfigError, match="lifecycle.health_misses must be an integer >= 1"):
        ClusterConfig.from_dict({"model": "m", "lifecycle": {"health_misses": misses}})
    assert ClusterConfig.from_dict({"model": "m"}).lifecycle.health_misses == 2
    assert ClusterConfig.from_dict({"model": "m", "lifecycle": {"health_misses": 1}}).lifecycle.health_misses == 1


def test_a_pool_may_store_its_own_kv_dtype_when_the_pull_converts_it():
    """Mixed precision: a prefill pool at the model dtype, a quantized decode pool, or the other way round (the decode
    pool's pull converts); each worker gets its pool's dtype, the router hashes each pool in its own namespace, and flips between such pools are off
    (a worker would keep its cache's dtype: a reload), logged as the flip blockers' reason."""
    from cluster.cli import build_parser, serve_config_from_args
    from cluster.flip import flip_blockers
    from cluster.launcher import _pool_hasher
    from cluster.spawn import worker_engine_config
    from engine.kv.hashing import kv_namespace

    config = ClusterConfig.from_dict({"model": "m", "decode": {"kv_cache_dtype": "int8"}})
    engines = [worker_engine_config(config, pool) for pool in (config.prefill, config.decode)]
    assert [e.kv_cache_dtype for e in engines] == ["auto", "int8"]
    assert [_pool_hasher(e).namespace for e in engines] == ["", kv_namespace("", "int8")]
    assert "kv_cache_dtype 'auto' != 'int8'" in flip_blockers(config)[0]
    args = build_parser().parse_args(["serve", "--model", "m", "--decode-kv-cache-dtype", "fp8_e4m3"])
    assert serve_config_from_args(args).decode.kv_cache_dtype == "fp8_e4m3"
    # the other way round: a quantized prefill pool, a decode pool at the model dtype (its pull dequantizes)
    reverse = ClusterConfig.from_dict({"model": "m", "engine": {"kv_cache_dtype": "int8"},
                                       "decode": {"kv_cache_dtype": "auto"}})
    assert [worker_engine_config(reverse, p).kv_cache_dtype for p in (reverse.prefill, reverse.decode)] == ["int8",
                                                                                                           "auto"]
    args = build_parser().parse_args(["serve", "--model", "m", "--kv-cache-dtype", "int8", "--decode-kv-cache-dtype",
                                      "auto"])
    assert serve_config_from_args(args).decode.kv_cache_dtype == "auto"
    with pytest.raises(ConfigError, match="prefill.kv_cache_dtype 'int8' and decode.kv_cache_dtype 'fp8_e4m3': pools "
                                          "of two KV dtypes need one of them at the model dtype"):
        ClusterConfig.from_dict({"model": "m", "prefill": {"kv_cache_dtype": "int8"},
                                 "decode": {"kv_cache_dtype": "fp8_e4m3"}})
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3, fp8_e5m2, got 'int4'"):
        ClusterConfig.from_dict({"model": "m", "decode": {"kv_cache_dtype": "int4"}})


def test_a_lora_resolver_needs_lora_slots_and_a_path():
    with pytest.raises(ConfigError, match=r"router.lora_resolver_dir / lora_resolver_hub_repos need LoRA slots: "
                                          r"engine.max_loras \(--max-loras\)"):
        ClusterConfig.from_dict({"model": "m", "router": {"lora_resolver_dir": "/adapters"}})
    with pytest.raises(ConfigError, match="router.lora_resolver_dir must be a directory path, got 3"):
        ClusterConfig.from_dict({"model": "m", "router": {"lora_resolver_dir": 3}, "engine": {"max_loras": 2}})
    config = ClusterConfig.from_dict({"model": "m", "router": {"lora_resolver_dir": "/adapters"},
                                      "engine": {"max_loras": 2}})
    assert config.router.lora_resolver_dir == "/adapters"
    with pytest.raises(ConfigError, match="lora_resolver_hub_repos need LoRA slots"):
        ClusterConfig.from_dict({"model": "m", "router": {"lora_resolver_hub_repos": ["acme/*"]}})
    with pytest.raises(ConfigError, match="'acme' is not a repository id"):
        ClusterConfig.from_dict({"model": "m", "router": {"lora_resolver_hub_repos": ["acme"]}})
