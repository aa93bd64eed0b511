"""Pure tests of layout bookkeeping: compat hashing, cache tensor checks, run merging."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtransfer import BLOCK_MAJOR, BlockRun, KVBlockIdError, KVCompat, KVConfigError, KVLayout, merge_block_runs
from kvtransfer.layout import NO_SCALES, PAGE_SCALES, run_byte_ranges, validate_block_ids

COMPAT = KVCompat("m", "float16", BLOCK_MAJOR, block_size=16, num_layers=4, num_kv_heads=2, head_dim=64)


# ----------------------------------------------------------------- compat


def test_compat_hash_is_stable_and_short():
    again = KVCompat("m", "float16", BLOCK_MAJOR, 16, 4, 2, 64)
    assert COMPAT.compat_hash() == again.compat_hash()
    assert len(COMPAT.compat_hash()) == 16


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "m2"},
        {"dtype": "bfloat16"},
        {"layout_name": "layer_major"},
        {"block_size": 32},
        {"num_layers": 5},
        {"num_kv_heads": 4},
        {"head_dim": 128},
        {"scale_layout": PAGE_SCALES},
    ],
)
def test_every_compat_field_changes_the_hash(change):
    other = dataclasses.replace(COMPAT, **change)
    assert other.compat_hash() != COMPAT.compat_hash()
    (field,) = change
    assert COMPAT.diff(other) == [f"{field}: {getattr(COMPAT, field)!r} != {change[field]!r}"]


def test_same_bytes_per_block_different_geometry_still_differs():
    # 16 tokens x 4 layers == 32 tokens x 2 layers in bytes; the hash must still tell them apart.
    other = dataclasses.replace(COMPAT, block_size=32, num_layers=2)
    assert other.elements_per_block == COMPAT.elements_per_block
    assert other.compat_hash() != COMPAT.compat_hash()


def test_compat_rejects_non_positive_geometry():
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(COMPAT, block_size=0)


# ----------------------------------------------------------------- layout from a cache tensor


def _cache(num_blocks=8, dtype=torch.float16, compat=COMPAT):
    shape = (num_blocks, compat.num_layers, 2, compat.block_size, compat.num_kv_heads, compat.head_dim)
    return torch.zeros(shape, dtype=dtype)


def test_layout_from_block_major_tensor():
    layout = KVLayout.from_tensor(_cache(), COMPAT)
    assert layout.num_blocks == 8
    assert layout.bytes_per_block == 4 * 2 * 16 * 2 * 64 * 2
    assert layout.dtype == "float16"
    assert layout.total_bytes == 8 * layout.bytes_per_block
    assert layout.compat_hash() == COMPAT.compat_hash()


def test_layout_accepts_any_packed_block_tensor():
    flat = torch.zeros(8, COMPAT.elements_per_block, dtype=torch.float16)  # dim 0 = block, rest opaque
    assert KVLayout.from_tensor(flat, COMPAT).bytes_per_block == COMPAT.elements_per_block * 2


def test_layout_rejects_non_packed_blocks():
    padded = torch.zeros(8, COMPAT.elements_per_block + 8, dtype=torch.float16)[:, : COMPAT.elements_per_block]
    with pytest.raises(KVConfigError, match="packed"):
        KVLayout.from_tensor(padded, COMPAT)
    layer_major = _cache().transpose(0, 1)  # dim 0 is no longer the block index in memory
    with pytest.raises(KVConfigError, match="packed"):
        KVLayout.from_tensor(layer_major, COMPAT)


def test_layout_rejects_dtype_or_geometry_mismatch():
    with pytest.raises(KVConfigError, match="dtype"):
        KVLayout.from_tensor(_cache(dtype=torch.bfloat16), COMPAT)
    with pytest.raises(KVConfigError, match="elements"):
        KVLayout.from_tensor(_cache(compat=dataclasses.replace(COMPAT, head_dim=32)), COMPAT)


def test_layout_of_a_quantized_cache_counts_its_scales():
    """An int8 cache (kernels/kv_quant.py: [blocks, layers, 2, page], each page values then fp32 scales) is still
    one packed range per block; its compat names the stored dtype and the scale layout, and a dense peer's compat
    differs in both."""
    from kernels import kv_quant

    int8 = dataclasses.replace(COMPAT, dtype="int8", scale_layout=PAGE_SCALES)
    kv = kv_quant.allocate(8, 4, 16, 2, 64, torch.int8, "cpu")
    layout = KVLayout.from_tensor(kv, int8)
    assert layout.bytes_per_block == 4 * 2 * 16 * 2 * (64 + 4) == kv[0].nbytes
    assert COMPAT.diff(int8) == ["dtype: 'float16' != 'int8'", f"scale_layout: {NO_SCALES!r} != {PAGE_SCALES!r}"]
    with pytest.raises(KVConfigError, match="elements"):  # the values alone: the scales would be missing
        KVLayout.from_tensor(kv, dataclasses.replace(int8, scale_layout=NO_SCALES))
    with pytest.raises(ValueError, match="scale_layout"):
        dataclasses.replace(COMPAT, scale_layout="per_tensor")


# ----------------------------------------------------------------- run merging


def test_merge_contiguous_pairs_into_one_run():
    assert merge_block_runs([4, 5, 6, 7], [10, 11, 12, 13]) == [BlockRun(4, 10, 4)]


def test_merge_splits_where_either_side_breaks():
    runs = merge_block_runs([1, 2, 3, 5, 6], [7, 8, 20, 21, 22])
    assert runs == [BlockRun(1, 7, 2), BlockRun(3, 20, 1), BlockRun(5, 21, 2)]


def test_merge_sorts_unsorted_pairs_by_remote_id():
    assert merge_block_runs([6, 4, 5], [2, 0, 1]) == [BlockRun(4, 0, 3)]
    # sorted by remote, the local side descends: no merging possible
    assert merge_block_runs([1, 2, 3], [9, 8, 7]) == [BlockRun(1, 9, 1), BlockRun(2, 8, 1), BlockRun(3, 7, 1)]


def test_merge_single_and_empty():
    assert merge_block_runs([3], [0]) == [BlockRun(3, 0, 1)]
    assert merge_block_runs([], []) == []


@pytest.mark.parametrize(
    ("remote", "local", "match"),
    [([1, 1], [0, 1], "duplicate remote"), ([0, 1], [2, 2], "duplicate local"), ([0, 1], [0], "2 remote")],
)
def test_merge_rejects_duplicates_and_length_mismatch(remote, local, match):
    with pytest.raises(KVBlockIdError, match=match):
        merge_block_runs(remote, local)


def test_merged_runs_cover_exactly_the_requested_pairs():
    import random

    rng = random.Random(7)
    for _ in range(200):
        remote = rng.sample(range(64), rng.randint(0, 40))
        local = rng.sample(range(64), len(remote))
        runs = merge_block_runs(remote, local)
        pairs = {(r.remote_start + i, r.local_start + i) for r in runs for i in range(r.num_blocks)}
        assert pairs == set(zip(remote, local))
        assert sum(r.num_blocks for r in runs) == len(remote)


def test_run_byte_ranges():
    runs = [BlockRun(4, 0, 3), BlockRun(9, 5, 1)]
    assert run_byte_ranges(runs, 1000, 100, remote=True) == [(1400, 300), (1900, 100)]
    assert run_byte_ranges(runs, 0, 100, remote=False) == [(0, 300), (500, 100)]


def test_validate_block_ids():
    validate_block_ids([0, 3, 7], 8, "local")
    for bad, match in (([8], "out of range"), ([-1], "out of range"), ([1, 1], "twice"), ([1.0], "not an int")):
        with pytest.raises(KVBlockIdError, match=match):
            validate_block_ids(bad, 8, "local")
