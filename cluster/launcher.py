"""Bring a cluster up on Ray: pools of prefill and decode actors, handshakes, the router's backend.

    cluster = await Cluster.start(config)      # local Ray (or attach with config.ray_address)
    cluster.backend                            # router.dispatch.ClusterBackend over the pools
    await cluster.stop()

Placement: a worker on a CUDA engine asks Ray for `num_gpus=1`; on CPU it asks for `num_cpus` and, on
a Ray this process started, one unit of the custom resource `duet_worker` (declared at `ray.init`;
on a KubeRay cluster declare it in the CPU worker group's rayStartParams). Workers start in parallel;
`start` waits until every one answers `info()` (model loaded, NIXL agent registered), then hands every
decode worker the prefill workers' NIXL metadata (handshake: version + compatibility hash, refused
with KVCompatError on a mismatch), then checks that every worker hashes blocks like the router.

KV events reach the router by one of two feeds: `memory` (a task per worker long-polls its in-memory
event log over Ray) or a Redis stream shared by router replicas (`router.index: redis://...`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import ray

from cluster.config import ClusterConfig, PoolConfig
from cluster.ray_client import RayWorkerClient
from decode_worker.worker import DecodeWorker
from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.hashing import BlockHasher
from engine.tokenizer import Tokenizer
from prefill_worker.base import WorkerInfo, WorkerOptions
from prefill_worker.worker import PrefillWorker
from router.backend import ModelCard
from router.dispatch import ClusterBackend
from router.policy import POLICIES

log = logging.getLogger(__name__)

WORKER_RESOURCE = "duet_worker"
START_TIMEOUT_S = 300.0
FULL_STATE_INTERVAL_S = 30.0  # Redis index: each worker republishes its whole cached set this often


@dataclass
class Cluster:
    config: ClusterConfig
    backend: ClusterBackend
    prefill: list[RayWorkerClient]
    decode: list[RayWorkerClient]
    feed_tasks: list[asyncio.Task] = field(default_factory=list)
    started_ray: bool = False

    @classmethod
    async def start(cls, config: ClusterConfig) -> Cluster:
        started_ray = _init_ray(config)
        use_resource = WORKER_RESOURCE in ray.cluster_resources()
        sinks = _sink_factory(config)
        handles = [_spawn(PrefillWorker, config, config.prefill, "prefill", i, use_resource, sinks())
                   for i in range(config.prefill.num_workers)]
        handles += [_spawn(DecodeWorker, config, config.decode, "decode", i, use_resource, sinks())
                    for i in range(config.decode.num_workers)]
        try:
            infos: list[WorkerInfo] = await asyncio.wait_for(
                asyncio.gather(*(h.info.remote() for h in handles)), START_TIMEOUT_S)
        except Exception as e:
            for h in handles:
                ray.kill(h)
            raise ConfigError(f"workers failed to start: {e}") from e
        clients = [RayWorkerClient(h, i) for h, i in zip(handles, infos)]
        prefill = [c for c in clients if c.info.role == "prefill"]
        decode = [c for c in clients if c.info.role == "decode"]
        peers = [c.info.peer for c in prefill]
        if peers:
            await asyncio.gather(*(d.handle.add_peers.remote(peers) for d in decode))
        backend = _make_backend(config, prefill, decode, infos)
        cluster = cls(config, backend, prefill, decode, started_ray=started_ray)
        cluster.feed_tasks = _start_feeds(config, backend, clients)
        log.info("cluster up: %d prefill + %d decode workers (%s)", len(prefill), len(decode), config.engine.model)
        return cluster

    @property
    def workers(self) -> list[RayWorkerClient]:
        """The live workers (the router removes one it found dead)."""
        return [w for w in (*self.prefill, *self.decode) if w.worker_id not in self.backend.lost]

    async def stats(self) -> list[dict]:
        return list(await asyncio.gather(*(w.stats() for w in self.workers)))

    async def stop(self) -> None:
        for task in self.feed_tasks:
            task.cancel()
        await asyncio.gather(*self.feed_tasks, return_exceptions=True)
        for w in (*self.prefill, *self.decode):
            try:
                await asyncio.wait_for(w.handle.shutdown.remote(), 10)
            except Exception as e:  # a dead or stuck worker: killed below all the same
                log.debug("worker %s did not shut down cleanly: %r", w.worker_id, e)
            ray.kill(w.handle)
        if self.started_ray:
            ray.shutdown()


def _init_ray(config: ClusterConfig) -> bool:
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if config.ray_address:
        ray.init(address=config.ray_address, namespace="duet", log_to_driver=True)
        return True
    n_workers = config.prefill.num_workers + config.decode.num_workers
    need_cpus = config.prefill.num_workers * config.prefill.num_cpus + config.decode.num_workers * config.decode.num_cpus
    ray.init(num_cpus=max(os.cpu_count() or 1, int(need_cpus + 0.999)), resources={WORKER_RESOURCE: n_workers},
             namespace="duet", include_dashboard=False, log_to_driver=True)
    return True


def _spawn(worker_cls, config: ClusterConfig, pool: PoolConfig, role: str, index: int, use_resource: bool, sinks):
    on_gpu = config.engine.device.startswith("cuda")
    num_gpus = pool.num_gpus if pool.num_gpus is not None else (1 if on_gpu else 0)
    options = WorkerOptions(
        worker_id=f"{role}-{index}", role=role, lease_timeout_s=config.transfer.lease_timeout_s,
        transfer_timeout_s=config.transfer.transfer_timeout_s,
        recompute_on_transfer_failure=config.transfer.recompute_on_failure,
        torch_threads=pool.torch_threads or max(1, int(pool.num_cpus + 0.999)),
        full_state_interval_s=None if config.router.index == "memory" else FULL_STATE_INTERVAL_S)
    resources = {WORKER_RESOURCE: 1} if use_resource and not on_gpu else {}
    actor = ray.remote(worker_cls).options(
        name=f"duet-{role}-{index}-{uuid.uuid4().hex[:8]}", num_cpus=0 if on_gpu else pool.num_cpus, num_gpus=num_gpus,
        resources=resources, max_restarts=0)
    engine = config.engine if pool.num_blocks is None else config.engine.replace(num_blocks=pool.num_blocks)
    return actor.remote(engine, options, sinks)


def _sink_factory(config: ClusterConfig):
    from router.events import MemoryEventLog, RedisEventSink

    def make() -> list:
        sinks = [MemoryEventLog()]
        if config.router.index != "memory":
            sinks.append(RedisEventSink(config.router.index))
        return sinks

    return make


def _make_backend(config: ClusterConfig, prefill, decode, infos: list[WorkerInfo]) -> ClusterBackend:
    model_config = ModelConfig.from_checkpoint(config.engine.model)
    card = ModelCard(model_id=config.model_name, max_model_len=min(i.max_model_len for i in infos),
                     vocab_size=model_config.vocab_size, created=int(time.time()))
    hasher = BlockHasher(config.engine.block_size, config.engine.hash_seed, config.engine.hash_namespace)
    B = config.engine.block_size
    return ClusterBackend(
        card, Tokenizer.from_checkpoint(config.engine.model), hasher, prefill, decode,
        prefill_policy=POLICIES[config.router.prefill_policy](B),
        decode_policy=POLICIES[config.router.decode_policy](B),
        local_prefill_max_tokens=config.router.local_prefill_max_tokens)


def _start_feeds(config: ClusterConfig, backend: ClusterBackend, clients: list[RayWorkerClient]) -> list[asyncio.Task]:
    from cluster.event_feed import poll_worker_events, start_redis_feed

    if config.router.index == "memory":
        from router.events import IndexFeed

        feed = IndexFeed(backend.index, backend.tracker)
        return [asyncio.create_task(poll_worker_events(c, feed), name=f"events-{c.worker_id}") for c in clients]
    return [start_redis_feed(config.router.index, backend)]
