"""The workers one rank reads KV from, whatever their tensor-parallel split or KV dtype (a rank of a one-rank worker
too).

A peer of the same layout (kvtransfer/layout.py ``KVCompat``: same heads per rank, same number of ranks, same KV
dtype) is read rank to rank with this rank's reading agent: rank r of ours reads rank r of theirs, whole blocks. A
peer of another split is read through a ``SplitReader`` (kvtransfer/split_reader.py; one per split): every peer rank
holding some of our heads, whole blocks into staging, our heads copied into place. A peer whose cache holds the model
dtype while ours is quantized, or the other way round (mixed precision across pools), is read through a
``ConvertReader`` (kvtransfer/convert_reader.py; one per peer layout): its blocks into staging, converted into ours by
``store_blocks`` (prefill_worker/engine_facts.py ``block_store``: our store kernel, or a dequantization). Either way the handshake checks the layouts and names both when they cannot exchange
blocks at all (another model, block size, a KV dtype pairing nothing converts). Peers are known by their rank-0
agent name (the handoff's ``source``). One thread uses a ``Sources``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtransfer import KVCompat, KVCompatError, KVTransferError, NixlTransport, PeerInfo
from kvtransfer.convert_reader import ConvertReader, StoreBlocks
from kvtransfer.split_reader import SplitReader


class Sources:
    def __init__(self, kv: torch.Tensor, compat: KVCompat, rank: int, agent_name: str,
                 reader: NixlTransport | None = None, store_blocks: StoreBlocks | None = None) -> None:
        """``reader``: the rank's reading agent (made here if not given); ``store_blocks``: staged blocks of
        another KV dtype -> ours, for peers whose KV dtype converts into ours (None: such peers are refused)."""
        self.kv, self.compat, self.rank, self.agent_name = kv, compat, rank, agent_name
        self.reader = reader or NixlTransport(kv, compat, agent_name=agent_name)
        self.store_blocks = store_blocks
        self._splits: dict[KVCompat, SplitReader] = {}
        self._converts: dict[KVCompat, ConvertReader] = {}
        # rank-0 agent name -> ("same", our rank's peer) | ("split", reader) | ("convert", reader)
        self._peers: dict[str, tuple[str, object]] = {}

    def same_split(self, peer: PeerInfo) -> bool:
        theirs = peer.layout.compat
        return (theirs.tp_size, theirs.num_kv_heads) == (self.compat.tp_size, self.compat.num_kv_heads)

    def add(self, peer: PeerInfo) -> str:
        """Handshake with a worker (``peer``: its rank 0, listing the others); returns its name."""
        compat = peer.layout.compat
        if compat.dtype != self.compat.dtype:  # mixed precision: converted on the pull, or refused naming both
            self._peers[peer.agent_name] = ("convert", self._add_convert(peer))
        elif self.same_split(peer):
            self._peers[peer.agent_name] = ("same", self.reader.add_peer(self._rank_peer(peer)))
        else:
            split = self._splits.get(compat)
            if split is None:
                split = SplitReader(self.kv, self.compat, self.rank, compat,
                                    f"{self.agent_name}-from-tp{compat.tp_size}")
                self._splits[compat] = split
            split.add_peer(peer)
            self._peers[peer.agent_name] = ("split", split)
        return peer.agent_name

    def _rank_peer(self, peer: PeerInfo) -> PeerInfo:
        """The rank of worker ``peer`` this rank reads (the same-numbered one)."""
        return peer if self.rank == 0 else peer.tp_ranks[self.rank - 1]

    def _add_convert(self, peer: PeerInfo) -> ConvertReader:
        compat = peer.layout.compat
        convert = self._converts.get(compat)
        if convert is None:
            if self.store_blocks is None:
                raise KVCompatError(f"peer {peer.agent_name!r} holds {compat.dtype} KV, ours {self.compat.dtype}, "
                                    "and this reader converts nothing")
            convert = ConvertReader(self.kv, self.compat, compat, f"{self.agent_name}-from-{compat.dtype}",
                                    self.store_blocks)
            self._converts[compat] = convert
        convert.add_peer(peer, self._rank_peer(peer))
        return convert

    def knows(self, name: str) -> bool:
        return name in self._peers

    def is_staged(self, name: str) -> bool:
        """Read through staging (another split, another KV dtype), not straight into our cache."""
        return self._peers.get(name, ("same",))[0] != "same"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._peers)

    def remove(self, names: Sequence[str] | None) -> list[str]:
        """Forget workers (None: every one); returns those known."""
        known = [n for n in (self.names if names is None else names) if n in self._peers]
        for name in known:
            kind, target = self._peers.pop(name)
            if kind == "same":
                self.reader.remove_peer(target)
            else:
                target.remove_peer(name)
        return known

    def read(self, source: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int], timeout_s: float,
             notif: bytes = b"") -> int:
        """This rank's heads of ``source``'s blocks into ours (``notif`` to its rank 0 once they landed); bytes read."""
        if source not in self._peers:
            raise KVTransferError(f"unknown peer {source!r} (no handshake)")
        kind, target = self._peers[source]
        if kind == "same":
            return self.reader.read_blocks(target, remote_block_ids, local_block_ids, notif=notif,
                                           timeout_s=timeout_s).num_bytes
        if kind == "convert":
            return target.read(source, remote_block_ids, local_block_ids, timeout_s, notif=notif)
        moved = target.read(source, remote_block_ids, local_block_ids, timeout_s)
        if notif:
            target.notify(source, notif)
        return moved

    def notify(self, source: str, payload: bytes) -> None:
        kind, target = self._peers[source]
        if kind == "same":
            self.reader.send_notif(target, payload)
        else:
            target.notify(source, payload)

    def close(self) -> None:
        for reader in (*self._splits.values(), *self._converts.values()):
            reader.close()
