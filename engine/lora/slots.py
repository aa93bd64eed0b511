"""Which adapter sits in which of the pool's ``max_loras`` slots (torch-free bookkeeping, tested exactly).

A slot is held by the running requests that use its adapter (``acquire`` / ``release``); a loaded adapter that no
request holds stays in its slot until a new one needs the room, least recently used first; a pinned adapter never
leaves. ``acquire`` of an adapter not loaded with every slot held fails (``NoFreeLoraSlot``): the scheduler keeps
that request waiting.
"""
from __future__ import annotations

from collections import OrderedDict


class NoFreeLoraSlot(RuntimeError):
    pass


class LoraSlots:
    def __init__(self, max_loras: int) -> None:
        if max_loras <= 0:
            raise ValueError(f"max_loras must be positive, got {max_loras}")
        self.max_loras = max_loras
        self.slot_of: dict[str, int] = {}
        self.refs: dict[str, int] = {}
        self.pinned: set[str] = set()
        self._idle: OrderedDict[str, None] = OrderedDict()  # loaded, unheld, unpinned: least recently used first
        self._free = list(range(max_loras - 1, -1, -1))

    def can_acquire(self, name: str) -> bool:
        return name in self.slot_of or bool(self._free) or bool(self._idle)

    def acquire(self, name: str) -> tuple[int, str | None, bool]:
        """Hold ``name``'s slot: (slot, the adapter evicted to make room or None, whether it must be loaded)."""
        if name in self.slot_of:
            self.refs[name] += 1
            self._idle.pop(name, None)
            return self.slot_of[name], None, False
        evicted = None
        if self._free:
            slot = self._free.pop()
        elif self._idle:
            evicted, _ = self._idle.popitem(last=False)
            slot = self.slot_of.pop(evicted)
            del self.refs[evicted]
        else:
            raise NoFreeLoraSlot(f"all {self.max_loras} LoRA slots are held by running requests; {name!r} waits")
        self.slot_of[name], self.refs[name] = slot, 1
        return slot, evicted, True

    def release(self, name: str) -> None:
        if self.refs.get(name, 0) <= 0:
            raise ValueError(f"LoRA adapter {name!r} released more often than acquired")
        self.refs[name] -= 1
        if self.refs[name] == 0 and name not in self.pinned:
            self._idle[name] = None

    def pin(self, name: str) -> None:
        self.pinned.add(name)
        self._idle.pop(name, None)

    def unload(self, name: str) -> int:
        """Free ``name``'s slot (it must not be held); returns the slot."""
        if self.refs.get(name, 0) > 0:
            raise ValueError(f"LoRA adapter {name!r} is held by {self.refs[name]} running requests")
        slot = self.slot_of.pop(name)
        self.refs.pop(name, None)
        self._idle.pop(name, None)
        self.pinned.discard(name)
        self._free.append(slot)
        return slot
