"""KV events and load reports (DESIGN.md contract), as typed values.

The block pool and the lower KV tiers record ``BlockStored`` / ``BlockRemoved`` / ``AllCleared`` as they
happen; the engine drains them once per step and its owner (a worker) publishes them. proto/ mirrors these
types for the wire.

Tiers (DESIGN.md "KV tiers"): a worker's blocks live on the device tier (the paged cache the kernels read),
the host tier (host memory) or the disk tier (files). An event names its tier; a block may be on several
tiers of one worker at once (the lower tiers are written through). A store on a new tier is published only
after the copy landed and before the removal from the old one, so a reader never sees a block vanish from
a worker that still holds it. ``AllCleared`` clears every tier of the worker.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Tier(StrEnum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


TIERS: tuple[Tier, ...] = (Tier.DEVICE, Tier.HOST, Tier.DISK)  # fastest first


@dataclass(frozen=True)
class BlockStored:
    worker: str
    block_hashes: tuple[int, ...]  # in chain order; block_hashes[0]'s parent is parent_hash
    parent_hash: int | None  # None: the first block is a root block
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    worker: str
    block_hashes: tuple[int, ...]
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True)
class AllCleared:
    worker: str  # every tier of the worker


KVEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(frozen=True)
class TierUsage:
    """One lower tier's size as the router must know it (the device tier is ``kv_blocks_used/total``)."""

    tier: Tier
    blocks_total: int  # capacity in blocks
    blocks_used: int  # blocks holding a cached block now


@dataclass(frozen=True)
class WorkerLoad:
    worker: str
    role: str  # "prefill" | "decode" | "both"
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    queued_prefill_tokens: int
    tiers: tuple[TierUsage, ...] = ()  # the worker's lower tiers (host, disk), absent when it has none
