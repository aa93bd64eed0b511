"""KV events and load reports (DESIGN.md contract), as typed values.

The block pool records ``BlockStored`` / ``BlockRemoved`` / ``AllCleared`` as they happen; the engine drains
them once per step and its owner (a worker) publishes them. proto/ mirrors these types for the wire.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    worker: str
    block_hashes: tuple[int, ...]  # in chain order; block_hashes[0]'s parent is parent_hash
    parent_hash: int | None  # None: the first block is a root block


@dataclass(frozen=True)
class BlockRemoved:
    worker: str
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllCleared:
    worker: str


KVEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(frozen=True)
class WorkerLoad:
    worker: str
    role: str  # "prefill" | "decode" | "both"
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    queued_prefill_tokens: int
