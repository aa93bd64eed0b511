"""LoraSlots' four states exactly: free, held (refs), idle (LRU), pinned; place never evicts, pin takes a slot."""
from __future__ import annotations

import pytest

from engine.lora.slots import LoraSlots, NoFreeLoraSlot


def test_place_fills_free_slots_only_and_idles_them():
    slots = LoraSlots(2)
    assert slots.place("a") == 0 and slots.place("b") == 1
    assert slots.place("c") is None and "c" not in slots.slot_of  # no free slot: nothing evicted
    assert slots.idle_order() == ["a", "b"] and slots.held("a") == 0
    assert slots.acquire("b") == (1, None, False)  # already in its slot: nothing to write
    assert slots.acquire("c") == (0, "a", True)  # a was idle the longest
    assert (slots.num_writes, slots.num_evictions) == (3, 1)
    with pytest.raises(ValueError, match="already has slot 1"):
        slots.place("b")


def test_pin_takes_a_slot_and_keeps_it():
    slots = LoraSlots(2)
    slots.acquire("a")
    assert slots.pin("p") == (1, None, True)
    slots.release("a")
    assert slots.acquire("b") == (0, "a", True)  # p is pinned: the idle a goes
    slots.release("b")
    assert slots.acquire("c") == (0, "b", True)
    with pytest.raises(NoFreeLoraSlot, match="held by running requests or pinned"):
        slots.pin("q")  # c is held, p pinned
    assert not slots.can_acquire("d")
    assert slots.can_acquire("p")  # a pinned adapter is always in its slot
    assert slots.acquire("p") == (1, None, False)
    slots.release("p")
    assert "p" not in slots.idle_order()  # released, still pinned
    slots.unpin("p")
    assert slots.idle_order() == ["p"]
    assert slots.acquire("d") == (1, "p", True)


def test_unload_frees_and_refuses_a_held_slot():
    slots = LoraSlots(1)
    assert slots.unload("never") is None
    slots.pin("a")
    slots.acquire("a")
    with pytest.raises(ValueError, match="held by 1 running requests"):
        slots.unload("a")
    slots.release("a")
    assert slots.unload("a") == 0 and slots.pinned == set()
    assert slots.acquire("b") == (0, None, True)
