"""The ranks of a tensor-parallel worker other than rank 0 (DESIGN.md "Workers wider than one device").

A worker of ``tensor_parallel_size`` N is N processes: rank 0 is the worker (prefill_worker/base.py: scheduler,
block table, events, API, rank 0's shard), ranks 1 .. N-1 are ``TPRank`` objects, each a Ray actor of its own in
the worker's placement group (cluster/spawn.py), holding its shard of the weights and its KV heads.

Start-up: rank 0 picks a port and calls every rank's ``join(host, port)``; each rank then joins rank 0's gloo
group (engine/models/tensor_parallel.py), loads its shard, sizes its cache with the others, and follows rank 0's steps
on a thread of its own (``ModelRunner.follow``) until rank 0 closes the engine — or its connection to rank 0 breaks,
when the process exits (a rank without its worker has nothing to do; Ray sees the actor die).

KV handoff: every rank has its own NIXL agents on its own cache — the one peers read from (a prefill worker) and
the one it reads with (every worker) — so a block's KV moves rank to rank, each rank's heads on its own
connection. Rank 0 drives both: a prefill worker's peer info lists its ranks' endpoints (``PeerInfo.tp_ranks``);
a decode worker hands its ranks their peers at the handshake (``add_peers``) and, for each handoff, has every
rank read its part (``read``, no notice) before rank 0 reads its own with the lease's notice, so the prefill
worker releases the blocks only after every rank's read landed.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import uuid
from collections.abc import Callable, Sequence

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.kv.mover import TierMover, tier_slots
from engine.kv.tiers import Completion, Job
from engine.loading.checkpoint import load_model_config
from engine.model_runner import ModelRunner
from engine.models.tensor_parallel import TensorParallel, check_split, init_group, open_store
from kvtransfer import NixlTransport, PeerInfo, TransferRequest
from prefill_worker.engine_facts import block_store, kv_compat
from prefill_worker.sources import Sources

log = logging.getLogger(__name__)


class TPRank:
    def __init__(self, engine_config: EngineConfig, rank: int, size: int, worker_id: str, role: str,
                 transfer_timeout_s: float, torch_threads: int | None = None) -> None:
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        check_split(load_model_config(engine_config.model), size)
        self.config, self.rank, self.size = engine_config, rank, size
        self.name = f"{worker_id}/rank{rank}"
        self.role = role
        self.transfer_timeout_s = transfer_timeout_s
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the reading agent: one transfer at a time
        self._tier_lock = threading.Lock()

    def join(self, host: str, port: int) -> None:
        """Join rank 0's group at ``host:port`` and start following (returns at once)."""
        self._thread = threading.Thread(target=self._serve, args=(host, port), name=f"tp-{self.name}", daemon=True)
        self._thread.start()

    def _serve(self, host: str, port: int) -> None:
        try:
            tp = init_group(self.rank, self.size, host, port)
            mc = load_model_config(self.config.model)
            mpe = mc.max_position_embeddings
            runner = ModelRunner(mc, self.config, min(self.config.max_model_len or mpe, mpe), tp)
            compat = kv_compat(self.config, runner)
            tag = f"duet-{self.name.replace('/', '-')}-{uuid.uuid4().hex[:8]}"
            self.mover = None
            if self.config.kv_host_bytes:  # this rank's tiers: its heads of rank 0's blocks, slot for slot
                host_slots, disk_slots = tier_slots(self.config, runner.bytes_per_block)
                self.mover = TierMover(runner.kv_cache, host_slots, self.config.kv_disk_dir if disk_slots else None,
                                       tag)
            self._sources = Sources(runner.kv_cache, compat, self.rank, f"{tag}-read", store_blocks=block_store(runner))
            self._kv, self._compat, self._tag = runner.kv_cache, compat, tag
            self.owner = (NixlTransport(runner.kv_cache, compat, agent_name=tag,
                                        host=self.mover.host if self.mover is not None else None)
                          if self.role == "prefill" else None)
            self._ready.set_result(None)
        except BaseException as e:
            self._ready.set_exception(e)
            log.exception("tensor parallel %s failed to start", self.name)
            os._exit(1)
        try:
            runner.follow()
            log.info("tensor parallel %s: rank 0 closed the engine", self.name)
        except BaseException:
            log.exception("tensor parallel %s lost rank 0: exiting", self.name)
            os._exit(1)

    # ---- what rank 0 calls (Ray actor methods) ---------------------------------------------------------
    def peer_info(self) -> PeerInfo:
        """The endpoint peers read this rank's cache from (a prefill worker's rank)."""
        self._ready.result(timeout=600)
        if self.owner is None:
            raise RuntimeError(f"{self.name} is a {self.role} worker's rank: nothing reads from it")
        return self.owner.peer_info()

    def add_peers(self, peers: Sequence[PeerInfo]) -> list[str]:
        """Handshake with prefill workers' ranks (each ``peer`` is a worker's rank 0, listing its other ranks): the
        same-numbered rank of a worker of the same split, every rank of another split (a split reader)."""
        self._ready.result(timeout=600)
        with self._lock:
            return [self._sources.add(p) for p in peers]

    def remove_peers(self, names: Sequence[str]) -> list[str]:
        self._ready.result(timeout=600)
        with self._lock:
            return self._sources.remove(names)

    def read(self, source: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> str | None:
        """Read this rank's heads of ``source``'s blocks (``source``: the worker's rank-0 agent name) into this
        rank's cache; the error, or None."""
        self._ready.result(timeout=600)
        try:
            with self._lock:
                self._sources.read(source, remote_block_ids, local_block_ids, self.transfer_timeout_s)
            return None
        except Exception as e:  # noqa: BLE001 - the caller fails (or recomputes) the request with this text
            return f"rank {self.rank}: {type(e).__name__}: {e}"

    def set_role(self, role: str) -> None:
        """Follow rank 0's role flip: forget every peer; a prefill rank opens the agent peers read its cache (and host
        tier) from, a decode rank closes it."""
        self._ready.result(timeout=600)
        with self._lock:
            self._sources.remove(None)
            if role == "prefill" and self.owner is None:
                self.owner = NixlTransport(self._kv, self._compat, agent_name=f"{self._tag}-{uuid.uuid4().hex[:4]}",
                                           host=self.mover.host if self.mover is not None else None)
            elif role == "decode" and self.owner is not None:
                self.owner.close()
                self.owner = None
            self.role = role

    def tier_job(self, job: Job) -> Completion:
        """Run rank 0's KV-tier job on this rank's tiers (engine/kv/mover.py ``TierMover.run_here``)."""
        self._ready.result(timeout=600)
        with self._tier_lock:
            return self.mover.run_here(job)

    def health(self) -> dict:
        return {"ok": self._thread is not None and self._thread.is_alive(), "rank": self.rank}


class RankGroup:
    """Rank 0's view of its other ranks (Ray actor handles; duck-typed: ``handle.method.remote(...)``)."""

    def __init__(self, handles: Sequence) -> None:
        self.handles = list(handles)

    def __len__(self) -> int:
        return len(self.handles)

    def form_group(self, engine_config: EngineConfig) -> TensorParallel | None:
        """Form the tensor-parallel group with the other ranks (rank 0 listens on a port the kernel gives its
        store: the ranks share its node, cluster/spawn.py); None for a worker of one rank."""
        size = engine_config.tensor_parallel_size
        if size == 1 and not self.handles:
            return None
        if len(self.handles) != size - 1:
            raise ConfigError(f"tensor_parallel_size {size} needs {size - 1} other ranks, got {len(self.handles)}")
        check_split(load_model_config(engine_config.model), size)
        store = open_store("127.0.0.1", size)
        for h in self.handles:
            h.join.remote("127.0.0.1", store.port)
        return init_group(0, size, "127.0.0.1", store.port, store=store)

    def reads(self, request: TransferRequest) -> Callable[[], str | None] | None:
        """What runs before rank 0's own read of ``request`` (which carries the lease's notice): every other rank
        reads its part; None for a worker of one rank."""
        if not self.handles:
            return None
        return lambda: self.read(request.peer_name, request.remote_block_ids, request.local_block_ids)

    def peer_infos(self) -> tuple[PeerInfo, ...]:
        return tuple(r.future().result(timeout=600) for r in [h.peer_info.remote() for h in self.handles])

    async def add_peers(self, peers: Sequence[PeerInfo]) -> None:
        """Every rank shakes hands with the peers' ranks it will read from (rank 0's handshake checked them)."""
        await asyncio.gather(*(h.add_peers.remote(list(peers)) for h in self.handles))

    async def remove_peers(self, names: Sequence[str]) -> None:
        await asyncio.gather(*(h.remove_peers.remote(list(names)) for h in self.handles))

    async def check(self, timeout_s: float = 3.0) -> str | None:
        """None if every other rank answers its health call in time and still follows; else what is wrong."""
        for rank, handle in enumerate(self.handles, start=1):
            try:
                health = await asyncio.wait_for(handle.health.remote(), timeout_s)
            except Exception as e:  # noqa: BLE001 - gone, or not answering: either way the worker cannot step
                return f"rank {rank} does not answer ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
            if not health["ok"]:
                return f"rank {rank} stopped following"
        return None

    def set_role(self, role: str) -> None:
        """Every other rank follows a role flip (blocking; rank 0's engine thread, between steps)."""
        for ref in [h.set_role.remote(role) for h in self.handles]:
            ref.future().result(timeout=60)

    def tier_job(self, job: Job) -> Completion:
        """Every rank runs rank 0's KV-tier job on its own tiers (blocking): an op failed if it failed anywhere."""
        done = [r.future().result() for r in [h.tier_job.remote(job) for h in self.handles]]
        failed = frozenset().union(*(c.failed for c in done))
        return Completion(job.job_id, failed, next((c.error for c in done if c.error), None))

    def read(self, source: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> str | None:
        """Every rank reads its heads of the blocks from ``source``'s ranks (blocking); the first error, or None."""
        refs = [h.read.remote(source, list(remote_block_ids), list(local_block_ids)) for h in self.handles]
        errors = [r.future().result() for r in refs]
        return next((e for e in errors if e), None)
