"""What a scheduler step hands the model runner and the engine (as vLLM's ``v1/core/sched/output.py``): the
requests scheduled with their token counts, the preempted ones, the ``PeerImporter`` seam through which the
scheduler starts reads of a peer's lent blocks, and the ``LoraGate`` it asks before a request of a LoRA adapter runs.
The model runner imports this contract, not the scheduler."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.kv.handoff import PeerBlocks
from engine.request import Request


class PeerImporter(Protocol):
    """Reads blocks a peer lent (engine.kv.handoff.PeerBlocks) into local blocks, off the engine thread; calls
    ``Engine.finish_import`` when done."""

    def start(self, request_id: str, peer: PeerBlocks, remote_block_ids: Sequence[int],
              local_block_ids: Sequence[int]) -> None: ...

    def release(self, peer: PeerBlocks) -> None: ...


class LoraGate(Protocol):
    """The device slots of LoRA adapters (engine/lora/manager.py ``LoraManager``): a request runs only while it holds
    its adapter's slot."""

    def acquire(self, name: str) -> bool:
        """Hold ``name``'s slot for one running request (loading it into a slot if needed); False: none free now."""

    def release(self, name: str) -> None: ...


@dataclass
class ScheduledRequest:
    """``num_new_tokens`` tokens of ``request`` this step: its next uncomputed tokens, then (speculative
    decoding) ``draft_token_ids``, which the step verifies: the model runs them, the engine keeps what the
    target accepts (engine/speculative/). A draft is never part of the request's tokens before it is accepted."""

    request: Request
    num_new_tokens: int
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def completes_sequence(self) -> bool:
        """After this step every token of the request is computed, so its next token can be sampled."""
        return (self.request.num_computed_tokens + self.num_new_tokens - self.num_draft_tokens
                == self.request.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
