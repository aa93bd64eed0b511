"""KV cache layout as seen by the transport, and block ids -> byte ranges.

The transport only needs three facts about an engine's cache tensor: where it starts, how many blocks
it has, and how many bytes one block takes. That works for any tensor whose dim 0 is the block index
and whose blocks are packed back to back (block `i` lives at `base + i * bytes_per_block`), which the
block-major cache `kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` satisfies: one
block (all layers, K and V) is one contiguous byte range, so it moves as ONE descriptor.

Whether two engines can exchange blocks at all is a separate question answered by `KVCompat`: same
model, dtype, in-block layout, block size and layer/head geometry. Its `compat_hash()` is what the
handshake compares; the fields themselves travel too, so a refusal can say *which* field differs.
`VERSION` is the wire protocol version of this package (PeerInfo fields, notice encoding); a bump means
old and new workers refuse each other instead of misreading bytes.

Descriptor merging (`merge_block_runs`) is a pure function: a transfer is a list of (remote id, local
id) pairs; pairs are sorted by remote id and merged while BOTH sides stay consecutive, so a prefix of
`n` blocks that landed in consecutive local blocks is one descriptor of `n * bytes_per_block` bytes.
Per-descriptor cost dominates small-block transfers (the anchors measured tens of thousands of tiny
descriptors as the main cost), hence merging is done here and tested, not left to chance.

No torch or nixl import: this module is bookkeeping and is tested on its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtransfer.errors import KVBlockIdError, KVConfigError

VERSION = 3
"""Wire protocol version; peers with a different VERSION are refused at handshake (2: tensor-parallel workers'
ranks in PeerInfo and KVCompat; 3: KVCompat.scale_layout, a quantized KV cache's blocks)."""

BLOCK_MAJOR = "block_major"
"""Layout name of `kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`."""

NO_SCALES = "none"
"""`KVCompat.scale_layout` of a cache of the model dtype: a block holds the values alone."""

PAGE_SCALES = "fp32_per_token_head_after_page"
"""`KVCompat.scale_layout` of a quantized cache (1-byte values: int8, float8_e4m3fn, float8_e5m2): each (layer,
K|V) page of a block holds its values `[block_size, num_kv_heads, head_dim]`, then one fp32 scale per token and KV
head `[block_size, num_kv_heads]` (engine/kv/cache_dtype.py, kernels/kv_quant.py). The scales travel with the
values, so a block moved by bytes is self-describing; the block, as before, is one contiguous range."""

SCALE_LAYOUTS = (NO_SCALES, PAGE_SCALES)
_SCALE_BYTES = {NO_SCALES: 0, PAGE_SCALES: 4}


@dataclass(frozen=True)
class KVCompat:
    """What must match for two engines' blocks to be interchangeable byte for byte."""

    model_id: str
    # the cache's element dtype as stored, a torch dtype name without the "torch." prefix: the model's ("bfloat16")
    # or a quantized KV cache's ("int8", "float8_e4m3fn", "float8_e5m2")
    dtype: str
    layout_name: str
    block_size: int  # tokens per block
    num_layers: int
    num_kv_heads: int  # in this cache: the rank's own share under tensor parallelism
    head_dim: int
    # tensor parallelism: the worker's ranks, and the model's KV heads their caches split (1 / the same heads:
    # one rank); rank r's cache holds heads [r * num_kv_heads, ...) of total_kv_heads, each on as many ranks as
    # tp_size * num_kv_heads / total_kv_heads (replicated when the ranks outnumber the heads)
    tp_size: int = 1
    total_kv_heads: int = 0  # 0: num_kv_heads
    scale_layout: str = NO_SCALES  # where a quantized cache's scales sit in a block (SCALE_LAYOUTS)

    def __post_init__(self) -> None:
        if not self.total_kv_heads:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        if self.scale_layout not in SCALE_LAYOUTS:
            raise ValueError(f"KVCompat.scale_layout must be one of {SCALE_LAYOUTS}, got {self.scale_layout!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCompat.{name} must be positive, got {getattr(self, name)}")

    @property
    def elements_per_block(self) -> int:
        """K and V for all layers of one block (with PAGE_SCALES: 1-byte values, so the scales' bytes count too)."""
        per_row = self.head_dim + _SCALE_BYTES[self.scale_layout]  # a (token, KV head) row
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * per_row

    def compat_hash(self) -> str:
        """Stable hex digest of every field (sorted JSON, sha256, 16 hex chars)."""
        canonical = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def diff(self, other: KVCompat) -> list[str]:
        """Human-readable `field: ours != theirs` for every differing field."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


@dataclass(frozen=True)
class KVLayout:
    """One engine's cache tensor, as far as moving its blocks is concerned."""

    num_blocks: int
    bytes_per_block: int
    compat: KVCompat

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.bytes_per_block <= 0:
            raise ValueError(f"empty KV layout: {self.num_blocks} blocks x {self.bytes_per_block} B")

    @property
    def dtype(self) -> str:
        return self.compat.dtype

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def compat_hash(self) -> str:
        return self.compat.compat_hash()

    @classmethod
    def from_tensor(cls, kv: Any, compat: KVCompat) -> KVLayout:
        """Layout of a cache tensor (torch.Tensor, duck-typed so this module needs no torch).

        Checks that blocks are packed back to back and that the bytes per block agree with the
        geometry in `compat`, so a misdeclared compat fails here rather than as garbage KV later.
        """
        if kv.dim() < 1 or kv.shape[0] == 0:
            raise KVConfigError(f"cache tensor needs dim 0 = blocks, got shape {tuple(kv.shape)}")
        block = kv[0]
        if not block.is_contiguous() or kv.stride(0) != block.numel():
            raise KVConfigError(
                "cache tensor blocks must be contiguous and packed (stride(0) == numel of one block);"
                f" got shape {tuple(kv.shape)} strides {kv.stride()}"
            )
        dtype = str(kv.dtype).removeprefix("torch.")
        if dtype != compat.dtype:
            raise KVConfigError(f"cache tensor dtype {dtype} != declared compat dtype {compat.dtype}")
        if block.numel() != compat.elements_per_block:
            raise KVConfigError(
                f"one block has {block.numel()} elements but compat geometry implies"
                f" {compat.elements_per_block} (layers*2*block_size*kv_heads*(head_dim + scale bytes))"
            )
        return cls(
            num_blocks=int(kv.shape[0]),
            bytes_per_block=block.numel() * kv.element_size(),
            compat=compat,
        )


@dataclass(frozen=True)
class BlockRun:
    """`num_blocks` consecutive blocks starting at `remote_start` on the peer and `local_start` here."""

    remote_start: int
    local_start: int
    num_blocks: int


def validate_block_ids(block_ids: Sequence[int], num_blocks: int, side: str) -> None:
    """Raise KVBlockIdError unless every id is an int in [0, num_blocks) and none repeats."""
    seen: set[int] = set()
    for block_id in block_ids:
        if not isinstance(block_id, int) or isinstance(block_id, bool):
            raise KVBlockIdError(f"{side} block id {block_id!r} is not an int")
        if not 0 <= block_id < num_blocks:
            raise KVBlockIdError(f"{side} block id {block_id} out of range [0, {num_blocks})")
        if block_id in seen:
            raise KVBlockIdError(f"{side} block id {block_id} appears twice")
        seen.add(block_id)


def merge_block_runs(remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> list[BlockRun]:
    """Pair remote[i] with local[i], sort by remote id, merge where both sides are consecutive.

    Duplicates on either side are rejected: a duplicated destination is a write race, a duplicated
    source is a caller bug. Range checks need the layouts and live in `validate_block_ids`.
    """
    if len(remote_block_ids) != len(local_block_ids):
        raise KVBlockIdError(
            f"{len(remote_block_ids)} remote block ids but {len(local_block_ids)} local block ids"
        )
    for ids, side in ((remote_block_ids, "remote"), (local_block_ids, "local")):
        if len(set(ids)) != len(ids):
            raise KVBlockIdError(f"duplicate {side} block ids in {list(ids)}")
    runs: list[BlockRun] = []
    for remote_id, local_id in sorted(zip(remote_block_ids, local_block_ids)):
        last = runs[-1] if runs else None
        if (
            last is not None
            and remote_id == last.remote_start + last.num_blocks
            and local_id == last.local_start + last.num_blocks
        ):
            runs[-1] = BlockRun(last.remote_start, last.local_start, last.num_blocks + 1)
        else:
            runs.append(BlockRun(remote_id, local_id, 1))
    return runs


def run_byte_ranges(
    runs: Sequence[BlockRun], base_addr: int, bytes_per_block: int, *, remote: bool
) -> list[tuple[int, int]]:
    """(address, length) of each run on one side: the remote side if `remote`, else the local one."""
    ranges = []
    for run in runs:
        start = run.remote_start if remote else run.local_start
        ranges.append((base_addr + start * bytes_per_block, run.num_blocks * bytes_per_block))
    return ranges
