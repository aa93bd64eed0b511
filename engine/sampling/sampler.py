"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs of the chosen token (+ top-n).

Randomness is stateless per step: the noise for a request's n-th output token comes from a generator
seeded with ``mix(seed, n)``. So a request samples the same tokens whatever batch it shares, after a
preemption, when its first token is sampled on one worker and the rest on another (disaggregation), or
when it is resumed elsewhere after its worker died (n counts the tokens generated before the move too).
Sampling uses the exponential race (argmax of p / E, E ~ Exp(1)), which draws exactly from p.

Logits are processed in vLLM's order before temperature / top-k / top-p (greedy takes the argmax of the
processed logits): min_tokens bans EOS and stop ids; ``logit_bias`` adds its values; then the penalties
(vLLM's and OpenAI's formulas, with c[t] = how often t was generated so far, generated tokens before a
migration included):

    repetition:  l[t] = l[t] / r if l[t] > 0 else l[t] * r     for t in prompt or generated (transformers'
                                                               RepetitionPenaltyLogitsProcessor)
    frequency:   l[t] -= frequency_penalty * c[t]
    presence:    l[t] -= presence_penalty * (c[t] > 0)

and last the structured-output grammar's mask (engine/sampling/structured.py). Every input is the request's own
token history, so a request sampled on a prefill worker and then a decode worker is processed exactly as
one that stays on one worker. Logprobs are those of the model's distribution (raw logits, before any of
this), as vLLM reports them by default.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request

_MASK64 = (1 << 63) - 1


def step_seed(seed: int, step: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) & _MASK64


def exponential_race(weights: torch.Tensor, seeds: list[int]) -> list[int]:
    """Per row, argmax(weights / E) with E ~ Exp(1) over the vocabulary drawn on the host from ``seeds[row]``: a
    draw from the normalised weights, the same numbers on every device (speculative verification draws with it
    too, engine/speculative/rejection.py)."""
    noise = torch.empty(weights.shape, dtype=weights.dtype)
    gen = torch.Generator()
    for row, seed in enumerate(seeds):
        gen.manual_seed(seed)
        noise[row].exponential_(generator=gen)
    return (weights / noise.to(weights.device)).argmax(dim=-1).tolist()


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


def sample(logits: torch.Tensor, requests: list[Request]) -> SampleResult:
    """``logits[i]`` ([num_rows, vocab], fp32) holds request i's next-token logits."""
    n, vocab = logits.shape
    processed = process_logits(logits, requests)
    token_ids = torch.empty(n, dtype=torch.long)
    greedy = [i for i, r in enumerate(requests) if r.params.greedy]
    random = [i for i, r in enumerate(requests) if not r.params.greedy]
    if greedy:
        token_ids[greedy] = processed[greedy].argmax(dim=-1)
    if random:
        x = processed[random] / torch.tensor([requests[i].params.temperature for i in random]).unsqueeze(1)
        x = _top_k(x, [requests[i].params.top_k for i in random])
        x = _top_p(x, [requests[i].params.top_p for i in random])
        probs = torch.softmax(x, dim=-1)
        seeds = [step_seed(requests[i].seed, requests[i].num_prior_output_tokens + len(requests[i].output_token_ids))
                 for i in random]
        token_ids[random] = torch.tensor(exponential_race(probs, seeds), dtype=torch.long)
    ids = token_ids.tolist()
    logprobs: list[float | None] = [None] * n
    tops: list[dict[int, float] | None] = [None] * n
    want = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if want:
        lp = torch.log_softmax(logits[want], dim=-1)
        k = max(requests[i].params.logprobs for i in want)
        top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
        for row, i in enumerate(want):
            logprobs[i] = float(lp[row, ids[i]])
            n_top = requests[i].params.logprobs
            tops[i] = {int(t): float(v) for t, v in zip(top_i[row, :n_top], top_v[row, :n_top])} if n_top else {}
    return SampleResult(ids, logprobs, tops)


def process_logits(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The logits sampling draws from (a copy when anything changes them; ``logits`` stays the model's)."""
    rows = [(i, r) for i, r in enumerate(requests)
            if len(r.output_token_ids) < r.params.min_tokens or r.params.logit_bias or r.params.has_penalties
            or r.grammar is not None]
    if not rows:
        return logits
    x = logits.clone()
    for i, r in rows:
        _process_row(x[i], r)
    grammar_rows = [i for i, r in rows if r.grammar is not None]
    if grammar_rows:  # last: the mask sees the biased, penalised row; one call masks every such row
        from engine.sampling.structured import mask_logits_batch

        mask_logits_batch([requests[i].grammar for i in grammar_rows], x, grammar_rows)
    return x


def _process_row(x: torch.Tensor, r: Request) -> None:
    """One request's row, in place, in the order of the module docstring (the grammar mask comes after, for
    all rows at once)."""
    p, vocab = r.params, x.shape[0]
    if len(r.output_token_ids) < p.min_tokens:
        banned = [t for t in (set(r.eos_token_ids) | set(p.stop_token_ids)) if t < vocab]
        if banned:
            x[banned] = float("-inf")
    if p.logit_bias:
        ids, values = zip(*p.logit_bias)
        x[list(ids)] += torch.tensor(values, dtype=x.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long)
        v = x[seen]
        x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if p.frequency_penalty or p.presence_penalty:
        generated = r.generated_token_ids
        if generated:
            counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=vocab)[:vocab].to(x.dtype)
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)


def _top_k(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    if not any(ks):
        return x
    vocab = x.shape[1]
    k = torch.tensor([k if 0 < k < vocab else vocab for k in ks])
    sorted_x = x.sort(dim=-1, descending=True).values
    kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
    return x.masked_fill(x < kth, float("-inf"))


def _top_p(x: torch.Tensor, ps: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in ps):
        return x
    p = torch.tensor(ps).unsqueeze(1)
    sorted_x, order = x.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    drop_sorted = before >= p  # keeps the smallest set whose mass reaches p (the top token always stays)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))
