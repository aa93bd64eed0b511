"""Which adapter sits in which of the pool's ``max_loras`` device slots (torch-free bookkeeping, tested exactly).

Every slot is in one of four states, and every adapter name in at most one slot:
  * free    — holds nothing (``_free``);
  * held    — its adapter is used by running requests (``refs[name] > 0``; ``acquire`` / ``release``, one each per
              request that enters / leaves the running batch: the scheduler's rule, engine/sched/scheduler.py);
  * idle    — its adapter is loaded there but no running request uses it and it is not pinned (``_idle``, least
              recently released first): the next adapter that needs a slot while none is free evicts the oldest;
  * pinned  — its adapter never leaves (``pin``; held or not), until ``unpin`` or ``unload``.
``acquire`` of an adapter not in a slot, with no slot free or idle, fails (``NoFreeLoraSlot``; ``can_acquire`` says so
first): the scheduler leaves that request waiting. Running requests hold their slots, so the adapters of one batch
are never more than ``max_loras``. ``place`` puts an adapter in a free slot without holding it (a warm start: it
evicts nobody). Counted: ``num_writes`` (an adapter put into a slot: its weights to copy) and ``num_evictions``.
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
        self._idle: OrderedDict[str, None] = OrderedDict()  # in a slot, unheld, unpinned: least recently used first
        self._free = list(range(max_loras - 1, -1, -1))
        self.num_writes = 0
        self.num_evictions = 0

    # ---- queries ---------------------------------------------------------------------------------
    def can_acquire(self, name: str) -> bool:
        return name in self.slot_of or bool(self._free) or bool(self._idle)

    def held(self, name: str) -> int:
        """Running requests holding ``name``'s slot."""
        return self.refs.get(name, 0)

    def idle_order(self) -> list[str]:
        """The idle adapters, the next to be evicted first."""
        return list(self._idle)

    # ---- mutation --------------------------------------------------------------------------------
    def acquire(self, name: str) -> tuple[int, str | None, bool]:
        """Hold ``name``'s slot: (slot, the adapter evicted to make room or None, whether it must be written)."""
        if name in self.slot_of:
            self.refs[name] += 1
            self._idle.pop(name, None)
            return self.slot_of[name], None, False
        slot, evicted = self._take(name)
        self.refs[name] = 1
        return slot, evicted, True

    def release(self, name: str) -> None:
        if self.refs.get(name, 0) <= 0:
            raise ValueError(f"LoRA adapter {name!r} released more often than acquired")
        self.refs[name] -= 1
        if self.refs[name] == 0 and name not in self.pinned:
            self._idle[name] = None

    def place(self, name: str) -> int | None:
        """Put ``name`` (not in a slot) in a free slot, idle; None (nothing changed) if no slot is free."""
        if name in self.slot_of:
            raise ValueError(f"LoRA adapter {name!r} already has slot {self.slot_of[name]}")
        if not self._free:
            return None
        slot, _ = self._take(name)
        self.refs[name] = 0
        self._idle[name] = None
        return slot

    def pin(self, name: str) -> tuple[int, str | None, bool]:
        """Keep ``name`` in a slot for good, taking one (free, else the least recently used idle one) if it has
        none: (slot, evicted or None, whether it must be written). ``NoFreeLoraSlot`` if every slot is held or
        pinned."""
        if name in self.slot_of:
            self.pinned.add(name)
            self._idle.pop(name, None)
            return self.slot_of[name], None, False
        slot, evicted = self._take(name)
        self.refs[name] = 0
        self.pinned.add(name)
        return slot, evicted, True

    def unpin(self, name: str) -> None:
        self.pinned.discard(name)
        if name in self.slot_of and self.refs.get(name, 0) == 0:
            self._idle[name] = None

    def unload(self, name: str) -> int | None:
        """Free ``name``'s slot (it must not be held); returns the slot, or None if it had none."""
        if self.refs.get(name, 0) > 0:
            raise ValueError(f"LoRA adapter {name!r} is held by {self.refs[name]} running requests")
        self.pinned.discard(name)
        self._idle.pop(name, None)
        self.refs.pop(name, None)
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self._free.append(slot)
        return slot

    def _take(self, name: str) -> tuple[int, str | None]:
        evicted = None
        if self._free:
            slot = self._free.pop()
        elif self._idle:
            evicted, _ = self._idle.popitem(last=False)
            slot = self.slot_of.pop(evicted)
            del self.refs[evicted]
            self.num_evictions += 1
        else:
            raise NoFreeLoraSlot(f"all {self.max_loras} LoRA slots are held by running requests or pinned; "
                                 f"{name!r} waits")
        self.slot_of[name] = slot
        self.num_writes += 1
        return slot, evicted
