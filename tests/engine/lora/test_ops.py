"""The batched shrink / expand against a per-token loop, and the slot bookkeeping."""
from __future__ import annotations

import pytest
import torch

from engine.lora.ops import LoraBatch, lora_add_
from engine.lora.slots import LoraSlots, NoFreeLoraSlot


@pytest.mark.parametrize("masked", [False, True])
def test_lora_add_equals_per_token_formula(masked):
    g = torch.Generator().manual_seed(0)
    t, k, n, r, slots = 11, 24, 40, 6, 3
    x = torch.randn(t, k, generator=g)
    base = torch.randn(t, n, generator=g)
    a = torch.randn(slots, r, k, generator=g)
    b = torch.randn(slots, n, r, generator=g)
    scaling = torch.tensor([0.5, 2.0, 0.25])
    token_slots = [-1, 0, 0, 2, -1, 1, 1, 1, 2, -1, 0]
    batch = LoraBatch.from_token_slots(token_slots, "cpu", scaling if masked else None)
    assert (batch.token_scale is not None) == masked
    mask = batch.column_mask(r) if masked else None
    out = lora_add_(base.clone(), x, a, b.transpose(1, 2).contiguous(), scaling, batch, mask)
    for i, s in enumerate(token_slots):
        want = base[i] if s < 0 else base[i] + scaling[s] * (b[s] @ (a[s] @ x[i]))
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-5)
    assert not out.equal(base)


def test_batch_groups_tokens_by_slot():
    batch = LoraBatch.from_token_slots([2, -1, 0, 2], "cpu")
    assert [(s, rows.tolist()) for s, rows in batch.groups] == [(0, [2]), (2, [0, 3])]
    assert batch.token_slots is None
    assert LoraBatch.from_token_slots([-1, -1], "cpu").empty


def test_kernel_batch_is_the_slots_tensor():
    """The kernels group the tokens themselves: their batch is the step's slots, nothing built per slot on the host;
    a static buffer's batch (a recorded step) is never empty, whatever its values."""
    batch = LoraBatch.from_token_slots([2, -1, 0, 2], "cpu", torch.ones(3), kernel=True)
    assert batch.groups == () and batch.token_scale is None and batch.token_slots.tolist() == [2, -1, 0, 2]
    assert not batch.empty
    assert LoraBatch.from_token_slots([-1, -1], "cpu", kernel=True).empty
    assert not LoraBatch.of_buffer(torch.full((4,), -1)).empty


def test_slots_hold_evict_lru_and_pin():
    slots = LoraSlots(2)
    assert slots.acquire("a") == (0, None, True)
    assert slots.acquire("b") == (1, None, True)
    assert slots.acquire("a") == (0, None, False)
    with pytest.raises(NoFreeLoraSlot):
        slots.acquire("c")
    assert not slots.can_acquire("c")
    slots.release("b")
    slots.release("a")
    slots.release("a")  # both idle now, b first: b is the least recently used
    assert slots.acquire("c") == (1, "b", True)
    slots.pin("c")
    slots.release("c")
    assert slots.acquire("d") == (0, "a", True)  # c is pinned, a goes
    slots.release("d")
    assert slots.acquire("e") == (0, "d", True)
    with pytest.raises(ValueError, match="held by 1"):
        slots.unload("e")
    slots.release("e")
    assert slots.unload("e") == 0 and slots.acquire("f") == (0, None, True)
    with pytest.raises(ValueError, match="released more often"):
        slots.release("b")
