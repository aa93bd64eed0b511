"""What one simulated request and one simulated worker carry through a ``ClusterSim`` run, and the result.

``SimResult.prefix_hit_rate`` is the simulator's hit rate; ``hit_sources`` splits it by where the tokens came
from (this worker's device cache, its host or disk tier, a peer).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bench.sim.engine import SimEngine
from router.routing.policy import Role

if TYPE_CHECKING:  # the autoscaler reads the cluster, which records its runs here: a type only
    from bench.sim.autoscale import Autoscaling


@dataclass
class Flight:
    """One request's way through the simulated cluster."""

    index: int
    arrival_s: float
    prompt: tuple[int, ...]
    output_len: int
    hashes: list[int]
    prefill_worker: str | None = None
    decode_worker: str | None = None
    first_s: float | None = None
    last_s: float | None = None
    done_s: float | None = None
    at_decode: bool = False  # reached its decode worker (a drain of it waits); before that it may be redirected
    lease_expired: bool = False
    recomputed: bool = False
    error: str | None = None

    @property
    def rid(self) -> str:
        return f"r{self.index}"


@dataclass
class SimWorker:
    name: str
    role: Role
    engine: SimEngine
    state: str = "ready"  # starting | ready | draining | dead
    ready_s: float = float("-inf")
    busy: bool = False
    inbox: list = field(default_factory=list)
    waiting_handoffs: list = field(default_factory=list)  # decode: flights waiting for blocks
    handoff_retry_sig: tuple | None = None  # decode: the pool when they last failed
    xfer_free_s: float = 0.0  # decode: when its transfer thread is free
    flip_to: Role | None = None  # draining to change role (the autoscaler's rebalance), not to leave
    wake_s: float = float("inf")  # the engine loop's next wake-up for a copy that lands (lower tiers)


@dataclass
class SimResult:
    flights: list[Flight]
    itl_s: list[float]
    engines: list[SimEngine]
    counters: dict[str, int]
    autoscaling: Autoscaling | None

    def prefix_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache of the worker that computes the prompt / prompt tokens,
        at each request's first admission there (a preempted request finding its own blocks again is not
        a hit; the engine's own counters include those)."""
        hit = sum(e.prompt_tokens_hit for e in self.engines)
        total = sum(e.prompt_tokens_computed for e in self.engines)
        return hit / total if total else 0.0

    def hit_sources(self) -> dict[str, float]:
        """``prefix_hit_rate`` split by source: the computing worker's device cache, its host or disk tier
        (loaded back), a peer (fetched to the host tier, then loaded). Fractions of all prompt tokens."""
        total = sum(e.prompt_tokens_computed for e in self.engines) or 1
        tiers = sum(e.prompt_tokens_hit_tiers for e in self.engines)
        peer = sum(e.prompt_tokens_hit_peer for e in self.engines)
        device = sum(e.prompt_tokens_hit for e in self.engines) - tiers - peer
        return {"device": device / total, "tiers": tiers / total, "peer": peer / total}
