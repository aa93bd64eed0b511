"""Bring a cluster up on Ray: pools of prefill and decode actors, handshakes, the router's backend.

    cluster = await Cluster.start(config)      # local Ray (or attach with config.ray_address)
    cluster.backend                            # router.dispatch.cluster_backend.ClusterBackend over the pools
    await cluster.stop()

A Hugging Face Hub id is resolved once, here (or already by `duet serve`), to one commit that every worker loads:
each gets the pinned id and this process's `HF_*` variables (engine/hub/resolve.py, cluster/spawn.py).

Placement: a worker on a CUDA engine asks Ray for `num_gpus=1`; on CPU it asks for `num_cpus` and, on
a Ray this process started, one unit of the custom resource `duet_worker` (declared at `ray.init`;
on a KubeRay cluster declare it in the CPU worker group's rayStartParams). Workers start in parallel;
`start` waits until every one answers `info()` (model loaded, NIXL agent registered), then hands every
decode worker the prefill workers' NIXL metadata (handshake: version + compatibility hash, refused
with KVCompatError on a mismatch), then checks that every worker hashes blocks like the router, and that every
worker read the same bytes for each `--lora-modules` adapter (router/lora_adapters.py; a worker started later gets
the adapters served then, loaded at run time included, before it is routed to).

KV events reach the router by one of two feeds: `memory` (a task per worker long-polls its in-memory
event log over Ray) or a Redis stream shared by router replicas (`router.index: redis://...`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import asdict, dataclass, field

import ray

from cluster.config import ClusterConfig
from cluster.pools import PoolManager
from cluster.ray_client import RayWorkerClient
from cluster.spawn import WORKER_RESOURCE, Spawner, max_pool_workers, worker_engine_config
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.kv.hashing import BlockHasher, kv_namespace
from engine.loading.checkpoint import load_model_config, load_tokenizer
from engine.loading.weights_summary import WeightsSummary
from prefill_worker.base import WorkerInfo
from router.backend import ModelCard
from router.dispatch.cluster_backend import ClusterBackend
from router.lora_adapters import ServedAdapter
from router.metrics.collector import ClusterCollector, RouterMetrics
from router.routing.feed import IndexFeed
from router.routing.policy import Role, make_policy
from router.workers.registry import WorkerState

log = logging.getLogger(__name__)

_spawner = Spawner  # (config, use_resource) -> spawn(role, worker_id); tests start extra workers with it


@dataclass
class Cluster:
    config: ClusterConfig
    backend: ClusterBackend
    pools: PoolManager
    metrics: RouterMetrics
    feed: IndexFeed | None = None
    feed_tasks: list[asyncio.Task] = field(default_factory=list)
    started_ray: bool = False

    @classmethod
    async def start(cls, config: ClusterConfig) -> Cluster:
        config = await asyncio.to_thread(config.with_pinned_model)  # a Hub id: one commit for every worker
        started_ray = _init_ray(config)
        spawn = Spawner(config, WORKER_RESOURCE in ray.cluster_resources())
        names = [f"prefill-{i}" for i in range(config.prefill.num_workers)]
        names += [f"decode-{i}" for i in range(config.decode.num_workers)]
        handles = {name: spawn(Role(name.split("-")[0]), name) for name in names}
        try:
            infos: list[WorkerInfo] = await asyncio.wait_for(
                asyncio.gather(*(h.info.remote() for h in handles.values())), config.lifecycle.start_timeout_s)
        except Exception as e:
            for h in handles.values():
                ray.kill(h)
            raise ConfigError(f"workers failed to start: {e}") from e
        clients = [RayWorkerClient(h, i) for h, i in zip(handles.values(), infos)]
        prefill = [c for c in clients if c.info.role == "prefill"]
        decode = [c for c in clients if c.info.role == "decode"]
        peers = [c.info.peer for c in prefill]
        if peers:
            await asyncio.gather(*(d.handle.add_peers.remote(peers) for d in decode))
        # the cluster pool: every prefill worker can read the prefix blocks every other one lends
        await asyncio.gather(*(p.handle.add_import_peers.remote([q.info.peer for q in prefill if q is not p])
                               for p in prefill if len(prefill) > 1))
        metrics = RouterMetrics(config.model_name, min(i.max_model_len for i in infos))
        backend = _make_backend(config, prefill, decode, infos, metrics)
        for c in clients:  # each loaded the --lora-modules at start: the router records their digests (the same)
            await backend.lora.join(c)
        for c in clients:
            rec = backend.registry.get(c.worker_id)
            rec.pid, rec.node = c.info.pid, c.info.node
        feed, feed_tasks, start_feed = _start_feeds(config, backend, clients)
        pools = PoolManager(config, backend, spawn, handles=handles, start_feed=start_feed, metrics=metrics)
        metrics.add_collector(ClusterCollector(
            config.model_name, backend.registry, targets=lambda: {r.value: n for r, n in pools.targets.items()},
            bounds=lambda: {r.value: pools.bounds(r) for r in pools.targets},
            feed_counters=lambda: asdict(feed.counters) if feed is not None else {},
            pool_counters=lambda: pools.counters, index_blocks=backend.index.block_counts,
            peer_fetches=lambda: backend.peer_fetches, lora_counters=lambda: backend.lora.counters))
        cluster = cls(config, backend, pools, metrics, feed, started_ray=started_ray)
        pools.feeds.update({c.worker_id: t for c, t in zip(clients, feed_tasks)} if start_feed else {})
        cluster.feed_tasks = [] if start_feed else feed_tasks
        pools.start()
        log.info("cluster up: %d prefill + %d decode workers (%s)", len(prefill), len(decode), config.engine.model)
        return cluster

    @property
    def registry(self):
        return self.backend.registry

    @property
    def workers(self) -> list[RayWorkerClient]:
        """The workers that take or finish requests (ready or draining)."""
        return [r.client for r in self.registry.records(states=(WorkerState.READY, WorkerState.DRAINING))]

    @property
    def prefill(self) -> list[RayWorkerClient]:
        return [r.client for r in self.registry.records(Role.PREFILL) if r.client is not None]

    @property
    def decode(self) -> list[RayWorkerClient]:
        return [r.client for r in self.registry.records(Role.DECODE) if r.client is not None]

    async def stats(self) -> list[dict]:
        return list(await asyncio.gather(*(w.stats() for w in self.workers)))

    async def stop(self) -> None:
        await self.pools.stop()
        for task in self.feed_tasks:
            task.cancel()
        await asyncio.gather(*self.feed_tasks, return_exceptions=True)
        for worker_id, handle in list(self.pools.handles.items()):
            try:
                await asyncio.wait_for(handle.shutdown.remote(), 10)
            except Exception as e:  # a dead or stuck worker: killed below all the same
                log.debug("worker %s did not shut down cleanly: %r", worker_id, e)
            ray.kill(handle)
            self.pools._release(worker_id)  # a tensor-parallel worker's other ranks and placement group
            if self.registry.get(worker_id).state != WorkerState.DEAD:
                self.backend.retire(worker_id, "cluster stopped", fault=False)
        if self.started_ray:
            ray.shutdown()


def _init_ray(config: ClusterConfig) -> bool:
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if config.ray_address:
        ray.init(address=config.ray_address, namespace="duet", log_to_driver=True)
        return True
    n_workers = max_pool_workers(config) + 1  # and a replacement starting while a dead one is reaped
    per_worker_cpus = max(config.prefill.num_cpus, config.decode.num_cpus)
    if not config.engine.device.startswith("cuda"):  # the workers (started by this Ray) inherit it
        from engine.model_runner import with_huge_page_malloc

        os.environ.update(with_huge_page_malloc(dict(os.environ)))
    ray.init(num_cpus=max(os.cpu_count() or 1, int(n_workers * per_worker_cpus + 0.999)),
             resources={WORKER_RESOURCE: n_workers}, namespace="duet", include_dashboard=False, log_to_driver=True)
    return True


def _make_backend(config: ClusterConfig, prefill, decode, infos: list[WorkerInfo],
                  metrics: RouterMetrics) -> ClusterBackend:
    model_config = load_model_config(config.engine.model)
    card = ModelCard(model_id=config.model_name, max_model_len=min(i.max_model_len for i in infos),
                     vocab_size=model_config.vocab_size, created=int(time.time()),
                     longrope_original_len=model_config.longrope_original_len, weights=_card_weights(infos),
                     lora_adapters=tuple(name for name, _ in config.engine.lora_modules or ()))
    for i in infos:  # each worker sized its KV cache (engine/kv/sizing.py; the reason is in its own log)
        log.info("worker %s: %d KV blocks of %d tokens, context %d tokens", i.worker_id, i.num_blocks, i.block_size,
                 i.max_model_len)
    log.info("serving max_model_len %d: the longest context every worker holds (the checkpoint's: %d)",
             card.max_model_len, model_config.max_position_embeddings)
    p_hasher, d_hasher = (_pool_hasher(worker_engine_config(config, pool)) for pool in (config.prefill, config.decode))
    B = config.engine.block_size
    return ClusterBackend(
        card, load_tokenizer(config.engine.model), d_hasher, prefill, decode,
        prefill_hasher=None if p_hasher.fingerprint == d_hasher.fingerprint else p_hasher,  # pools of two KV dtypes
        prefill_policy=make_policy(config.router.prefill_policy, B, tier_weights=config.router.weights),
        decode_policy=make_policy(config.router.decode_policy, B, tier_weights=config.router.weights),
        local_prefill_max_tokens=config.router.local_prefill_max_tokens, metrics=metrics,
        lora_modules=[ServedAdapter(name, path, name in (config.engine.pinned_loras or ()))
                      for name, path in config.engine.lora_modules or ()],
        lora_resolver=config.router.lora_resolver())


def _pool_hasher(engine: EngineConfig) -> BlockHasher:
    """How a pool's workers hash their blocks: their namespace includes their KV dtype."""
    return BlockHasher(engine.block_size, engine.hash_seed, kv_namespace(engine.hash_namespace, engine.kv_cache_dtype))


def _start_feeds(config: ClusterConfig, backend: ClusterBackend, clients: list[RayWorkerClient]):
    """(feed, tasks, start_feed): the embedded index polls each worker (start_feed adds a worker later);
    the Redis index reads one stream for everyone (start_feed is None)."""
    from cluster.event_feed import poll_worker_events, start_redis_feed
    from router.routing.feed import IndexFeed

    def on_load(load) -> None:
        backend.registry.update_load(load, time.monotonic())

    if config.router.index == "memory":
        feed = IndexFeed(backend.index, backend.tracker, on_load=on_load)

        def start_feed(client: RayWorkerClient) -> asyncio.Task:
            return asyncio.create_task(poll_worker_events(client, feed), name=f"events-{client.worker_id}")

        return feed, [start_feed(c) for c in clients], start_feed
    task, feed = start_redis_feed(config.router.index, backend, on_load=on_load)
    return feed, [task], None


def _card_weights(infos: list[WorkerInfo]) -> WeightsSummary | None:
    """What /v1/models says is loaded: a decode worker's weights (decode makes every token); a worker that holds
    them otherwise (a role's own engine settings) is logged, and /metrics shows each worker's own."""
    shown = next((i for i in infos if i.role == "decode"), infos[0])
    for i in infos:
        if i.weights != shown.weights:
            log.warning("worker %s holds its weights otherwise than %s (/v1/models shows %s's; /metrics each "
                        "worker's duet_weight_bytes):\n%s", i.worker_id, shown.worker_id, shown.worker_id,
                        i.weights.log_block(i.model_id) if i.weights else "no summary")
    return shown.weights

