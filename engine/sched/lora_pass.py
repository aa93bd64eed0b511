"""LoraPass: the adapter-slot rule of one pass over the scheduler's waiting queue (engine/sched/scheduler.py; the
slots themselves: engine/lora/manager.py through the ``LoraGate`` protocol).

    slots = LoraPass(gate, max_num_seqs)
    for request in waiting:
        ...
        if not slots.acquire(request):
            continue            # no slot for its adapter now: it waits, the requests behind it may still run

A request of an adapter runs only holding its adapter's slot. vLLM's rule: one whose adapter gets no slot (every
slot held by other adapters' running requests) waits without blocking the requests behind it. Alone, that rule lets
the adapters holding the slots keep them as long as their requests keep coming (each admitted request extends a
hold), and the waiting one waits as long. So each request counts the requests of other adapters that took a slot
past it (``Request.lora_passed_over``, over every pass); at ``max_num_seqs`` (a batch's worth) it reserves the next
slot: from it on in the queue, no request takes a slot for another adapter (base-model requests still run: they need
none). The holders drain as their requests end, and the first slot that goes idle is the waiting one's.
``reserves`` counts the requests that had to (the scheduler's ``num_lora_reserves``; engine stats' ``lora.reserves``).
"""
from __future__ import annotations

from engine.request import Request
from engine.sched.output import LoraGate


class LoraPass:
    def __init__(self, gate: LoraGate | None, max_passed_over: int) -> None:
        self.gate, self.max_passed_over = gate, max_passed_over
        self.refused: list[Request] = []  # requests of this pass whose adapter got no slot
        self.reserved: str | None = None  # the adapter of one passed over too often: no other takes a slot now
        self.reserves = 0  # requests that reserved a slot in this pass for the first time

    def acquire(self, request: Request) -> bool:
        lora = request.params.lora
        if lora is None or self.gate is None:
            return True
        if self.reserved is not None and lora != self.reserved:
            return False
        if self.gate.acquire(lora):
            for waiting in self.refused:
                waiting.lora_passed_over += 1
            return True
        self.refused.append(request)
        if self.reserved is None and request.lora_passed_over >= self.max_passed_over:
            self.reserved = lora
            if not request.lora_reserved:
                request.lora_reserved = True
                self.reserves += 1
        return False
