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
from engine.hub.resolve import hub_env
from prefill_worker.base import WorkerOptions
from prefill_worker.tp_ranks import TPRank
from router.routing.policy import Role

WORKER_RESOURCE = "duet_worker"
FULL_STATE_INTERVAL_S = 30.0  # Redis index: each worker republishes its whole cached set this often


def max_pool_workers(config: ClusterConfig) -> int:
    """The most workers the pools are sized for: each pool's size or its autoscaler bound, the larger."""
    auto = config.autoscaler
    return (max(config.prefill.num_workers, auto.max_prefill) * config.prefill.tensor_parallel_size
            + max(config.decode.num_workers, auto.max_decode) * config.decode.tensor_parallel_size)


def worker_engine_config(config: ClusterConfig, pool: PoolConfig) -> EngineConfig:
    """The engine config of one worker of ``pool``: the pool's num_blocks and KV dtype, if it sets them; on a CPU, the
    engines that size their KV cache from the same RAM (engine/kv/sizing.py), unless the engine section says:
    every worker the pools may hold, as if they shared one machine (the launcher cannot know the placement)."""
    engine = config.engine if pool.num_blocks is None else config.engine.replace(num_blocks=pool.num_blocks)
    if pool.tensor_parallel_size != 1:
        engine = engine.replace(tensor_parallel_size=pool.tensor_parallel_size)
    if pool.kv_cache_dtype is not None:
        engine = engine.replace(kv_cache_dtype=pool.kv_cache_dtype)
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
        self.groups: dict[str, object] = {}  # worker id -> its placement group (tensor-parallel workers)
        self.ranks: dict[str, list] = {}  # worker id -> its ranks 1 .. N-1 (Ray actor handles)

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

    def _place(self, role: Role) -> dict:
        """Ray's placement options of one rank of a ``role`` worker."""
        pool = pool_config(self.config, role)
        on_gpu = self.config.engine.device.startswith("cuda")
        num_gpus = pool.num_gpus if pool.num_gpus is not None else (1 if on_gpu else 0)
        resources = {**({WORKER_RESOURCE: 1} if self.use_resource and not on_gpu else {}), **pool.resources}
        return dict(num_cpus=0 if on_gpu else pool.num_cpus, num_gpus=num_gpus, resources=resources)

    def _runtime_env(self) -> dict:
        """A Hub model's workers get this process's ``HF_*`` variables (cache, endpoint, token, offline mode:
        engine/hub/resolve.py ``hub_env``): a worker on a Ray this process did not start would otherwise resolve
        the pinned id with its node's settings, or none. Nothing for local paths."""
        env = hub_env(self.config.engine)
        return {"runtime_env": {"env_vars": env}} if env else {}

    def asks(self, role: Role) -> dict[str, float]:
        """What one ``role`` worker asks of Ray, all its ranks together (for a slow start's log line)."""
        ranks = pool_config(self.config, role).tensor_parallel_size
        return {k: v * ranks for k, v in _bundle(self._place(role)).items()}

    def __call__(self, role: Role, worker_id: str):
        pool = pool_config(self.config, role)
        options, engine_config = self.worker_args(role, worker_id)
        place = {**self._place(role), **self._runtime_env()}
        tag = uuid.uuid4().hex[:8]
        ranks = []
        if pool.tensor_parallel_size > 1:
            ranks, place = self._ranks(pool, worker_id, role, engine_config, options, place, tag)
        actor = ray.remote(Worker).options(name=f"duet-{worker_id}-{tag}", max_restarts=0, **place)
        return actor.remote(engine_config, options, self._sinks(), ranks)

    def _ranks(self, pool: PoolConfig, worker_id: str, role: Role, engine_config: EngineConfig,
               options: WorkerOptions, place: dict, tag: str) -> tuple[list, dict]:
        """A tensor-parallel worker's ranks 1 .. N-1 (prefill_worker/tp_ranks.py), each in its own bundle of one
        placement group on one node (STRICT_PACK: the ranks' collectives and rank 0's store stay on 127.0.0.1),
        and the placement of rank 0 (the worker) in bundle 0. The group is removed with the worker (``release``)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = placement_group([_bundle(place)] * pool.tensor_parallel_size, strategy="STRICT_PACK",
                                name=f"duet-{worker_id}-{tag}")
        self.groups[worker_id] = group
        at = lambda i: PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)  # noqa: E731
        rank_actor = ray.remote(TPRank)
        ranks = [rank_actor.options(name=f"duet-rank{r}-of-{worker_id}-{tag}", max_restarts=0, max_concurrency=4,
                                    scheduling_strategy=at(r), **place).remote(
                     engine_config, r, pool.tensor_parallel_size, worker_id, role.value, options.transfer_timeout_s,
                     options.torch_threads)
                 for r in range(1, pool.tensor_parallel_size)]
        self.ranks[worker_id] = ranks
        return ranks, {**place, "scheduling_strategy": at(0)}

    def release(self, worker_id: str) -> None:
        """Stop a tensor-parallel worker's other ranks and free its placement group (nothing for one rank)."""
        from ray.util.placement_group import remove_placement_group

        for handle in self.ranks.pop(worker_id, []):
            try:
                ray.kill(handle)
            except Exception:  # already gone
                pass
        group = self.groups.pop(worker_id, None)
        if group is not None:
            remove_placement_group(group)

    def rename(self, worker_id: str, new_id: str) -> None:
        """A flipped worker keeps its ranks and placement group under its new id (``release`` finds them there)."""
        for held in (self.ranks, self.groups):
            if worker_id in held:
                held[new_id] = held.pop(worker_id)

    def _sinks(self) -> list:
        from prefill_worker.event_sinks import MemoryEventLog, RedisEventSink

        sinks = [MemoryEventLog()]
        if self.config.router.index != "memory":
            sinks.append(RedisEventSink(self.config.router.index))
        return sinks


def _bundle(place: dict) -> dict[str, float]:
    """One rank's Ray resources (a placement-group bundle) from its placement options; zero amounts left out."""
    bundle = {"CPU": place["num_cpus"], "GPU": place["num_gpus"], **place["resources"]}
    return {k: v for k, v in bundle.items() if v}
