"""Speculative decoding inside one engine: drafts proposed before a step, verified by it.

Per step (engine/engine.py):

1. :meth:`SpecDecoder.propose` — every running sequence that decodes this step (one uncomputed token) is
   shown to the proposer with the most drafts it may still use (``max_tokens`` and the context leave room
   for k + 1 more tokens); :mod:`engine.speculative.policy` cuts each to what pays; the rest go to
   ``Request.spec_token_ids``. A draft model (engine/speculative/draft.py) proposes placeholders here: its drafts
   need the blocks the scheduler allocates for them.
2. The scheduler takes what fits the step's token budget and free blocks (``Scheduler._fit_drafts``, never
   preempting for a draft); :meth:`fill` runs the draft model over the scheduled sequences and puts its drafts
   in place of the placeholders; the runner runs the drafts after the sequence's new token and returns k + 1
   rows of logits.
3. engine/speculative/rejection.py verifies; the engine appends the accepted drafts and the token after them one at
   a time through the stop checks (engine/engine_emit.py), and the scheduler counts the accepted drafts' KV as
   computed (``on_drafts_accepted``): rejected drafts' KV is never registered, hashed or published.
4. :meth:`observe` feeds the policy (acceptance, shadow trials) and the counters behind vLLM's
   ``vllm:spec_decode_*`` metrics.

Proposer state is a cache of the tokens (engine/speculative/proposers.py): a request handed off, migrated or
preempted is rebuilt from its tokens (the draft model's KV likewise: computed again from the tokens, see
engine/speculative/draft.py). :meth:`finish` feeds a finished output to the suffix proposer's worker
cache; requests that left without it are swept every ``SWEEP_STEPS`` steps.
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.sched.output import SchedulerOutput
from engine.speculative.ngram import NgramProposer
from engine.speculative.policy import Acceptance, StepCost, choose_lengths
from engine.speculative.proposers import Proposer, SpecSequence
from engine.speculative.rejection import Drafts
from engine.speculative.suffix import SuffixProposer

log = logging.getLogger(__name__)

SWEEP_STEPS = 256


@dataclass
class SpecStats:
    """Counters under vLLM's names (``vllm:spec_decode_num_drafts`` ...): ``num_drafts`` sequences verified
    drafts, ``num_draft_tokens`` drafts in all, ``num_accepted_tokens`` of them accepted;
    ``accepted_per_pos[j]``: drafts accepted at position j."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, draft=None) -> None:
        """``draft``: the engine.speculative.draft.DraftModel of a ``draft_model`` config (its runner needs the
        engine)."""
        if config.needs_draft_model and draft is None:
            raise ValueError("draft_model speculation needs its DraftModel (engine/speculative/draft.py)")
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.draft = draft
        self.proposer = draft if draft is not None else make_proposer(config)
        self._probs: dict[str, object] = {}  # request -> q of this step's drafts (a draft model's sampled requests)
        self._shadow_wanted: set[str] = set()  # requests whose draft model runs for a shadow trial only
        self.cost = StepCost()
        self.acceptance = Acceptance()
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._shadow: dict[str, int] = {}  # request -> its first draft, when none was verified
        self._known: set[str] = set()  # requests the proposer may hold state for
        self._steps = 0

    # ---- before the step ---------------------------------------------------------------------------
    def propose(self, running: Sequence[Request], max_model_len: int, base_tokens: int | None = None) -> None:
        """Set ``spec_token_ids`` of every request in ``running`` (empty for those not decoding this step).
        ``base_tokens``: the step's tokens without drafts (default: one per decoding sequence)."""
        decoding = []
        for r in running:
            r.spec_token_ids = []
            if r.num_tokens - r.num_computed_tokens == 1 and not r.remote_decode:
                decoding.append(r)
        self._shadow.clear()
        self._shadow_wanted.clear()
        self._probs.clear()
        if not decoding:
            return
        seqs = [SpecSequence(r.request_id, r.all_token_ids, r.num_prompt_tokens - r.num_prior_output_tokens,
                             _room(r, max_model_len)) for r in decoding]
        self._known.update(s.request_id for s in seqs)
        drafts = self.proposer.propose(seqs)
        alphas = [self.acceptance.alpha(r.request_id) for r in decoding]
        lengths = choose_lengths(alphas, [len(d) for d in drafts], base_tokens or len(decoding), self.cost.fit())
        for r, d, k in zip(decoding, drafts, lengths):
            r.spec_token_ids = list(d[:k])
            if k == 0 and d:
                if self.draft is None:
                    self._shadow[r.request_id] = d[0]
                else:  # a placeholder: the draft model makes the first draft in fill
                    self._shadow_wanted.add(r.request_id)

    def fill(self, sched: SchedulerOutput) -> None:
        """After scheduling, a draft model's drafts in place of the placeholders (same count), for every sequence
        the step verifies drafts of; a sequence that verifies none but wants a shadow trial gets its first
        draft made for that (the draft's KV catches up meanwhile). Nothing for the other proposers."""
        if self.draft is None:
            return
        seqs = [s for s in sched.scheduled if s.num_draft_tokens or (
            s.request.request_id in self._shadow_wanted and s.num_new_tokens == 1 and s.completes_sequence)]
        if not seqs:
            return
        proposals = self.draft.draft([s.request for s in seqs], [max(s.num_draft_tokens, 1) for s in seqs])
        for s, p in zip(seqs, proposals):
            rid = s.request.request_id
            if s.num_draft_tokens:
                s.draft_token_ids = tuple(p.token_ids)
                s.request.spec_token_ids = list(p.token_ids)
                if p.probs is not None:
                    self._probs[rid] = p.probs
            else:
                self._shadow[rid] = p.token_ids[0]

    def drafts(self, scheduled) -> list[Drafts]:
        """What verification takes for each ``ScheduledRequest``: its drafts and, for a draft model's sampled
        requests, the distributions they were drawn from."""
        return [Drafts(s.draft_token_ids, self._probs.pop(s.request.request_id, None)) for s in scheduled]

    # ---- after the step -----------------------------------------------------------------------------
    def observe(self, request: Request, num_drafts: int, num_accepted: int, first_token: int) -> None:
        """A sequence's step: ``num_drafts`` verified, ``num_accepted`` of them accepted, ``first_token`` the
        first token appended (the shadow trial's outcome when no draft was verified)."""
        rid = request.request_id
        if num_drafts:
            st = self.stats
            st.num_drafts += 1
            st.num_draft_tokens += num_drafts
            st.num_accepted_tokens += num_accepted
            for j in range(num_accepted):
                st.accepted_per_pos[j] += 1
            self.acceptance.observe(rid, min(num_accepted + 1, num_drafts), num_accepted)
        elif rid in self._shadow:  # a draft model's sampled draft equals the token less often than it is accepted
            self.acceptance.observe(rid, 1, int(self._shadow.pop(rid) == first_token))
        if self.draft is not None:
            self.draft.observe(request, num_accepted)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step that ran only decoding sequences (and their drafts): ``num_tokens`` tokens in ``seconds``."""
        self.cost.observe(num_tokens, seconds)

    def finish(self, request: Request, finished: bool) -> None:
        """The request left this engine: ``finished`` normally (its output may feed the worker's cache) or
        not (aborted, failed, handed off)."""
        rid = request.request_id
        self.acceptance.forget(rid)
        if rid in self._known:
            self._known.discard(rid)
            self.proposer.finish(rid, request.generated_token_ids if finished else None)

    def sweep(self, live: Collection[str]) -> None:
        """Every ``SWEEP_STEPS`` calls: forget the requests no longer in ``live`` (left by a path that did not
        call ``finish``)."""
        self._steps += 1
        if self._steps % SWEEP_STEPS:
            return
        for rid in [r for r in self._known if r not in live]:
            self._known.discard(rid)
            self.acceptance.forget(rid)
            self.proposer.finish(rid, None)


def _room(request: Request, max_model_len: int) -> int:
    """The most drafts a step may verify for ``request``: k accepted plus the token after them must fit its
    ``max_tokens`` and the context."""
    by_tokens = request.params.max_tokens - len(request.output_token_ids) - 1
    by_context = max_model_len - request.num_tokens - 1
    return max(0, min(by_tokens, by_context))


def make_proposer(config) -> Proposer:
    """The proposer for an ``engine.config.SpeculativeConfig`` of method ngram or suffix (a draft model,
    engine.speculative.draft.DraftModel, is built by the engine: it needs a model runner)."""
    if config.method == "ngram":
        return NgramProposer(num_speculative_tokens=config.num_speculative_tokens,
                             prompt_lookup_min=config.prompt_lookup_min,
                             prompt_lookup_max=config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(num_speculative_tokens=config.num_speculative_tokens,
                              max_tree_depth=config.suffix_decoding_max_tree_depth,
                              max_cached_requests=config.suffix_decoding_max_cached_requests,
                              max_cached_nodes=config.suffix_decoding_max_cached_nodes,
                              max_spec_factor=config.suffix_decoding_max_spec_factor,
                              min_token_prob=config.suffix_decoding_min_token_prob)
    raise NotImplementedError(f"speculative method {config.method!r} has no model-free proposer "
                              "(a draft model is engine.speculative.draft.DraftModel, built by the engine)")
