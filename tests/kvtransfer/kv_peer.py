"""A KV owner (prefill-side) worker run in a separate process for the transfer tests and the bench.

The test process is the puller; this process owns a cache filled with a known pattern, publishes its
PeerInfo over a multiprocessing Pipe (so PeerInfo really crosses a process boundary by pickle), holds
leases, and keeps applying release notices from NIXL notifications while it waits for commands.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from kvtransfer import BLOCK_MAJOR, KVCompat, LeaseTable
from kvtransfer.layout import PAGE_SCALES

TEST_COMPAT = KVCompat(
    model_id="duet-test/tiny",
    dtype="bfloat16",
    layout_name=BLOCK_MAJOR,
    block_size=4,
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
)  # 2 KiB per block


def cache_shape(compat: KVCompat, num_blocks: int) -> tuple[int, ...]:
    return (num_blocks, compat.num_layers, 2, compat.block_size, compat.num_kv_heads, compat.head_dim)


def make_pattern_cache(compat: KVCompat, num_blocks: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Deterministic random cache, identical in every process for the same arguments; a quantized compat's
    (``PAGE_SCALES``) holds the same random rows quantized by the reference store (kernels/kv_quant.py's pages)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(cache_shape(compat, num_blocks), generator=generator)
    if compat.scale_layout != PAGE_SCALES:
        return rows.to(device=device, dtype=getattr(torch, compat.dtype))
    from kernels import kv_quant
    from kernels.store_kv import store_kv_ref

    c = compat
    kv = kv_quant.allocate(num_blocks, c.num_layers, c.block_size, c.num_kv_heads, c.head_dim,
                           kv_quant.STORAGE[c.dtype], "cpu")
    layers = kv_quant.layer_views(kv, c.block_size, c.num_kv_heads, c.head_dim)
    kv_quant.store_blocks(store_kv_ref, layers, rows, range(num_blocks), torch.float32)
    return kv.to(device)


@dataclass(frozen=True)
class OwnerSpec:
    compat: KVCompat
    num_blocks: int
    seed: int
    agent_name: str
    ucx_tls: str | None = None  # set before the NIXL agent exists, only in this process
    device: str = "cpu"
    host_blocks: int = 0  # a host KV tier (pattern seeded with seed + 1), readable after the cache's ids


def run_owner(conn, spec: OwnerSpec) -> None:
    """Process entry point: serve commands from `conn` until ("exit", None)."""
    if spec.ucx_tls is not None:
        os.environ["UCX_TLS"] = spec.ucx_tls
    from kvtransfer import NixlTransport

    kv = make_pattern_cache(spec.compat, spec.num_blocks, spec.seed, spec.device)
    released: dict[str, list[int]] = {}
    leases = LeaseTable(on_release=lambda ids: None)
    host = make_pattern_cache(spec.compat, spec.host_blocks, spec.seed + 1) if spec.host_blocks else None
    with NixlTransport(kv, spec.compat, agent_name=spec.agent_name, host=host) as transport:
        conn.send(transport.peer_info())
        while True:
            while not conn.poll(0.002):
                for notice in transport.poll_release_notices():
                    lease = leases.get_lease(notice.lease_id)
                    if leases.release(notice.lease_id, ok=notice.ok):
                        released[notice.lease_id] = list(lease.block_ids)
                leases.expire_overdue()
            command, arg = conn.recv()
            if command == "exit":
                conn.send("bye")
                return
            conn.send(_handle(command, arg, kv, leases, released))


def _handle(command: str, arg, kv: torch.Tensor, leases: LeaseTable, released: dict):
    if command == "lease":
        lease_id, block_ids, timeout_s = arg
        leases.acquire(lease_id, block_ids, timeout_s=timeout_s)
        return "ok"
    if command == "lease_state":  # (still held?, block ids released by notice, counters)
        return arg in leases, released.get(arg), leases.counters
    if command == "blocks":  # raw bytes of the given blocks, for push checks
        return kv[list(arg)].view(torch.int16).cpu()
    if command == "ping":
        return time.monotonic()
    raise ValueError(f"unknown command {command!r}")
