"""What a worker of each pool gets, and starting one as a Ray actor (the launcher and the pool manager use it).

    spawn = Spawner(config, use_resource)
    handle = spawn(Role.DECODE, "decode-2")                   # a new actor, placed as cluster/launcher.py says
    options, engine_config = spawn.worker_args(Role.DECODE, "decode-3")   # what `flip_role` gets for that role

Every worker is the same actor class (decode_worker/role_worker.py `Worker`), so a worker of one pool can flip
into the other when both pools would have built it the same way (cluster/flip.py `flip_blockers`).
"""
from __future__ import annotations

import uuid

import ray

from cluster.config import ClusterConfig, PoolConfig
from decode_worker.role_worker import Worker
from engine.config import EngineConfig
from prefill_worker.base import WorkerOptions
from router.policy import Role

WORKER_RESOURCE = "duet_worker"
FULL_STATE_INTERVAL_S = 30.0  # Redis index: each worker republishes its whole cached set this often


def max_pool_workers(config: ClusterConfig) -> int:
    """The most workers the pools are sized for: each pool's size or its autoscaler bound, the larger."""
    auto = config.autoscaler
    return max(config.prefill.num_workers, auto.max_prefill) + max(config.decode.num_workers, auto.max_decode)


def worker_engine_config(config: ClusterConfig, pool: PoolConfig) -> EngineConfig:
    """The engine config of one worker of ``pool``: the pool's num_blocks, if it sets one; on a CPU, the
    engines that size their KV cache from the same RAM (engine/kv_sizing.py), unless the engine section says:
    every worker the pools may hold, as if they shared one machine (the launcher cannot know the placement)."""
    engine = config.engine if pool.num_blocks is None else config.engine.replace(num_blocks=pool.num_blocks)
    if engine.colocated_engines is None and not engine.device.startswith("cuda"):
        engine = engine.replace(colocated_engines=max_pool_workers(config))
    return engine


def pool_config(config: ClusterConfig, role: Role) -> PoolConfig:
    return config.prefill if role == Role.PREFILL else config.decode


class Spawner:
    """``spawn(role, worker_id) -> actor handle``: one worker actor, placed as cluster/launcher.py says."""

    def __init__(self, config: ClusterConfig, use_resource: bool) -> None:
        self.config = config
        self.use_resource = use_resource

    def worker_args(self, role: Role, worker_id: str) -> tuple[WorkerOptions, EngineConfig]:
        """The options and engine config a worker of ``role`` named ``worker_id`` is built (or flipped) with."""
        config, pool = self.config, pool_config(self.config, role)
        options = WorkerOptions(
            worker_id=worker_id, role=role.value, lease_timeout_s=config.transfer.lease_timeout_s,
            transfer_timeout_s=config.transfer.transfer_timeout_s,
            recompute_on_transfer_failure=config.transfer.recompute_on_failure,
            fault_pull_delay_s=config.transfer.fault_pull_delay_s,
            torch_threads=pool.torch_threads or max(1, int(pool.num_cpus + 0.999)),
            full_state_interval_s=None if config.router.index == "memory" else FULL_STATE_INTERVAL_S)
        return options, worker_engine_config(config, pool)

    def __call__(self, role: Role, worker_id: str):
        pool = pool_config(self.config, role)
        on_gpu = self.config.engine.device.startswith("cuda")
        num_gpus = pool.num_gpus if pool.num_gpus is not None else (1 if on_gpu else 0)
        options, engine_config = self.worker_args(role, worker_id)
        resources = {**({WORKER_RESOURCE: 1} if self.use_resource and not on_gpu else {}), **pool.resources}
        actor = ray.remote(Worker).options(
            name=f"duet-{worker_id}-{uuid.uuid4().hex[:8]}", num_cpus=0 if on_gpu else pool.num_cpus,
            num_gpus=num_gpus, resources=resources, max_restarts=0)
        return actor.remote(engine_config, options, self._sinks())

    def _sinks(self) -> list:
        from router.events import MemoryEventLog, RedisEventSink

        sinks = [MemoryEventLog()]
        if self.config.router.index != "memory":
            sinks.append(RedisEventSink(self.config.router.index))
        return sinks
