"""LoraManager: an engine's LoRA adapters, on three levels (vLLM's ``max_loras`` / ``max_cpu_loras``):

  * loaded — every adapter this engine serves, its weights read once into host memory (``adapters``), at most
             ``max_cpu_loras`` of them: a load beyond that is refused (unload one first). vLLM treats
             max_cpu_loras as a cache and re-reads an evicted adapter from its path; duet keeps every loaded
             adapter in host memory, so a slot is always refilled from memory and never from a file that may have
             changed since;
  * in a slot — on the device, ``max_loras`` slots (engine/lora/pool.py), who is where kept by ``LoraSlots``
             (engine/lora/slots.py): a slot is held while running requests use its adapter, idle (evictable, least
             recently used first) when none does, or pinned;
  * pinned — ``load(..., pinned=True)`` or ``EngineConfig.pinned_loras``: the adapter takes a slot at load and never
             leaves it (vLLM's ``pin_lora``). At most ``max_loras`` adapters are pinned, and at most ``max_loras - 1``
             while unpinned ones are loaded (they need a slot to run in); an unpinned load while every slot is
             pinned is refused.

The scheduler's gate (engine/sched/scheduler.py): a request enters the running batch only after ``acquire`` of its
adapter succeeds (its slot held; if the adapter was not in one, the least recently used idle slot is overwritten
with it, counted as an eviction), and ``release`` when it leaves the batch (finished, preempted, handed off). A
request whose adapter finds no slot (every slot held by other adapters' running requests, or pinned) stays waiting;
requests behind it whose adapters have slots may go first (vLLM's rule), until a batch's worth of them did: then it
reserves the next slot that goes idle (engine/sched/lora_pass.py). A load puts the adapter in a free slot at once
if one is free (never evicting), so a start-up set that fits is warm.

A name always means the same bytes (``digests``, kept after unload): blocks cached under a name (the block-hash salt
is the name) must never be reused by other weights loaded under it later. Engine thread only.
"""
from __future__ import annotations

import logging

import torch

from engine.errors import LoraAdapterError, LoraAdapterNotFoundError, LoraCapacityError
from engine.lora.adapter import LoraAdapter, load_adapter
from engine.lora.pool import LoraPool
from engine.lora.slots import LoraSlots, NoFreeLoraSlot

log = logging.getLogger(__name__)


class LoraManager:
    def __init__(self, model, max_loras: int, max_cpu_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device, lora_dtype: str = "auto") -> None:
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras {max_cpu_loras} < max_loras {max_loras}")
        self.pool = LoraPool(model, max_loras, max_lora_rank, dtype, device, lora_dtype)
        self.slots = LoraSlots(max_loras)
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self.adapters: dict[str, LoraAdapter] = {}  # loaded: name -> its weights in host memory
        self.digests: dict[str, str] = {}  # every name ever loaded -> its digest (kept after unload)

    @classmethod
    def build(cls, model, config, dtype: torch.dtype, device) -> LoraManager:
        """The engine's manager with ``config.lora_modules`` loaded (``config.pinned_loras`` pinned), as
        engine/config.py resolves the sizes (``lora_slots`` / ``lora_cpu_slots``)."""
        manager = cls(model, config.lora_slots, config.lora_cpu_slots, config.max_lora_rank, dtype, device,
                      config.lora_dtype)
        pinned = set(config.pinned_loras or ())
        for name, path in config.lora_modules or ():
            manager.load(name, path, pinned=name in pinned)
        return manager

    # ---- queries ---------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self.adapters)

    def digest(self, name: str) -> str:
        return self.adapters[name].digest

    def token_slot(self, name: str | None) -> int:
        """The slot of adapter ``name`` (None: -1, the base model alone); ``name`` is held by a running request."""
        return -1 if name is None else self.slots.slot_of[name]

    def info(self) -> dict:
        """What stats() reports: the limits, the loaded adapters, who is in which slot, pins, counters."""
        s = self.slots
        return {"max_loras": self.max_loras, "max_cpu_loras": self.max_cpu_loras, "loaded": self.names(),
                "slots": dict(sorted(s.slot_of.items(), key=lambda kv: kv[1])), "pinned": sorted(s.pinned),
                "slot_writes": s.num_writes, "evictions": s.num_evictions}

    # ---- loading (between steps) -----------------------------------------------------------------
    def load(self, name: str, path, pinned: bool = False) -> LoraAdapter:
        """Read the adapter at ``path`` as ``name`` into host memory (and a free slot, or pinned into one)."""
        if name in self.adapters:
            raise LoraAdapterError(f"LoRA adapter {name!r} is already loaded (from {self.adapters[name].path})")
        return self.add(load_adapter(name, path, self.pool.num_layers), pinned)

    def add(self, adapter: LoraAdapter, pinned: bool = False) -> LoraAdapter:
        """``load`` of an adapter already read (``engine.lora.adapter.load_adapter``, e.g. off the engine thread)."""
        name, path = adapter.name, adapter.path
        if name in self.adapters:
            raise LoraAdapterError(f"LoRA adapter {name!r} is already loaded (from {self.adapters[name].path})")
        if len(self.adapters) >= self.max_cpu_loras:
            raise LoraCapacityError(f"max_cpu_loras: {len(self.adapters)} LoRA adapters are loaded "
                                   f"({', '.join(self.names())}); unload one before loading {name!r}")
        self._check_pin_room(name, pinned)
        self.pool.check(adapter)
        if self.digests.get(name, adapter.digest) != adapter.digest:
            raise LoraAdapterError(f"LoRA adapter name {name!r} was served with other weights before: blocks cached "
                                   f"under that name would be reused; load {path} under a new name")
        if pinned:
            try:
                slot, evicted, write = self.slots.pin(name)
            except NoFreeLoraSlot as e:
                raise LoraAdapterError(f"cannot pin LoRA adapter {name!r} now: {e}") from None
            self._evicted(evicted)
        else:
            slot, write = self.slots.place(name), True
        self.adapters[name] = adapter
        self.digests[name] = adapter.digest
        if slot is not None and write:
            self.pool.write(slot, adapter)
        log.info("LoRA adapter %r loaded (rank %d, scaling %g, %d linears)%s: %s", name, adapter.rank,
                 adapter.scaling, len(adapter.weights),
                 "" if slot is None else f" in slot {slot}{' (pinned)' if pinned else ''}", path)
        return adapter

    def _check_pin_room(self, name: str, pinned: bool) -> None:
        num_pinned = len(self.slots.pinned)
        if pinned:
            unpinned = sorted(set(self.adapters) - self.slots.pinned)
            if num_pinned + 1 > self.max_loras or (num_pinned + 1 == self.max_loras and unpinned):
                raise LoraAdapterError(f"cannot pin LoRA adapter {name!r}: {num_pinned} of {self.max_loras} slots "
                                       f"are pinned" + (f" and {unpinned} need a slot to run in" if unpinned else ""))
        elif num_pinned >= self.max_loras:
            raise LoraAdapterError(f"every one of the {self.max_loras} LoRA slots is pinned "
                                   f"({sorted(self.slots.pinned)}): {name!r} could never run; unload a pinned one")

    def unload(self, name: str) -> None:
        """Forget ``name`` (host copy, slot, pin). The caller checks that no request of the engine uses it."""
        if name not in self.adapters:
            raise LoraAdapterNotFoundError(f"LoRA adapter {name!r} is not loaded")
        slot = self.slots.unload(name)
        if slot is not None:
            self.pool.clear(slot)
        del self.adapters[name]
        log.info("LoRA adapter %r unloaded%s", name, "" if slot is None else f" (slot {slot} freed)")

    # ---- the scheduler's gate --------------------------------------------------------------------
    def acquire(self, name: str) -> bool:
        """Hold a slot for one running request of ``name`` (writing the adapter into a slot if it has none);
        False, nothing changed, if no slot can be had now."""
        if not self.slots.can_acquire(name):
            return False
        slot, evicted, write = self.slots.acquire(name)
        self._evicted(evicted)
        if write:
            self.pool.write(slot, self.adapters[name])
            log.debug("LoRA adapter %r written into slot %d", name, slot)
        return True

    def release(self, name: str) -> None:
        self.slots.release(name)

    def _evicted(self, name: str | None) -> None:
        if name is not None:
            log.debug("LoRA adapter %r evicted from its slot (least recently used)", name)
