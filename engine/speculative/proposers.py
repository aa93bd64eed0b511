"""Draft proposers: what speculative decoding verifies. One small interface, three methods behind it.

A proposer sees a batch of :class:`SpecSequence` (a request's accepted tokens — prompt then outputs — and
how many drafts the caller can verify for it) and returns draft token ids per sequence, possibly none. The
caller caps ``max_num_draft_tokens`` by what the request may still generate (``max_model_len``,
``max_tokens``); the proposer also caps it by its own ``num_speculative_tokens``.

State. A proposer may keep per-request state (an index over the request's tokens), but only as a cache of
a function of ``token_ids``: it is caught up lazily from the tokens it is shown, and rebuilt from them when
the request is new to this worker (a handoff or a migration brings nothing else), when the tokens are not an
extension of what it saw (a rollback), or after :meth:`Proposer.finish`. So the same tokens give the same
drafts whether the state was built step by step or all at once. Worker-wide state (the suffix proposer's
cache of finished outputs) is the one input besides the tokens: what finished on this worker (and, through
LRU eviction, which cached outputs earlier proposals drew on), never batch order. Drafts are deterministic:
ties break on content (smallest token id, earliest position), never on dict order or time.

:class:`RequestStates` is that lazy catch-up, shared by the n-gram and suffix proposers. The factory that
maps an ``engine.config.SpeculativeConfig`` to a proposer is engine/speculative/decoder.py's ``make_proposer``.
"""
from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar


@dataclass(frozen=True)
class SpecSequence:
    """One sequence of a proposal batch. ``token_ids``: the request's accepted tokens, prompt then outputs
    (``Request.all_token_ids``; never unverified drafts); ``num_prompt_tokens``: how many of them are the
    original prompt (a migrated request's earlier outputs count as outputs); ``max_num_draft_tokens``: the most
    drafts the caller will verify (0: propose nothing)."""

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    max_num_draft_tokens: int

    def __post_init__(self) -> None:
        if not 0 <= self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(f"num_prompt_tokens {self.num_prompt_tokens} is outside [0, {len(self.token_ids)}]")
        if self.max_num_draft_tokens < 0:
            raise ValueError(f"max_num_draft_tokens must be >= 0, got {self.max_num_draft_tokens}")


class Proposer(abc.ABC):
    """Proposes draft tokens for a batch of sequences (a pure function of each sequence's tokens and, for
    worker-wide caches, of the requests that finished on this worker)."""

    num_speculative_tokens: int  # the most drafts proposed per sequence per step

    @abc.abstractmethod
    def propose(self, seqs: Sequence[SpecSequence]) -> list[list[int]]:
        """Draft token ids per sequence, in order; each list holds at most
        ``min(seq.max_num_draft_tokens, self.num_speculative_tokens)`` ids, maybe none."""

    def finish(self, request_id: str, output_token_ids: Sequence[int] | None = None) -> None:
        """The request ended or left this worker: drop its state. ``output_token_ids`` (all it generated, when
        it finished normally) may feed a worker-wide cache; None (aborted, migrated away) feeds nothing."""


S = TypeVar("S")


@dataclass(slots=True)
class _Entry(Generic[S]):
    state: S
    num_tokens: int  # how many of the request's tokens the state has absorbed
    num_prompt_tokens: int
    last_token_id: int | None  # token_ids[num_tokens - 1] then: a cheap check that the tokens only grew


class RequestStates(Generic[S]):
    """Per-request states kept in step with the tokens each proposal batch shows: :meth:`get` returns the
    request's state after absorbing the tokens it has not seen (``extend(state, new_token_ids)``), building a
    fresh one (``build(token_ids)``) when the request is new or its tokens are not an extension of those
    absorbed (fewer, another prompt length, or another last absorbed token: a full prefix comparison would
    cost O(tokens) a step)."""

    def __init__(self, build: Callable[[Sequence[int]], S], extend: Callable[[S, Sequence[int]], None]):
        self._build, self._extend = build, extend
        self._entries: dict[str, _Entry[S]] = {}

    def get(self, seq: SpecSequence) -> S:
        e = self._entries.get(seq.request_id)
        toks = seq.token_ids
        if (e is None or len(toks) < e.num_tokens or e.num_prompt_tokens != seq.num_prompt_tokens
                or (e.num_tokens and toks[e.num_tokens - 1] != e.last_token_id)):
            e = self._entries[seq.request_id] = _Entry(self._build(toks), 0, seq.num_prompt_tokens, None)
        elif len(toks) > e.num_tokens:
            self._extend(e.state, toks[e.num_tokens:])
        e.num_tokens, e.last_token_id = len(toks), (toks[-1] if toks else None)
        return e.state

    def pop(self, request_id: str) -> S | None:
        e = self._entries.pop(request_id, None)
        return e.state if e is not None else None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries
