"""Moving a request to another worker after the client has seen part of it (its worker died).

The router knows everything the client received: the token ids and how many characters of text. The
continuation is an ordinary request on whatever workers the policies pick: its prompt is the original
prompt followed by the tokens already sent (a prefix-cache hit wherever those blocks live), with what
remains of ``max_tokens`` / ``min_tokens`` and a ``ResumeState`` that makes the engine replay those tokens
through its detokenizer and number its samples after them (engine/engine.py ``_start_text``; the sampler's
noise is per token index). So a greedy or seeded request continues with exactly the tokens and the text
it would have produced; the client sees one stream with nothing duplicated, missing or changed. Requests
that bring no seed get one from the router before their first placement, so they can move too.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from engine.outputs import RequestOutput
from engine.request import ResumeState, SamplingParams

MAX_MIGRATIONS = 2  # per request; a request whose workers keep dying ends with an error after that


def with_seed(params: SamplingParams) -> SamplingParams:
    """A sampled request without a seed gets one now, so that a continuation draws the same noise."""
    if params.greedy or params.seed is not None:
        return params
    return dataclasses.replace(params, seed=random.getrandbits(63))


@dataclass
class SentSoFar:
    """What the client has received of one request."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    num_chars: int = 0
    num_cached_tokens: int | None = None  # of the first placement (what usage reports)

    def record(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        self.num_chars += len(out.new_text)
        if self.num_cached_tokens is None and out.new_token_ids:
            self.num_cached_tokens = out.num_cached_tokens

    def continuation(self, params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """(prompt, params) that continue the request where the client is."""
        n = len(self.token_ids)
        resumed = dataclasses.replace(params, max_tokens=params.max_tokens - n,
                                      min_tokens=max(0, params.min_tokens - n),
                                      resume=ResumeState(num_output_tokens=n, num_emitted_chars=self.num_chars))
        return self.prompt_token_ids + self.token_ids, resumed

    def as_original(self, out: RequestOutput, num_prior_tokens: int) -> RequestOutput:
        """A continuation's output, with the counts the client expects of the original request."""
        if num_prior_tokens:
            out.num_prompt_tokens = len(self.prompt_token_ids)
            out.num_output_tokens += num_prior_tokens
            out.num_cached_tokens = self.num_cached_tokens or 0
        return out
