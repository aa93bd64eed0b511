"""N-gram (prompt lookup) proposer: vLLM's ``ngram`` method.

Rule (vLLM v1 ``NgramProposer``, ``_find_longest_matched_ngram_and_propose_tokens``): over the sequence so
far (prompt and outputs), find the longest n in [``prompt_lookup_min``, ``prompt_lookup_max``] such that the
last n tokens also occur earlier — an occurrence ending before the last token; it may overlap the suffix —
take the *earliest* such occurrence, and propose the up to k tokens that follow it (fewer when the sequence
ends first, so a draft may run into the suffix itself). Nothing matches: no drafts. vLLM runs a KMP scan of
the reversed sequence per step (O(tokens) each, in numba) and keeps the earliest match of the longest length;
the earliest is what vLLM chose, so it is what this does. Older vLLM (v0) also took the first (earliest)
match, longest n first.

Cost. A Python scan of a 32K-token sequence per step would cost milliseconds per request per step, so the
request keeps an index instead: for every n in the range, the first start of each n-gram, over n-grams ending
before the last token. A new token adds one entry per n (O(max - min + 1) tuple hashes), a proposal does at
most max - min + 1 lookups, so a request costs O(tokens * (max - min + 1)) over its life, linear, and the
index is rebuilt from the tokens in the same time after a migration. It holds ~160 B per token per n in the
range (5 MB at 32K tokens for vLLM's defaults, 5 and 5). Measured (tests/engine/speculative/
test_proposers.py, ``test_ngram_long_prompt_is_linear``): see that test's docstring.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.speculative.proposers import Proposer, RequestStates, SpecSequence


class NgramIndex:
    """The first start of every n-gram (n in [min_n, max_n]) of one request that ends before its last token.
    Kept in step by :meth:`extend`; a function of the tokens only."""

    __slots__ = ("min_n", "max_n", "token_ids", "_first_start", "_num_indexed")

    def __init__(self, token_ids: Sequence[int], *, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.token_ids: list[int] = []
        self._first_start: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self._num_indexed = 0  # n-grams ending at positions < this are indexed
        self.extend(token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        self.token_ids.extend(token_ids)
        toks = self.token_ids
        for end in range(self._num_indexed, len(toks) - 1):  # the last token's n-grams are the queries
            for n, first in enumerate(self._first_start, self.min_n):
                if end + 1 < n:
                    break
                first.setdefault(tuple(toks[end + 1 - n:end + 1]), end + 1 - n)
        self._num_indexed = max(self._num_indexed, len(toks) - 1)

    def match(self) -> tuple[int, int] | None:
        """(n, start) of the earliest earlier occurrence of the longest matching suffix n-gram, or None."""
        toks = self.token_ids
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            start = self._first_start[n - self.min_n].get(tuple(toks[len(toks) - n:]))
            if start is not None:
                return n, start
        return None

    def propose(self, k: int) -> list[int]:
        found = self.match() if k > 0 else None
        if found is None:
            return []
        n, start = found
        return self.token_ids[start + n:start + n + k]


class NgramProposer(Proposer):
    """vLLM's ``ngram`` speculative method over per-request :class:`NgramIndex` states."""

    def __init__(self, *, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self._states: RequestStates[NgramIndex] = RequestStates(
            lambda ids: NgramIndex(ids, min_n=self.min_n, max_n=self.max_n), NgramIndex.extend)

    def propose(self, seqs: Sequence[SpecSequence]) -> list[list[int]]:
        out = []
        for seq in seqs:
            k = min(seq.max_num_draft_tokens, self.num_speculative_tokens)
            out.append(self._states.get(seq).propose(k) if k > 0 and seq.token_ids else [])
        return out

    def finish(self, request_id: str, output_token_ids: Sequence[int] | None = None) -> None:
        self._states.pop(request_id)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._states)
