"""Typed values that cross process boundaries.

They are frozen dataclasses of plain Python values (str, int, bytes, tuples, nested dataclasses), so
they pickle as they are and Ray carries them between actors without a schema. No torch, no nixl.

- `PeerInfo`: what one worker publishes so another can pull from it (NIXL agent metadata + where its
  cache tensor lives + its layout and protocol version; and its host KV tier, when it has one: the
  tier's slots are readable block ids after the cache's, so one id space names both). Produced by
  `NixlTransport.peer_info()`, consumed by `NixlTransport.add_peer()` on the other side.
- `TransferRequest`: one pull, decode side: which of the peer's blocks go into which of ours, under
  which lease of the peer.
- `ReleaseNotice`: the message the puller leaves with the owner when it is done with a lease (success
  rides on the READ itself as the NIXL completion notification; failure is a standalone notification).
  Encoded as `b"duetkv/<VERSION>:<ok|fail>:<lease_id>"`; other NIXL notifications decode to None.
- `PeerMessage`: one raw notification as received (sender agent name + payload).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.layout import VERSION, KVLayout

_NOTICE_PREFIX = f"duetkv/{VERSION}:".encode()


@dataclass(frozen=True)
class PeerInfo:
    """Everything a peer needs to READ from (or WRITE into) this worker's cache tensor."""

    version: int
    agent_name: str
    agent_metadata: bytes  # nixl_agent.get_agent_metadata(): connection info + registered memory
    layout: KVLayout
    base_addr: int  # address of block 0 in the owner's address space
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int  # CUDA ordinal for VRAM, 0 for DRAM
    # the owner's host KV tier, readable too: block ids layout.num_blocks + i name its slot i (host memory)
    host_base_addr: int = 0
    host_num_blocks: int = 0
    # a tensor-parallel worker (layout.compat.tp_size > 1): ranks 1 .. tp_size - 1's own endpoints (this one is
    # rank 0's); a puller of the same split reads rank r's blocks through its own rank r
    tp_ranks: tuple[PeerInfo, ...] = ()

    @property
    def num_readable_blocks(self) -> int:
        """Block ids a puller may name: the cache's, then the host tier's slots."""
        return self.layout.num_blocks + self.host_num_blocks


@dataclass(frozen=True)
class TransferRequest:
    """Pull `remote_block_ids[i]` of `peer_name` into our `local_block_ids[i]`, then release the lease."""

    peer_name: str
    lease_id: str
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    # when the owner's lease runs out, on the wall clock (time.time()); None: no lease to respect. The owner
    # may reuse the blocks after it, so a read that has not ended by then (less a clock margin) is discarded
    # (prefill_worker/puller.py): NIXL would deliver the reused blocks' bytes as a successful READ
    deadline_unix_s: float | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples, so the value stays hashable and immutable.
        object.__setattr__(self, "remote_block_ids", tuple(self.remote_block_ids))
        object.__setattr__(self, "local_block_ids", tuple(self.local_block_ids))


@dataclass(frozen=True)
class TransferResult:
    """What a completed transfer moved, for metrics and benchmarks."""

    num_blocks: int
    num_descriptors: int  # after run merging
    num_bytes: int
    elapsed_s: float


@dataclass(frozen=True)
class ReleaseNotice:
    """The puller is done with `lease_id`: `ok` says whether its transfer succeeded."""

    lease_id: str
    ok: bool = True

    def encode(self) -> bytes:
        return _NOTICE_PREFIX + (b"ok:" if self.ok else b"fail:") + self.lease_id.encode()

    @classmethod
    def decode(cls, payload: bytes) -> ReleaseNotice | None:
        """The notice in `payload`, or None when it is not one of ours (or another VERSION)."""
        if not payload.startswith(_NOTICE_PREFIX):
            return None
        status, sep, lease_id = payload[len(_NOTICE_PREFIX) :].partition(b":")
        if not sep or status not in (b"ok", b"fail") or not lease_id:
            return None
        return cls(lease_id=lease_id.decode(), ok=status == b"ok")


@dataclass(frozen=True)
class PeerMessage:
    """One NIXL notification: who sent it and its raw bytes."""

    peer_name: str
    payload: bytes
