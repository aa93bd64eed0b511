import struct

import xxhash

from engine.hashing import BlockHasher, hash_block, hash_blocks, root_hash


def test_hash_formula_matches_contract():
    parent = 0x0123456789ABCDEF
    tokens = [1, 2, 70000, 4]
    expected = xxhash.xxh3_64_intdigest(struct.pack("<Q", parent) + struct.pack("<4I", *tokens))
    assert hash_block(parent, tokens) == expected


def test_chain_and_only_full_blocks():
    root = root_hash(7, "m")
    toks = list(range(10))
    hs = hash_blocks(toks, 4, root)
    assert len(hs) == 2  # the partial third block is not hashed
    assert hs[0] == hash_block(root, toks[0:4])
    assert hs[1] == hash_block(hs[0], toks[4:8])


def test_seed_and_namespace_change_every_hash():
    toks = list(range(32))
    a = BlockHasher(16, 0, "")(toks)
    assert a != BlockHasher(16, 1, "")(toks)
    assert a != BlockHasher(16, 0, "lora-x")(toks)
    assert BlockHasher(16, 0, "").fingerprint != BlockHasher(8, 0, "").fingerprint


def test_incremental_extend_equals_full():
    h = BlockHasher(4)
    toks = list(range(23))
    inc: list[int] = []
    for n in range(len(toks) + 1):
        h.extend(inc, toks[:n])
    assert inc == h(toks)


def test_same_block_different_prefix_differs():
    h = BlockHasher(4)
    assert h([1, 2, 3, 4, 9, 9, 9, 9])[1] != h([5, 6, 7, 8, 9, 9, 9, 9])[1]
