"""store_kv (Triton) against store_kv_ref, in place on the strided per-layer views of a 6-D cache."""
from __future__ import annotations

import pytest
import torch

from kernels.store_kv import store_kv, store_kv_ref
from tests.kernels.paged import DEVICE, kv_cache, layer_views


def _inputs(dtype, cache_dtype, kv_heads, head_dim, block_size, slots, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = kv_cache(8, block_size, kv_heads, head_dim, cache_dtype, gen)
    key = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    value = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    return cache, key, value, torch.tensor(slots, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim,block_size", [(1, 64, 8), (2, 80, 16), (4, 96, 8), (3, 128, 16)])
def test_matches_reference_and_touches_only_its_slots(dtype, kv_heads, head_dim, block_size):
    slots = [5, -1, 0, 8 * block_size - 1, 3 * block_size + 2, -1, block_size]  # -1 = padding, skipped
    cache, key, value, slot_mapping = _inputs(dtype, dtype, kv_heads, head_dim, block_size, slots)
    expected = cache.clone()
    store_kv_ref(key, value, *layer_views(expected), slot_mapping)
    before = cache.clone()
    store_kv(key, value, *layer_views(cache), slot_mapping)
    assert torch.equal(cache, expected)  # a copy: bit-exact, and every other layer / slot untouched
    assert not torch.equal(cache, before)


def test_casts_to_the_cache_dtype_and_accepts_int32_slots():
    cache, key, value, slot_mapping = _inputs(torch.float32, torch.float16, 2, 64, 16, [3, 17, -1])
    expected = cache.clone()
    store_kv_ref(key, value, *layer_views(expected), slot_mapping)
    store_kv(key, value, *layer_views(cache), slot_mapping.to(torch.int32))
    assert torch.equal(cache, expected)


def test_strided_key_value_from_a_fused_qkv_buffer():
    gen = torch.Generator().manual_seed(1)
    cache = kv_cache(4, 8, 2, 64, torch.float32, gen)
    qkv = torch.randn(5, 6, 64, generator=gen).to(DEVICE)  # [tokens, q(2) + k(2) + v(2) heads, head_dim]
    key, value = qkv[:, 2:4], qkv[:, 4:6]
    slot_mapping = torch.tensor([1, 2, 9, -1, 30], device=DEVICE)
    expected = cache.clone()
    store_kv_ref(key, value, *layer_views(expected), slot_mapping)
    store_kv(key, value, *layer_views(cache), slot_mapping)
    assert torch.equal(cache, expected)


def _valid_args():
    cache, key, value, slot_mapping = _inputs(torch.float16, torch.float16, 2, 64, 8, [0, 1, -1])
    kc, vc = layer_views(cache)
    return dict(key=key, value=value, key_cache=kc, value_cache=vc, slot_mapping=slot_mapping)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.update(key=a["key"][:, :1]), ValueError, "key has shape"),
    (lambda a: a.update(value=a["value"].to(torch.int16)), TypeError, "value has dtype"),
    (lambda a: a.update(key_cache=a["key_cache"].float()), TypeError, "value_cache dtype"),
    (lambda a: a.update(value_cache=a["value_cache"][:, :4]), ValueError, "value_cache has shape"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), TypeError, "slot_mapping has dtype"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"][:2]), ValueError, "slot_mapping has shape"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"] + 63), ValueError, "slot_mapping holds slots outside"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"] - 1), ValueError, "slot_mapping holds slots outside"),
    (lambda a: a.update(key_cache=a["key_cache"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError,
     "key_cache must be contiguous in its last dim"),
    (lambda a: a.update(key=a["key"].unsqueeze(0)), ValueError, "key must have 3 dims"),
    (lambda a: a.update(value=a["value"].cpu().numpy()), TypeError, "value must be a torch.Tensor"),
])
def test_rejects_bad_arguments_by_name(change, error, match):
    args = _valid_args()
    change(args)
    with pytest.raises(error, match=match):
        store_kv(**args)


def test_rejects_mixed_devices():
    args = _valid_args()
    args["slot_mapping"] = torch.empty(3, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="slot_mapping is on meta"):
        store_kv(**args)


def test_rejects_cpu_tensors_when_kernels_were_built_without_the_interpreter(monkeypatch):
    from kernels import _triton_utils as tu

    monkeypatch.setattr(tu, "INTERPRET", False)
    args = {k: v.cpu() for k, v in _valid_args().items()}
    with pytest.raises(ValueError, match="need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1"):
        store_kv(**args)
