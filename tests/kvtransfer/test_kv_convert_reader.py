"""Converting on the pull (kvtransfer/convert_reader.py), over real NIXL from an owner process holding a bf16 cache:
an int8 cache reads the owner's blocks through staging, chunk by chunk, and its store quantizes them, so every byte
equals the store's own for the owner's rows, and the lease is released by the last READ; the other way, a model-dtype
cache reads an int8 owner's pages and dequantizes them. Only a model-dtype peer into a quantized cache, or a quantized
peer into a model-dtype cache, converts: every other pairing is refused at the handshake with both layouts named."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from kernels import kv_quant
from kernels.store_kv import store_kv_ref
from kvtransfer import KVCompatError, NixlTransport
from kvtransfer.convert_reader import ConvertReader, check_convertible
from kvtransfer.layout import PAGE_SCALES
from kvtransfer.wire import ReleaseNotice
from prefill_worker.sources import Sources
from tests.kvtransfer.kv_peer import TEST_COMPAT, cache_shape, make_pattern_cache
from tests.kvtransfer.test_kv_nixl_transfer import OWNER_BLOCKS, SEED, start_owner

INT8 = dataclasses.replace(TEST_COMPAT, dtype="int8", scale_layout=PAGE_SCALES)


@pytest.fixture(scope="module")
def owner():
    handle = start_owner("convert-owner")
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def int8_owner():
    handle = start_owner("convert-int8-owner", compat=INT8)
    yield handle
    handle.stop()


def int8_cache(num_blocks: int) -> torch.Tensor:
    c = INT8
    return kv_quant.allocate(num_blocks, c.num_layers, c.block_size, c.num_kv_heads, c.head_dim, torch.int8, "cpu")


def store_into(kv: torch.Tensor):
    layers = kv_quant.layer_views(kv, INT8.block_size, INT8.num_kv_heads, INT8.head_dim)
    return functools.partial(kv_quant.store_blocks, store_kv_ref, layers, dtype=torch.float32)


def test_a_pull_converts_the_owners_bf16_blocks_into_int8_pages_and_releases_the_lease(owner):
    kv = int8_cache(12)
    reader = ConvertReader(kv, INT8, TEST_COMPAT, "convert-puller", store_into(kv), staging_blocks=3)
    try:
        name = reader.add_peer(owner.info, owner.info)
        remote, local = [17, 3, 4, 5, 30, 9, 10], [11, 0, 1, 2, 5, 7, 8]  # 3 chunks of the 3-block staging
        assert owner.call("lease", ("conv", remote, 30.0)) == "ok"
        notice = ReleaseNotice("conv", ok=True).encode()
        moved = reader.read(name, remote, local, notif=notice)
        assert moved == len(remote) * reader.transport.layout.bytes_per_block  # the owner's bf16 bytes on the wire
        released, counters = owner.wait_released("conv")
        assert sorted(released) == sorted(remote) and counters.released == 1
    finally:
        reader.close()
    # the reference: the owner's rows stored one block at a time by the same store into a fresh cache
    want = int8_cache(12)
    owner_kv = make_pattern_cache(TEST_COMPAT, OWNER_BLOCKS, SEED)
    for r, l in zip(remote, local):
        kv_quant.store_blocks(store_kv_ref, kv_quant.layer_views(want, 4, 2, 32), owner_kv[r: r + 1], [l],
                              torch.float32)
    assert torch.equal(kv, want)
    untouched = [i for i in range(12) if i not in local]
    assert not kv[untouched].any()
    # and the values are the owner's within half a scale (kernels/kv_quant.py's bound)
    views = kv_quant.layer_views(kv, 4, 2, 32)[1]
    got = kv_quant.dequantize_ref(views.key[local], views.key_scales[local])
    exact = owner_kv[remote][:, 1, 0].float()
    assert ((got - exact).abs() <= views.key_scales[local].unsqueeze(-1) / 2 + 1e-6).all()


def test_a_pull_dequantizes_the_owners_int8_blocks_into_a_model_dtype_cache(int8_owner):
    """The other direction (a quantized prefill pool, a decode pool at the model dtype): the owner's int8 pages on
    the wire, each value times its scale in our fp32 blocks, exactly (kernels/kv_quant.py ``dequantize_blocks``)."""
    fp32 = dataclasses.replace(TEST_COMPAT, dtype="float32")
    kv = torch.zeros(cache_shape(fp32, 12))

    def store(blocks, block_ids):
        kv[list(block_ids)] = kv_quant.dequantize_blocks(blocks, 4, 2, 32, torch.float32)

    reader = ConvertReader(kv, fp32, INT8, "dequant-puller", store, staging_blocks=3)
    try:
        name = reader.add_peer(int8_owner.info, int8_owner.info)
        remote, local = [17, 3, 4, 5, 30], [11, 0, 1, 2, 5]
        assert int8_owner.call("lease", ("deq", remote, 30.0)) == "ok"
        moved = reader.read(name, remote, local, notif=ReleaseNotice("deq", ok=True).encode())
        assert moved == len(remote) * INT8.elements_per_block == len(remote) * 2 * 2 * 4 * 2 * (32 + 4)  # int8 pages
        released, _ = int8_owner.wait_released("deq")
        assert sorted(released) == sorted(remote)
    finally:
        reader.close()
    owner_kv = make_pattern_cache(INT8, OWNER_BLOCKS, SEED)
    views = kv_quant.layer_views(owner_kv, 4, 2, 32)[1]
    assert torch.equal(kv[local][:, 1, 1], kv_quant.dequantize_ref(views.value[remote], views.value_scales[remote]))
    assert torch.equal(kv[local], kv_quant.dequantize_blocks(owner_kv[remote], 4, 2, 32, torch.float32))
    assert not kv[[i for i in range(12) if i not in local]].any()


@pytest.mark.parametrize(("ours", "theirs", "why"), [
    (INT8, dataclasses.replace(INT8, dtype="float8_e4m3fn"), "both caches are quantized"),
    (dataclasses.replace(TEST_COMPAT, dtype="float32"), TEST_COMPAT, "both caches are a model dtype"),
    (INT8, dataclasses.replace(TEST_COMPAT, block_size=8), "block_size: 4 != 8"),
    (INT8, dataclasses.replace(TEST_COMPAT, tp_size=2, num_kv_heads=1, total_kv_heads=2), "num_kv_heads: 2 != 1"),
])
def test_every_other_pairing_is_refused_naming_both(ours, theirs, why):
    with pytest.raises(KVCompatError, match=f"ours \\[duet-test/tiny {ours.dtype}.*theirs \\[duet-test/tiny "
                                            f"{theirs.dtype}.*{why}"):
        check_convertible(ours, theirs, "peer")


def test_sources_convert_a_model_dtype_peer_and_refuse_without_a_store(owner):
    kv = int8_cache(4)
    with NixlTransport(kv, INT8, agent_name="convert-sources") as reader:
        bare = Sources(kv, INT8, 0, "convert-sources", reader=reader)
        with pytest.raises(KVCompatError, match="holds bfloat16 KV, ours int8, and this reader converts nothing"):
            bare.add(owner.info)
        sources = Sources(kv, INT8, 0, "convert-sources", reader=reader, store_blocks=store_into(kv))
        name = sources.add(owner.info)
        assert sources.is_staged(name)
        assert owner.call("lease", ("conv-src", [2], 30.0)) == "ok"
        sources.read(name, [2], [3], 30.0, notif=ReleaseNotice("conv-src", ok=True).encode())
        owner.wait_released("conv-src")
        assert kv[3].any() and not kv[:3].any()
        assert sources.remove(None) == [name]
        sources.close()
