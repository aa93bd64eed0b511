"""KV handoff between workers of different tensor-parallel splits: which heads each rank holds, and where a rank
reads each of its heads from. Pure bookkeeping (no torch, no nixl), tested on its own.

A worker of ``tp`` ranks over a model of ``total`` KV heads: with tp <= total each rank holds ``total / tp``
consecutive heads; with more ranks than heads each head is replicated and rank r holds head ``r * total // tp``
(engine/models/tensor_parallel.py, the same rule). A block's bytes on one rank are [layers, K/V, tokens, its heads,
head_dim] (the block-major layout), so a rank of another split cannot read its heads as one range of a peer's block: it
reads whole blocks of every peer rank holding some of its heads (a staging buffer, kvtransfer/split_reader.py)
and copies those heads into place. ``read_plan`` says which.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.errors import KVCompatError
from kvtransfer.layout import NO_SCALES, KVCompat


def rank_heads(rank: int, tp: int, total: int) -> range:
    """The global KV heads rank ``rank`` of ``tp`` holds."""
    if tp <= total:
        per = total // tp
        return range(rank * per, (rank + 1) * per)
    head = rank * total // tp
    return range(head, head + 1)


def holder(head: int, tp: int, total: int) -> int:
    """The lowest rank of a ``tp``-way split that holds ``head``."""
    if tp <= total:
        return head // (total // tp)
    return -(-head * tp // total)  # ceil(head * tp / total): the first r with r * total // tp == head


@dataclass(frozen=True)
class HeadCopy:
    """Heads [src_start, src_start + count) of source rank ``src_rank``'s block go to [dst_start, ...) of ours."""

    src_rank: int
    src_start: int
    dst_start: int
    count: int


def read_plan(rank: int, tp: int, src_tp: int, total: int) -> list[HeadCopy]:
    """Where rank ``rank`` of a ``tp``-way split finds each of its heads in a ``src_tp``-way split of the same
    ``total`` heads: one copy per source rank, in head order."""
    need = rank_heads(rank, tp, total)
    plan, head = [], need.start
    while head < need.stop:
        src = holder(head, src_tp, total)
        have = rank_heads(src, src_tp, total)
        count = min(need.stop, have.stop) - head
        plan.append(HeadCopy(src, head - have.start, head - need.start, count))
        head += count
    return plan


_SPLIT_FIELDS = ("num_kv_heads", "tp_size")


def check_split_compatible(ours: KVCompat, theirs: KVCompat, peer: str) -> None:
    """Raise ``KVCompatError`` naming both layouts unless the two caches differ in their split alone (same model,
    dtype and scale layout, layout, block size and geometry, same total of KV heads)."""
    diff = [d for d in ours.diff(theirs) if d.split(":")[0] not in _SPLIT_FIELDS]
    if diff:
        raise KVCompatError(f"peer {peer!r} has an incompatible KV layout: ours {describe(ours)}, theirs "
                            f"{describe(theirs)} ({'; '.join(diff)})")


def describe(c: KVCompat) -> str:
    """One layout in a line: what an error names."""
    scales = "" if c.scale_layout == NO_SCALES else f" + scales {c.scale_layout}"
    return (f"[{c.model_id} {c.dtype}{scales} {c.layout_name} block {c.block_size} x {c.num_layers} layers x "
            f"{c.num_kv_heads}/{c.total_kv_heads} KV heads x {c.head_dim}, tp {c.tp_size}]")
