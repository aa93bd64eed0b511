import random

import pytest

from engine.kv.block_pool import BlockPool, NoFreeBlocksError
from engine.kv.events import AllCleared, BlockRemoved, BlockStored
from engine.kv.hashing import BlockHasher

B = 4


def _cache(pool, blocks, tokens, hasher):
    hashes = hasher(tokens)
    pool.cache_full_blocks(blocks[: len(hashes)], hashes, tokens, B, 0, None)
    return hashes


def test_allocate_free_accounting():
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert pool.num_used_blocks == 3 and pool.num_free_blocks == 5
    pool.free_blocks(a)
    assert pool.num_free_blocks == 8
    pool.check()
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(9)


def test_prefix_hit_and_events():
    hasher = BlockHasher(B)
    pool = BlockPool(8, worker_id="w0")
    toks = list(range(10))
    blocks = pool.allocate(3)
    hashes = _cache(pool, blocks, toks, hasher)
    assert pool.take_events() == [BlockStored("w0", tuple(hashes), None)]
    pool.free_blocks(reversed(blocks))
    hits = pool.match_prefix(hashes, toks, B)
    assert [b.block_id for b in hits] == [b.block_id for b in blocks[:2]]
    pool.touch(hits)
    assert all(b.ref_count == 1 for b in hits)
    pool.check()


def test_hit_rechecks_tokens_on_hash_collision():
    pool = BlockPool(4)
    [blk] = pool.allocate(1)
    pool.cache_full_blocks([blk], [1234], [1, 2, 3, 4], B, 0, None)
    assert pool.get_cached_block(1234, [1, 2, 3, 4]) is blk
    assert pool.get_cached_block(1234, [1, 2, 3, 5]) is None  # same hash, other tokens: no hit


def test_empty_blocks_used_before_evicting_cached_lru_order():
    hasher = BlockHasher(B)
    pool = BlockPool(4, worker_id="w")
    b1 = pool.allocate(1)
    h1 = _cache(pool, b1, [1, 1, 1, 1], hasher)
    b2 = pool.allocate(1)
    h2 = _cache(pool, b2, [2, 2, 2, 2], hasher)
    pool.free_blocks(b1)
    pool.free_blocks(b2)
    pool.take_events()
    got = pool.allocate(2)  # two empty blocks exist: nothing evicted
    assert pool.num_cached_blocks == 2 and pool.take_events() == []
    pool.allocate(1)  # now the least recently freed cached block (b1) goes
    assert pool.take_events() == [BlockRemoved("w", tuple(h1))]
    assert pool.match_prefix(h2, [2, 2, 2, 2], B) == b2
    pool.free_blocks(got)
    pool.check()


def test_duplicate_hash_keeps_first_block():
    hasher = BlockHasher(B)
    pool = BlockPool(4)
    a, b = pool.allocate(1), pool.allocate(1)
    _cache(pool, a, [5] * 4, hasher)
    pool.take_events()
    _cache(pool, b, [5] * 4, hasher)
    assert pool.take_events() == []
    assert b[0].block_hash is None
    pool.free_blocks(a + b)
    pool.check()


def test_double_free_is_an_error():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free_blocks(blocks)
    with pytest.raises(RuntimeError):
        pool.free_blocks(blocks)


def test_reset_prefix_cache():
    pool = BlockPool(4, worker_id="w")
    blocks = pool.allocate(1)
    _cache(pool, blocks, [1, 2, 3, 4], BlockHasher(B))
    assert not pool.reset_prefix_cache()  # in use
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.take_events()[-1] == AllCleared("w")
    pool.check()


def test_random_operations_keep_invariant():
    rng = random.Random(0)
    hasher = BlockHasher(B)
    pool = BlockPool(16)
    held: list[list] = []
    for _ in range(500):
        if held and rng.random() < 0.45:
            pool.free_blocks(reversed(held.pop(rng.randrange(len(held)))))
        else:
            toks = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
            hashes = hasher(toks)
            hits = pool.match_prefix(hashes, toks, B)
            need = -(-len(toks) // B) - len(hits)
            if not pool.can_allocate(need + sum(b.ref_count == 0 for b in hits)):
                continue
            pool.touch(hits)
            blocks = hits + pool.allocate(need)
            pool.cache_full_blocks(blocks[len(hits):len(hashes)], hashes[len(hits):], toks, B, len(hits),
                                   hashes[len(hits) - 1] if hits else None)
            held.append(blocks)
        pool.check()
    for blocks in held:
        pool.free_blocks(blocks)
    pool.check()
    assert pool.num_free_blocks == 16
