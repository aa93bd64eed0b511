"""What the router knows of a worker (``WorkerDescriptor``) and how it acts on one (``WorkerClient``): the
seam between dispatch (router/dispatch/cluster_backend.py) and a transport (cluster/ray_client.py; tests bring their
own)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from engine.errors import ConfigError
from engine.kv.handoff import KVHandoff, PeerBlocks
from engine.kv.hashing import BlockHasher
from engine.loading.weights_summary import WeightsSummary
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from router.routing.policy import Role


@dataclass(frozen=True)
class WorkerDescriptor:
    """What the router must know of a worker before routing to it."""

    worker_id: str
    role: Role
    hash_fingerprint: tuple  # BlockHasher.fingerprint (version, block_size, seed, namespace)
    max_model_len: int
    weights: WeightsSummary | None = None  # what its engine holds and runs (/metrics: duet_weight_bytes)


class WorkerClient(ABC):
    """Acting on one worker. Every method may raise the transport's errors (actor gone, ...)."""

    descriptor: WorkerDescriptor

    @property
    def worker_id(self) -> str:
        return self.descriptor.worker_id

    @abstractmethod
    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      peer: PeerBlocks | None = None) -> RequestOutput: ...

    async def export_blocks(self, block_hashes: list[int], token_ids: list[int], first_block: int) -> PeerBlocks | None:
        """Lend the leading blocks of ``block_hashes`` this worker holds, under a lease (None: it lends none)."""
        return None

    @abstractmethod
    def decode(self, handoff: KVHandoff) -> AsyncIterator[RequestOutput]: ...

    @abstractmethod
    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]: ...

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abstractmethod
    async def release(self, request_id: str) -> None: ...

    async def load_lora(self, name: str, path: str, pinned: bool = False) -> str:
        """Load a LoRA adapter (router/lora_adapters.py gives every worker the same set); returns its digest."""
        raise ConfigError(f"worker {self.worker_id} cannot load LoRA adapters")

    async def unload_lora(self, name: str) -> None:
        raise ConfigError(f"worker {self.worker_id} cannot unload LoRA adapters")

    async def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters the worker holds: name -> digest."""
        return {}

    @abstractmethod
    async def alive(self) -> bool:
        """True if the worker answers and its engine runs; False, or an exception, if not (callers bound it
        with a timeout and treat all three as a dead worker)."""


def check_fingerprints(hasher: BlockHasher, workers: Sequence[WorkerDescriptor]) -> None:
    """Refuse workers whose block hashing differs from the router's: their KV events would never match
    our hashes and prefix routing would silently do nothing (the anchors' most-reported routing bug)."""
    ours = hasher.fingerprint
    names = ("hash version", "block size", "hash seed", "hash namespace")
    for w in workers:
        theirs = tuple(w.hash_fingerprint)
        if theirs != ours:
            diff = [f"{n} {a!r} (router) != {b!r} (worker)" for n, a, b in zip(names, ours, theirs) if a != b]
            raise ConfigError(f"worker {w.worker_id} hashes KV blocks differently: {'; '.join(diff)}")
