import struct

import pytest
import xxhash

from engine.errors import InvalidRequestError
from engine.kv.hashing import BlockHasher, hash_block, hash_blocks, kv_namespace, root_hash, salted_root
from engine.request import MAX_CACHE_SALT_CHARS, SamplingParams


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


def test_a_quantized_kv_dtype_has_its_own_namespace():
    """engine/kv/hashing.py kv_namespace: auto keeps the namespace (hashes of a model-dtype cache unchanged); each
    quantized dtype, with or without a namespace of its own, gets another root, so none of their blocks match."""
    toks = list(range(32))
    assert kv_namespace("", "auto") == "" and kv_namespace("lora-x", "auto") == "lora-x"
    roots = {BlockHasher(16, 0, kv_namespace(ns, kv)).root for ns in ("", "lora-x")
             for kv in ("auto", "int8", "fp8_e4m3", "fp8_e5m2")}
    assert len(roots) == 8
    assert BlockHasher(16, 0, kv_namespace("", "int8"))(toks) != BlockHasher(16)(toks)


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


# ---- salts (tenant isolation) ------------------------------------------------------------------------


def test_salted_root_formula_matches_contract():
    root = root_hash(3, "m")
    want = xxhash.xxh3_64_intdigest(b"duet-salt/v1" + struct.pack("<Q", root)
                                    + struct.pack("<I", 3) + b"ten" + struct.pack("<I", 2) + "é".encode())
    assert salted_root(root, ("ten", "é")) == want
    assert salted_root(root, ()) == root


def test_a_salt_changes_every_block_hash_and_the_same_salt_shares():
    h = BlockHasher(4)
    toks = list(range(20))
    plain, a, a2, b = h(toks), h(toks, ("", "a")), h(toks, ("", "a")), h(toks, ("", "b"))
    assert len(plain) == len(a) == 5
    assert a == a2
    assert not set(a) & set(plain) and not set(a) & set(b) and not set(b) & set(plain)


@pytest.mark.parametrize("x, y", [(("ab", "c"), ("a", "bc")), (("", "x"), ("x", "")), (("x",), ("x", "")),
                                  (("t", ""), ("", "t"))])
def test_salt_parts_do_not_run_into_each_other(x, y):
    assert salted_root(0, x) != salted_root(0, y)


def test_a_salt_is_a_sequence_of_strings_not_a_string():
    with pytest.raises(TypeError):
        BlockHasher(4)(list(range(8)), "tenant")


def test_salted_incremental_extend_equals_full():
    h = BlockHasher(4)
    toks = list(range(23))
    inc: list[int] = []
    for n in range(len(toks) + 1):
        h.extend(inc, toks[:n], ("k", "s"))
    assert inc == h(toks, ("k", "s")) != h(toks)


def test_sampling_params_hash_salt_keeps_tenant_and_request_salt_apart():
    assert SamplingParams().hash_salt == ()
    assert SamplingParams(cache_salt="x").hash_salt == ("", "x")
    assert SamplingParams(tenant_salt="x").hash_salt == ("x", "")
    assert SamplingParams(tenant_salt="t", cache_salt="x").hash_salt == ("t", "x")
    assert "secret" not in repr(SamplingParams(cache_salt="secret", tenant_salt="secret"))  # never in logs


@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT_CHARS + 1), 5, b"bytes"])
@pytest.mark.parametrize("name", ["cache_salt", "tenant_salt"])
def test_bad_salts_are_refused(name, salt):
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**{name: salt})
    SamplingParams(**{name: "x" * MAX_CACHE_SALT_CHARS})  # the bound itself is fine
