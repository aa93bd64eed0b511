"""Engine side of disaggregated serving: what a prefill engine hands off and how a decode engine takes it.

Prefill role: a request added with ``remote_decode=True`` runs its prompt, samples the first token and
then leaves the scheduler *without* freeing its blocks: they stay pinned (``Engine.held``) until the
decode side has read them (``release_held``) or a lease times out. The engine emits a ``KVHandoff``.

Decode role: ``Engine.reserve_remote(handoff)`` builds the request (prompt + first token), reuses the
decode engine's own prefix-cache hits and allocates blocks for the rest; the returned ``RemoteKVPlan``
says which remote blocks to read into which local ones. After the transfer, ``commit_remote`` marks
the prompt computed and queues the request (it then decodes like any other); ``fail_remote`` either
recomputes the prompt locally (counted) or ends the request with an error. Nothing here moves bytes:
the workers do that with kvtransfer.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.request import SamplingParams


@dataclass(frozen=True)
class KVHandoff:
    """Everything a decode worker needs to continue a request a prefill worker started."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_token_id: int
    first_logprob: float | None
    first_top_logprobs: dict[int, float] | None
    params: SamplingParams
    seed: int
    block_ids: tuple[int, ...]  # prefill-side blocks holding the prompt's KV, in order
    block_hashes: tuple[int, ...]  # hashes of the prompt's full blocks
    num_tokens: int  # tokens whose KV the blocks hold (= prompt length)
    block_size: int
    source: str = ""  # the prefill worker (its transfer agent's name), filled in by the worker
    lease_id: str = ""  # filled in by the worker
    lease_deadline_unix_s: float | None = None  # ... and when its lease runs out (kvtransfer/wire.py TransferRequest)

    def __post_init__(self) -> None:
        expected = -(-self.num_tokens // self.block_size)
        if len(self.block_ids) != expected:
            raise ValueError(f"handoff of {self.num_tokens} tokens needs {expected} blocks, got {len(self.block_ids)}")


@dataclass(frozen=True)
class RemoteKVPlan:
    request_id: str
    remote_block_ids: tuple[int, ...]  # to read from the prefill worker ...
    local_block_ids: tuple[int, ...]  # ... into these blocks of ours
    num_local_hit_blocks: int  # leading blocks we already had cached (not transferred)


@dataclass(frozen=True)
class PeerBlocks:
    """Blocks of a request's prefix that another worker holds and lends (the router names the peer; the peer's
    ``export_blocks`` pins them under a lease): the worker reads them over NIXL instead of recomputing."""

    source: str  # the peer's transfer agent
    lease_id: str
    first_block: int  # the request's block index of block_hashes[0]
    block_hashes: tuple[int, ...]
    remote_block_ids: tuple[int, ...]  # in the peer's readable id space (its cache, then its host tier)
    lease_deadline_unix_s: float | None = None  # when the peer's lease runs out (wall clock)

    def __post_init__(self) -> None:
        if len(self.block_hashes) != len(self.remote_block_ids) or self.first_block < 0:
            raise ValueError(f"peer blocks: {len(self.block_hashes)} hashes, {len(self.remote_block_ids)} ids, "
                             f"first block {self.first_block}")
