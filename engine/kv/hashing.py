"""Block hashing — the contract shared by the block pool, the KV events and the router (DESIGN.md).

``hash(block i) = xxh3_64(parent_hash as u64 LE ‖ token ids of the block as u32 LE)``; the chain's root is
``xxh3_64(b"duet-root/v1" ‖ hash_seed as u64 LE ‖ namespace utf-8)``. Only full blocks are hashed.

A request may carry a salt (tenant isolation: a per-API-key salt and the client's ``cache_salt``, see
``SamplingParams.hash_salt``): a tuple of strings that replaces the root by ``salted_root(root, salt) =
xxh3_64(b"duet-salt/v1" ‖ root as u64 LE ‖ for each part: its utf-8 length as u32 LE ‖ the utf-8 bytes)``.
Changing the root changes every block hash of the chain, so a salted request shares no block with an
unsalted one or with a request salted differently, and requests with the same salt share as usual (vLLM
mixes its ``cache_salt`` into the first block's hash; the effect is the same). The length prefixes keep
the parts apart: ``("ab", "c")`` and ``("a", "bc")`` are different salts, and so are ``("", "x")`` and
``("x", "")``. The empty salt ``()`` leaves the root as it is. Everyone who hashes a request's blocks
(the scheduler, the decode side of a handoff, the router) passes the request's salt.

The hash is 64 bits wide. The engine's block pool re-checks a hit's token ids against the block it
found (so a collision can never corrupt an engine's output); the router does not see tokens and accepts
the ~2^-64 chance of a wrong routing hint, which costs speed, never correctness. Isolation between salts
rests on the hash alone (the token check passes: the tokens are the same): two salted roots collide with
probability ~2^-64, and a tenant cannot aim at another's root without knowing that tenant's salt.

An engine whose KV cache is quantized (``kv_cache_dtype`` int8, fp8_*) hashes in ``kv_namespace(namespace,
kv_cache_dtype)``: the same tokens give other bytes there, so its blocks must never match a block of another KV
dtype, in the engine (a tier, a peer) or in the router's index. The namespace is per party, so it is in the
fingerprint, and a router and a worker that disagree on the KV dtype are refused at registration. ``auto`` leaves
the namespace as it is (the hashes of a model-dtype cache do not change).

Pure Python + xxhash: no torch import, so the router uses the very same function.
"""
from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

HASH_VERSION = 1
_LE = sys.byteorder == "little"


def root_hash(hash_seed: int = 0, namespace: str = "") -> int:
    """The parent of a sequence's first block."""
    seed = int(hash_seed) & 0xFFFFFFFFFFFFFFFF
    return xxhash.xxh3_64_intdigest(b"duet-root/v1" + seed.to_bytes(8, "little") + namespace.encode())


def kv_namespace(namespace: str, kv_cache_dtype: str) -> str:
    """The block-hash namespace of an engine whose KV cache stores ``kv_cache_dtype`` (EngineConfig's): ``auto``
    keeps ``namespace``; a quantized dtype appends itself after a unit separator (0x1f, which no config name holds)."""
    if kv_cache_dtype == "auto":
        return namespace
    return f"{namespace}\x1fkv_cache_dtype={kv_cache_dtype}"


def salted_root(root: int, salt: Sequence[str]) -> int:
    """The root of a chain salted with ``salt`` (parts in order; ``()``: ``root`` itself)."""
    if isinstance(salt, (str, bytes)):
        raise TypeError("a salt is a sequence of strings, not one string")
    if not salt:
        return root
    buf = bytearray(b"duet-salt/v1")
    buf += root.to_bytes(8, "little")
    for part in salt:
        data = part.encode()
        buf += len(data).to_bytes(4, "little")
        buf += data
    return xxhash.xxh3_64_intdigest(bytes(buf))


def _u32_bytes(token_ids: Sequence[int]) -> bytes:
    buf = array("I", token_ids)
    if not _LE:
        buf.byteswap()
    return buf.tobytes()


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    return xxhash.xxh3_64_intdigest(parent_hash.to_bytes(8, "little") + _u32_bytes(token_ids))


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent_hash: int,
    start_block: int = 0,
) -> list[int]:
    """Hashes of full blocks ``start_block, start_block+1, …`` of ``token_ids``.

    ``parent_hash`` is the hash of block ``start_block - 1`` (the root for ``start_block == 0``), so a
    request extends its hash chain incrementally as tokens arrive.
    """
    num_full = len(token_ids) // block_size
    if start_block >= num_full:
        return []
    raw = _u32_bytes(token_ids[start_block * block_size : num_full * block_size])
    width = 4 * block_size
    out = []
    parent = parent_hash
    digest = xxhash.xxh3_64_intdigest
    for off in range(0, len(raw), width):
        parent = digest(parent.to_bytes(8, "little") + raw[off : off + width])
        out.append(parent)
    return out


class BlockHasher:
    """Binds block size, seed and namespace: one object per engine / router, compared at registration."""

    def __init__(self, block_size: int, hash_seed: int = 0, namespace: str = "") -> None:
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.namespace = namespace
        self.root = root_hash(hash_seed, namespace)

    def __call__(self, token_ids: Sequence[int], salt: Sequence[str] = ()) -> list[int]:
        return hash_blocks(token_ids, self.block_size, salted_root(self.root, salt))

    def extend(self, hashes: list[int], token_ids: Sequence[int], salt: Sequence[str] = ()) -> None:
        """Append the hashes of blocks that became full since ``hashes`` was last extended. ``salt`` is the
        request's (the same on every call: it only matters for the first block)."""
        if len(token_ids) // self.block_size <= len(hashes):
            return  # no block became full (most decode steps)
        parent = hashes[-1] if hashes else salted_root(self.root, salt)
        hashes.extend(hash_blocks(token_ids, self.block_size, parent, start_block=len(hashes)))

    @property
    def fingerprint(self) -> tuple[int, int, int, str]:
        """What two parties must agree on to share hashes; a mismatch must be refused at registration."""
        return (HASH_VERSION, self.block_size, self.hash_seed, self.namespace)
