"""The target distribution at every verified position: what engine/sampling/sampler.py would sample from there.

A verification forward gives a sequence with drafts d_0 .. d_{k-1} the target's logits at k + 1 positions:
position j holds the logits after the request's tokens and d_0 .. d_{j-1}. The plain sampler would sample
position j from the request *as if d_0 .. d_{j-1} had been generated*, so every logits processor that reads
the token history must see them:

- min_tokens: EOS and stop ids are banned while ``len(output_token_ids) + j < min_tokens``;
- repetition penalty over prompt + outputs + d_<j; presence / frequency over the generated tokens + d_<j;
- logit_bias (no history);
- the grammar mask of the matcher advanced over d_<j (:func:`grammar_position_masks`), applied last, as in
  the sampler;
- then, for sampled requests, temperature, top-k, top-p and softmax (:func:`target_probs`).

The processors are engine/sampling/sampler.py's own (``process_logits``, ``_top_k``, ``_top_p``), not copies: a
:class:`PositionView` is the small adapter that shows ``process_logits`` a request with the drafts
appended, without touching the request. Its ``grammar`` is None: ``process_logits`` masks with the request's
matcher as it stands, which is right for position 0 only, so masks come per position from here instead.
The sampler's helpers build their index tensors on the host (the engine samples host logits), so on another
device they need ``device=x.device`` there; everything in this package is device-agnostic.

A draft model (engine/speculative/draft.py) processes its own logits with these same functions, one position at a time
(:class:`GrammarCursor` walks the grammar over its drafts as they are chosen), so its drafts and q respect every
feature the target's distribution does.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.request import Request, SamplingParams
from engine.sampling.sampler import _top_k, _top_p, process_logits


class PositionView:
    """What ``engine.sampling.sampler.process_logits`` reads from a Request, for ``request`` with ``draft_ids``
    generated after its outputs. Read-only; lists are built when read."""

    __slots__ = ("_request", "_draft_ids")
    grammar = None  # per-position masks come from grammar_position_masks

    def __init__(self, request: Request, draft_ids: Sequence[int]):
        self._request = request
        self._draft_ids = list(draft_ids)

    @property
    def params(self) -> SamplingParams:
        return self._request.params

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._request.eos_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self._request.output_token_ids + self._draft_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._request.all_token_ids + self._draft_ids

    @property
    def generated_token_ids(self) -> list[int]:
        return self._request.generated_token_ids + self._draft_ids


def _needs_views(request: Request, num_drafts: int) -> bool:
    """Whether the request must be shown per position: some processing reads the drafts before it, or it
    has a grammar (whose mask this module applies, so process_logits must not)."""
    if request.grammar is not None:
        return True
    p = request.params
    return num_drafts > 0 and (len(request.output_token_ids) < p.min_tokens or bool(p.logit_bias)
                               or p.has_penalties)


def position_logits(logits: torch.Tensor, requests: Sequence[Request], draft_token_ids: Sequence[Sequence[int]],
                    allowed: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """The processed logits of every position (a copy when anything changes them; ``logits`` stays the
    model's). ``logits``: [sum(k_i + 1), vocab], the k_i + 1 rows of sequence i consecutive, in order.
    ``allowed[i]``: [k_i + 1, vocab] bool, the tokens allowed at each position (None: the request's grammar,
    if any, via :func:`grammar_position_masks`; a request without grammar and without a mask: all)."""
    num_rows, vocab_size = logits.shape
    if num_rows != sum(len(d) + 1 for d in draft_token_ids) or len(requests) != len(draft_token_ids):
        raise ValueError(f"logits has {num_rows} rows; the drafts need {sum(len(d) + 1 for d in draft_token_ids)} "
                         f"(k_i + 1 per sequence, {len(requests)} requests, {len(draft_token_ids)} draft lists)")
    views: list[Request | PositionView] = []
    for r, drafts in zip(requests, draft_token_ids):
        if _needs_views(r, len(drafts)):
            views.extend(PositionView(r, drafts[:j]) for j in range(len(drafts) + 1))
        else:  # nothing reads the drafts (or there are none): the request itself, as the sampler sees it
            views.extend([r] * (len(drafts) + 1))
    x = process_logits(logits, views)
    row0 = 0
    for i, (r, drafts) in enumerate(zip(requests, draft_token_ids)):
        mask = allowed[i] if allowed is not None else None
        if mask is None and r.grammar is not None:
            mask = grammar_position_masks(r.grammar, drafts, vocab_size)
        if mask is not None:
            if mask.shape != (len(drafts) + 1, vocab_size):
                raise ValueError(f"sequence {i}: mask shape {tuple(mask.shape)}, want {(len(drafts) + 1, vocab_size)}")
            if x is logits:
                x = logits.clone()
            x[row0:row0 + len(drafts) + 1].masked_fill_(~mask.to(x.device), float("-inf"))
        row0 += len(drafts) + 1
    return x


def target_probs(processed: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution a sampled (temperature > 0) request draws from at each row: ``processed`` /
    temperature, top-k, top-p, softmax — engine.sampling.sampler.sample's steps. ``params[r]`` belongs to row r."""
    temperature = torch.tensor([p.temperature for p in params], dtype=processed.dtype, device=processed.device)
    x = processed / temperature.unsqueeze(1)
    x = _top_k(x, [p.top_k for p in params])
    x = _top_p(x, [p.top_p for p in params])
    return torch.softmax(x, dim=-1)


def grammar_position_masks(matcher, draft_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[k + 1, vocab_size] bool: row j holds the tokens the grammar allows after the request's outputs and
    ``draft_ids[:j]`` (a :class:`GrammarCursor` walked over the drafts). ``matcher``
    (engine.sampling.structured.GrammarMatcher) is left in the state it was given in."""
    k = len(draft_ids)
    masks = torch.ones(k + 1, vocab_size, dtype=torch.bool)
    cursor = GrammarCursor(matcher, vocab_size)
    try:
        for j in range(k + 1):
            masks[j] = cursor.mask()
            if j < k:
                cursor.advance(draft_ids[j])
    finally:
        cursor.close()
    return masks


class GrammarCursor:
    """A request's grammar matcher walked over drafts one at a time: :meth:`mask` holds the tokens allowed at the
    next position, :meth:`advance` moves past a draft, :meth:`close` rolls the matcher back to where it was.
    Past a draft the grammar refuses, or one the finished document allows (EOS), every position allows
    everything: never reached (the refused draft's target probability is 0, so it is rejected; after EOS the
    request ends and the caller drops what follows)."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self._words = np.empty((vocab_size + 31) // 32, dtype=np.int32)
        self._bits: np.ndarray | None = None  # the last mask's
        self._num_consumed = 0
        self._done = False

    def mask(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens allowed after the drafts advanced over."""
        if self._done:
            return torch.ones(self.vocab_size, dtype=torch.bool)
        self.matcher.fill_bitmask(self._words)
        self._bits = np.unpackbits(self._words.view(np.uint8), count=self.vocab_size, bitorder="little").view(np.bool_)
        return torch.from_numpy(self._bits.copy())

    def advance(self, token_id: int) -> None:
        """Move past ``token_id``, the draft at the position :meth:`mask` was last called for."""
        if self._done:
            return
        # a refused draft, or a finished document (only EOS allowed: the draft is EOS, and the request ends
        # there; a stopped llguidance matcher would not count the EOS, so it is not fed)
        if self._bits is None or not self._bits[token_id] or self.matcher.is_terminated:
            self._done = True
            return
        self.matcher.accept(token_id)
        self._num_consumed += 1
        self._bits = None

    def close(self) -> None:
        if self._num_consumed:
            self.matcher.rollback(self._num_consumed)
        self._num_consumed = 0
