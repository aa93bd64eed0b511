"""Reading a handoff from a worker of another tensor-parallel split (kvtransfer/tp_split.py says which heads come
from which peer rank).

One ``SplitReader`` per peer split on each rank: a staging tensor shaped like ``staging_blocks`` of the peer
ranks' blocks, registered with a NIXL agent of its own (its layout is the peer's, so the handshake's compat
check is the usual one), and the rank's own cache. A read takes the request's blocks in chunks of the staging
size: per source rank in the plan, one NIXL READ of whole blocks into staging, then a copy of the heads this
rank holds into its own blocks. The cost against a same-split handoff: every source block is read whole (a
rank of a narrower split reads heads it drops: ``tp / src_tp`` times the bytes when the peer split is
coarser) and one device copy. Notices travel as in a same-split pull: only the caller decides which READ
carries one.

A quantized cache (``PAGE_SCALES``: each (layer, K|V) page holds its 1-byte values ``[block_size, heads, head_dim]``
and then their fp32 scales ``[block_size, heads]``, engine/kv/cache_dtype.py) splits the same way: each side is cut
into two views with the heads on one axis (``head_views``), and a head moves with its scales. A quantized scale is
per token and head, so a head's bytes are the same on any split.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvtransfer.layout import NO_SCALES, KVCompat
from kvtransfer.nixl_transport import DEFAULT_TRANSFER_TIMEOUT_S, NixlTransport
from kvtransfer.tp_split import check_split_compatible, read_plan
from kvtransfer.wire import PeerInfo

log = logging.getLogger(__name__)

STAGING_BLOCKS = 32


def head_views(kv: torch.Tensor, c: KVCompat) -> list[torch.Tensor]:
    """Views of a cache of layout ``c`` with the KV heads on axis 4: the dense cache itself ``[n, layers, 2,
    block_size, heads, head_dim]``; a quantized one's values (the same shape) and fp32 scales ``[n, layers, 2,
    block_size, heads]`` (views of the one tensor: writing them writes the cache)."""
    if c.scale_layout == NO_SCALES:
        return [kv]
    n, layers = kv.shape[0], kv.shape[1]
    values = c.block_size * c.num_kv_heads * c.head_dim
    shape = (n, layers, 2, c.block_size, c.num_kv_heads)
    return [kv[..., :values].view(*shape, c.head_dim), kv[..., values:].view(torch.float32).view(shape)]


class SplitReader:
    def __init__(self, kv: torch.Tensor, compat: KVCompat, rank: int, peer_compat: KVCompat, agent_name: str,
                 staging_blocks: int = STAGING_BLOCKS) -> None:
        """``kv``: this rank's cache [blocks, layers, 2, block_size, its heads, head_dim]; ``compat``: its layout
        (rank ``rank`` of ``compat.tp_size``); ``peer_compat``: the layout of every rank of the peer split."""
        check_split_compatible(compat, peer_compat, agent_name)
        self.kv, self.compat, self.rank, self.peer_compat = kv, compat, rank, peer_compat
        p = peer_compat
        if p.scale_layout == NO_SCALES:
            shape = (staging_blocks, p.num_layers, 2, p.block_size, p.num_kv_heads, p.head_dim)
        else:  # a page: values, then a 4-byte scale per (token, head)
            shape = (staging_blocks, p.num_layers, 2, p.block_size * p.num_kv_heads * (p.head_dim + 4))
        self.staging = torch.empty(shape, dtype=kv.dtype, device=kv.device)
        self.transport = NixlTransport(self.staging, peer_compat, agent_name=agent_name)
        self.plan = read_plan(rank, compat.tp_size, peer_compat.tp_size, compat.total_kv_heads)
        self.peers: dict[str, tuple[str, ...]] = {}  # a peer's rank-0 agent name -> every rank's agent name
        log.info("split reader %s: rank %d of %d reads %s from a %d-way split", agent_name, rank, compat.tp_size,
                 [(c.src_rank, c.count) for c in self.plan], peer_compat.tp_size)

    def add_peer(self, peer: PeerInfo) -> str:
        """Handshake with every rank of a peer worker (``peer`` is its rank 0, ``peer.tp_ranks`` the others)."""
        ranks = (peer, *peer.tp_ranks)
        if len(ranks) != self.peer_compat.tp_size:
            raise ValueError(f"peer {peer.agent_name!r} lists {len(ranks)} ranks, its layout says "
                             f"{self.peer_compat.tp_size}")
        self.peers[peer.agent_name] = tuple(self.transport.add_peer(r) for r in ranks)
        return peer.agent_name

    def remove_peer(self, name: str) -> None:
        for rank_name in self.peers.pop(name, ()):
            self.transport.remove_peer(rank_name)

    def read(self, peer_name: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
             timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S) -> int:
        """Copy this rank's heads of the peer's blocks ``remote_block_ids[i]`` into our ``local_block_ids[i]``;
        returns the bytes read."""
        names = self.peers[peer_name]
        n, size, moved = len(remote_block_ids), self.staging.shape[0], 0
        for lo in range(0, n, size):
            remote, local = list(remote_block_ids[lo: lo + size]), list(local_block_ids[lo: lo + size])
            dst = torch.tensor(local, dtype=torch.long, device=self.kv.device)
            for copy in self.plan:
                moved += self.transport.read_blocks(names[copy.src_rank], remote, list(range(len(remote))),
                                                    timeout_s=timeout_s).num_bytes
                for ours, staged in zip(head_views(self.kv, self.compat), head_views(self.staging, self.peer_compat)):
                    src = staged[: len(remote), :, :, :, copy.src_start: copy.src_start + copy.count]
                    ours[dst, :, :, :, copy.dst_start: copy.dst_start + copy.count] = src
            if self.kv.is_cuda:  # the copies landed before anyone is told the blocks are here
                torch.cuda.synchronize(self.kv.device)
        return moved

    def notify(self, peer_name: str, payload: bytes) -> None:
        """A notice to the peer's rank 0 (the lease holder)."""
        self.transport.send_notif(self.peers[peer_name][0], payload)

    def close(self) -> None:
        self.transport.close()
