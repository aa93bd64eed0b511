"""What the launcher hands each worker (cluster/launcher.py), checked without starting Ray."""
from __future__ import annotations

from cluster.config import ClusterConfig
from cluster.spawn import max_pool_workers, worker_engine_config


def test_cpu_workers_split_the_ram_among_every_worker_the_pools_may_hold():
    config = ClusterConfig.load(None, {"model": "m", "prefill.num_workers": 1, "decode.num_workers": 2,
                                       "autoscaler.max_prefill": 3, "autoscaler.max_decode": 1,
                                       "decode.num_blocks": 48})
    assert max_pool_workers(config) == 3 + 2
    prefill, decode = worker_engine_config(config, config.prefill), worker_engine_config(config, config.decode)
    assert prefill.colocated_engines == decode.colocated_engines == 5
    assert (prefill.num_blocks, decode.num_blocks) == (None, 48)  # a pool's own size still applies
    assert config.engine.colocated_engines is None  # the cluster's config is not changed
    explicit = ClusterConfig.load(None, {"model": "m", "engine.colocated_engines": 1})
    assert worker_engine_config(explicit, explicit.decode).colocated_engines == 1  # the config file wins
    gpu = ClusterConfig.load(None, {"model": "m", "engine.device": "cuda"})
    assert worker_engine_config(gpu, gpu.decode).colocated_engines is None  # a GPU worker has its own device
