"""Reading a handoff from a worker whose KV cache stores another dtype: mixed precision across pools.

A prefill pool may keep its KV at the model dtype (``kv_cache_dtype: auto``: its prefix cache at full precision)
while the decode pool stores 1-byte values with scales (int8, fp8: ~3.8x the tokens per GiB), or the other way round
(a quantized prefill pool, its prefix cache holding ~3.8x the tokens, feeding a decode pool that keeps the model
dtype for the tokens it generates). The decode side converts on the pull: one ``ConvertReader`` per peer layout on
each rank, a staging tensor shaped like ``staging_blocks`` of the peer's blocks and registered with a NIXL agent of
its own (its layout is the peer's, so the handshake's compat check is the usual one), and ``store_blocks``, what the
rank writes into its cache from staged blocks (prefill_worker/engine_facts.py ``block_store``). A read takes the
request's blocks in chunks of the staging size: one NIXL READ of whole blocks into staging, then the store converts
every row into our blocks. Quantized ours: the rank's own store kernel (kernels/kv_quant.py ``store_blocks``), the
bytes our engine would have written for those K/V rows. Model dtype ours: each value times its scale in fp32
(kernels/kv_quant.py ``dequantize_blocks``, what the quantized engine's attention reads) cast to our dtype, exact
for fp32. The lease's notice rides on the last READ (the peer's blocks are free once their bytes are in staging).

Why the decode side converts, not the prefill side. Measured (``python -m bench.kv.convert``: 64 blocks = 1,024
tokens of SmolLM2-135M's KV, 30 layers x 3 KV heads x 64, two processes on this 2-vCPU host, NIXL over UCX's cma,
1 thread, under the bench lock, 2026-11-28): the wire carries 45.0 MiB of fp32 vs 11.95 MiB of int8 (3.76x), read
in 9.3 vs 2.8 ms; the conversion (the C int8 store over every row, 30.7 ms; 29.1 ms at 2 threads) costs the same on
either side and dominates: 40.0 ms converting on the pull vs 33.5 ms converting before sending. Sending int8 would
save 6.5 ms a handoff here (more where KV crosses a slow network: at ~1 GB/s, ~35 ms), but the prefill worker would
spend those 30 ms of compute on every block of every handoff — the prefill pool is the compute-bound one — into a
registered send buffer, including the blocks the decode worker finds in its own prefix cache and never reads, and
it would have to know each reader's dtype. On the pull, the quantization runs on the decode worker's transfer
thread (off its engine thread), only for the blocks it lacks, and the protocol (PeerInfo, leases, block ids) stays
the one every other pull uses.

Which pairings convert (``check_convertible``): a peer of a model-dtype cache (no scales) and ours quantized
(``PAGE_SCALES``), or a quantized peer and ours of a model dtype, everything else in ``KVCompat`` equal (same
tensor-parallel split too: each rank converts the same-numbered peer rank's blocks). Every other difference (two
quantized dtypes, two model dtypes, another split at once) is refused with both layouts named.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from kvtransfer.errors import KVCompatError
from kvtransfer.layout import NO_SCALES, PAGE_SCALES, KVCompat
from kvtransfer.nixl_transport import DEFAULT_TRANSFER_TIMEOUT_S, NixlTransport
from kvtransfer.tp_split import describe
from kvtransfer.wire import PeerInfo

log = logging.getLogger(__name__)

STAGING_BLOCKS = 32
DENSE_DTYPES = ("float32", "bfloat16", "float16")  # what a model-dtype cache holds (engine/kv/cache_dtype.py)

# (staged blocks of the peer's layout: [n, layers, 2, block_size, heads, head_dim] of a model dtype, or [n, layers, 2,
# page] of a quantized cache; our block ids) -> None
StoreBlocks = Callable[[torch.Tensor, Sequence[int]], None]


def _dense(compat: KVCompat) -> bool:
    return compat.scale_layout == NO_SCALES and compat.dtype in DENSE_DTYPES


def check_convertible(ours: KVCompat, theirs: KVCompat, peer: str) -> None:
    """Raise ``KVCompatError`` naming both layouts unless a pull from ``theirs`` converts into ``ours``: one holds
    a model dtype's values (no scales), the other a quantized page layout, and nothing else differs."""
    diff = [d for d in ours.diff(theirs) if d.split(":")[0] not in ("dtype", "scale_layout")]
    why = None
    if diff:
        why = "; ".join(diff)
    elif _dense(ours) == _dense(theirs):
        kind = "a model dtype" if _dense(ours) else "quantized"
        why = (f"both caches are {kind}: a pull converts between a model dtype ({', '.join(DENSE_DTYPES)}) and a "
               "quantized cache only")
    elif (theirs if _dense(ours) else ours).scale_layout != PAGE_SCALES:
        quant = theirs if _dense(ours) else ours
        why = f"{quant.dtype} blocks without {PAGE_SCALES} scales: nothing converts them"
    if why is not None:
        raise KVCompatError(f"peer {peer!r}: KV blocks cannot move between these caches: ours {describe(ours)}, "
                            f"theirs {describe(theirs)} ({why})")


class ConvertReader:
    def __init__(self, kv: torch.Tensor, compat: KVCompat, peer_compat: KVCompat, agent_name: str,
                 store_blocks: StoreBlocks, staging_blocks: int = STAGING_BLOCKS) -> None:
        """``kv``: this rank's cache; ``compat``: its layout; ``peer_compat``: the layout of the peer rank it reads
        (the same-numbered rank of a worker of the same split); ``store_blocks``: staged blocks -> ours."""
        check_convertible(compat, peer_compat, agent_name)
        self.kv, self.compat, self.peer_compat, self.store_blocks = kv, compat, peer_compat, store_blocks
        p = peer_compat
        if p.scale_layout == PAGE_SCALES:  # [blocks, layers, K|V, page]: values, then their scales
            shape = (staging_blocks, p.num_layers, 2, p.block_size * p.num_kv_heads * (p.head_dim + 4))
        else:
            shape = (staging_blocks, p.num_layers, 2, p.block_size, p.num_kv_heads, p.head_dim)
        self.staging = torch.empty(shape, dtype=getattr(torch, peer_compat.dtype), device=kv.device)
        self.transport = NixlTransport(self.staging, peer_compat, agent_name=agent_name)
        self.peers: dict[str, str] = {}  # a peer's rank-0 agent name -> the agent of the rank this rank reads
        log.info("convert reader %s: %s blocks converted into %s on the pull (%d staging blocks)", agent_name,
                 peer_compat.dtype, compat.dtype, staging_blocks)

    def add_peer(self, peer: PeerInfo, rank_peer: PeerInfo) -> str:
        """Handshake with ``rank_peer``, the rank of worker ``peer`` (its rank 0) this rank reads."""
        self.peers[peer.agent_name] = self.transport.add_peer(rank_peer)
        return peer.agent_name

    def remove_peer(self, name: str) -> None:
        rank_name = self.peers.pop(name, None)
        if rank_name is not None:
            self.transport.remove_peer(rank_name)

    def read(self, peer_name: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
             timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S, notif: bytes = b"") -> int:
        """The peer's blocks ``remote_block_ids[i]``, converted, into our ``local_block_ids[i]`` (``notif`` on the
        last READ); returns the bytes read."""
        name = self.peers[peer_name]
        n, size, moved = len(remote_block_ids), self.staging.shape[0], 0
        if n == 0 and notif:
            self.transport.send_notif(name, notif)
        for lo in range(0, n, size):
            remote, local = list(remote_block_ids[lo: lo + size]), list(local_block_ids[lo: lo + size])
            last = lo + size >= n
            moved += self.transport.read_blocks(name, remote, list(range(len(remote))), notif=notif if last else b"",
                                                timeout_s=timeout_s).num_bytes
            self.store_blocks(self.staging[: len(remote)], local)
        if self.kv.is_cuda:  # the stores landed before anyone is told the blocks are here
            torch.cuda.synchronize(self.kv.device)
        return moved

    def notify(self, peer_name: str, payload: bytes) -> None:
        self.transport.send_notif(self.peers[peer_name], payload)

    def close(self) -> None:
        self.transport.close()
