"""The TierMover's CPU block copies (one memcpy per block, engine/kv/mover.py ``_copy``): the bytes land where
the op says, in any dtype, and a block index outside the tensors fails the job instead of writing elsewhere."""
from __future__ import annotations

import random

import pytest
import torch

from engine.kv.mover import TierMover
from engine.kv.tiers import Job, Op


def wait(mover: TierMover, job_id: int):
    (done,) = mover.completions(wait_s=10)
    assert done.job_id == job_id
    return done


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_and_load_copy_whole_blocks_to_their_slots(dtype):
    kv = torch.randn(12, 2, 2, 4, 3, 8).to(dtype)  # [blocks, layers, K/V, tokens, kv heads, head dim]
    original = kv.clone()
    mover = TierMover(kv, 12, None, "test")
    try:
        slots = list(range(12))
        random.Random(0).shuffle(slots)
        mover.submit(Job(1, [Op("store", b, (), host_slot=s, device_block=b) for b, s in enumerate(slots)]))
        assert not wait(mover, 1).failed
        for b, s in enumerate(slots):
            assert torch.equal(mover.host[s], original[b])
        kv.zero_()
        mover.submit(Job(2, [Op("load", b, (), host_slot=s, device_block=(b + 5) % 12) for b, s in enumerate(slots)]))
        assert not wait(mover, 2).failed
        for b in range(12):
            assert torch.equal(kv[(b + 5) % 12], original[b])
        assert mover.bytes_moved["device_to_host"] == mover.bytes_moved["host_to_device"] == kv.nbytes
    finally:
        mover.close()


def test_a_block_outside_the_tensors_fails_the_job_and_writes_nothing():
    kv = torch.randn(4, 1, 2, 4, 1, 8)
    mover = TierMover(kv, 2, None, "test")
    try:
        mover.submit(Job(1, [Op("store", 0, (), host_slot=2, device_block=0)]))
        assert wait(mover, 1).failed == frozenset({0})
        mover.submit(Job(2, [Op("load", 0, (), host_slot=0, device_block=-1)]))
        assert wait(mover, 2).failed == frozenset({0})
        assert not mover.host.any()
    finally:
        mover.close()


def test_a_non_contiguous_cache_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        TierMover(torch.zeros(8, 4, 2).transpose(0, 1), 2, None, "test")
