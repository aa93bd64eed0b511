"""Block pool: the KV cache's bookkeeping. No torch — constructed and tested on CPU in microseconds.

Every physical block is in exactly one of three states:
  * used — ``ref_count > 0`` (held by one or more requests, or pinned under a transfer lease);
  * free, cached — ``ref_count == 0`` and registered under its block hash: reusable as a prefix hit
    until evicted; kept in LRU order (least recently freed evicted first);
  * free, empty — ``ref_count == 0`` with no hash: handed out before any cached block is evicted.

Invariant (``check``): free_empty + free_cached + used == num_blocks. A prefix hit re-checks the block's
token ids, so a 64-bit hash collision can never put foreign KV into a request. Stores and evictions are
recorded as ``KVEvent``s that the owner drains with ``take_events``.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from engine.kv.events import AllCleared, BlockRemoved, BlockStored, KVEvent


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, worker_id: str = "local") -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.worker_id = worker_id
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_empty: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, Block] = {}
        self._events: list[KVEvent] = []
        self.num_evictions = 0
        self.track_new_cached = False  # the lower KV tiers want every newly cached block (write-through)
        self._new_cached: list[Block] = []

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (empty ones plus cached ones that would be evicted)."""
        return len(self._free_empty) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def get_cached_block(self, block_hash: int, token_ids: Sequence[int]) -> Block | None:
        """The cached block holding exactly these tokens under this hash, or None."""
        block = self._hash_to_block.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def match_prefix(self, block_hashes: Sequence[int], token_ids: Sequence[int], block_size: int) -> list[Block]:
        """Leading blocks of a request that are cached, in order (stops at the first miss)."""
        if not self.enable_caching:
            return []
        hits = []
        for i, h in enumerate(block_hashes):
            block = self.get_cached_block(h, token_ids[i * block_size : (i + 1) * block_size])
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- lifecycle -------------------------------------------------------------------------------
    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found by a prefix match (a free cached block becomes used)."""
        for block in blocks:
            if block.ref_count == 0:
                self._free_cached.pop(block.block_id, None)
                self._free_empty.pop(block.block_id, None)
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[Block]:
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        evicted = []
        for _ in range(num_blocks):
            if self._free_empty:
                block_id, _ = self._free_empty.popitem(last=False)
                block = self.blocks[block_id]
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                block = self.blocks[block_id]
                evicted.append(block.block_hash)
                self._uncache(block)
            block.ref_count = 1
            out.append(block)
        if evicted:
            self.num_evictions += len(evicted)
            self._events.append(BlockRemoved(self.worker_id, tuple(evicted)))
        return out

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        block_size: int,
        first_index: int,
        parent_hash: int | None,
    ) -> None:
        """Register a request's newly completed blocks ``first_index, first_index+1, …`` for prefix reuse.

        ``token_ids`` is the request's whole token sequence; ``parent_hash`` the hash of block
        ``first_index - 1`` (None for the first block). A hash already cached elsewhere (two requests
        computed the same prefix at once) keeps the existing block; this copy stays private.
        """
        if not self.enable_caching:
            return
        run: list[int] = []
        run_parent = parent_hash
        for j, (block, h) in enumerate(zip(blocks, block_hashes)):
            i = first_index + j
            if block.block_hash is not None or h in self._hash_to_block:
                if run:
                    self._events.append(BlockStored(self.worker_id, tuple(run), run_parent))
                    run = []
                run_parent = h
                continue
            block.block_hash = h
            block.token_ids = tuple(token_ids[i * block_size : (i + 1) * block_size])
            self._hash_to_block[h] = block
            run.append(h)
            if self.track_new_cached:
                self._new_cached.append(block)
        if run:
            self._events.append(BlockStored(self.worker_id, tuple(run), run_parent))

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block. Pass a request's blocks tail-first: the tail of a sequence
        is the least likely to be shared, so it should be evicted first."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._free_cached[block.block_id] = None
                else:
                    self._free_empty[block.block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use. Returns whether it did."""
        if self.num_used_blocks:
            return False
        for block_id in list(self._free_cached):
            self._uncache(self.blocks[block_id])
            self._free_empty[block_id] = None
        self._free_cached.clear()
        self._events.append(AllCleared(self.worker_id))
        return True

    def record(self, event: KVEvent) -> None:
        """Queue an event recorded elsewhere (the lower tiers), in order with the pool's own."""
        self._events.append(event)

    def take_new_cached(self) -> list[Block]:
        """Blocks cached since the last call that are still cached under the same hash (``track_new_cached``)."""
        blocks, self._new_cached = self._new_cached, []
        return [b for b in blocks if b.block_hash is not None and self._hash_to_block.get(b.block_hash) is b]

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def snapshot_events(self) -> list[KVEvent]:
        """Events that rebuild this pool's cached set from nothing (a router resyncing after a gap):
        ``AllCleared`` then one ``BlockStored`` per chain-less batch of every hashed block. A query:
        the pending event queue is untouched."""
        hashes = tuple(b.block_hash for b in self.blocks if b.block_hash is not None)
        events: list[KVEvent] = [AllCleared(self.worker_id)]
        if hashes:
            events.append(BlockStored(self.worker_id, hashes, None))
        return events

    def check(self) -> None:
        """Assert the accounting invariant; cheap enough for tests to call after every step."""
        used = [b for b in self.blocks if b.ref_count > 0]
        assert all(b.ref_count >= 0 for b in self.blocks)
        assert len(self._free_empty) + len(self._free_cached) + len(used) == self.num_blocks, (
            len(self._free_empty), len(self._free_cached), len(used), self.num_blocks)
        assert all(self.blocks[i].ref_count == 0 and self.blocks[i].block_hash is None for i in self._free_empty)
        assert all(self.blocks[i].ref_count == 0 and self.blocks[i].block_hash is not None for i in self._free_cached)
        assert all(self._hash_to_block[b.block_hash] is b for b in self.blocks if b.block_hash is not None)

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = None
