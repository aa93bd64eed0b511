"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs of the chosen token (+ top-n).

Randomness is stateless per step: the noise for a request's n-th output token comes from a generator
seeded with ``mix(seed, n)``. So a request samples the same tokens whatever batch it shares, after a
preemption, when its first token is sampled on one worker and the rest on another (disaggregation), or
when it is resumed elsewhere after its worker died (n counts the tokens generated before the move too).
Sampling uses the exponential race (argmax of p / E, E ~ Exp(1)), which draws exactly from p.
Logprobs are those of the model's distribution (raw logits), as OpenAI reports them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request

_MASK64 = (1 << 63) - 1


def step_seed(seed: int, step: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) & _MASK64


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


def sample(logits: torch.Tensor, requests: list[Request]) -> SampleResult:
    """``logits[i]`` ([num_rows, vocab], fp32) holds request i's next-token logits."""
    n, vocab = logits.shape
    logits = _apply_min_tokens(logits, requests)
    token_ids = torch.empty(n, dtype=torch.long)
    greedy = [i for i, r in enumerate(requests) if r.params.greedy]
    random = [i for i, r in enumerate(requests) if not r.params.greedy]
    if greedy:
        token_ids[greedy] = logits[greedy].argmax(dim=-1)
    if random:
        x = logits[random] / torch.tensor([requests[i].params.temperature for i in random]).unsqueeze(1)
        x = _top_k(x, [requests[i].params.top_k for i in random])
        x = _top_p(x, [requests[i].params.top_p for i in random])
        probs = torch.softmax(x, dim=-1)
        noise = torch.empty_like(probs)
        gen = torch.Generator()
        for row, i in enumerate(random):
            r = requests[i]
            gen.manual_seed(step_seed(r.seed, r.num_prior_output_tokens + len(r.output_token_ids)))
            noise[row].exponential_(generator=gen)
        token_ids[random] = (probs / noise).argmax(dim=-1).to(token_ids.device)
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


def _apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    rows = [(i, r) for i, r in enumerate(requests) if len(r.output_token_ids) < r.params.min_tokens]
    if not rows:
        return logits
    logits = logits.clone()
    for i, r in rows:
        banned = [t for t in (set(r.eos_token_ids) | set(r.params.stop_token_ids)) if t < logits.shape[1]]
        if banned:
            logits[i, banned] = float("-inf")
    return logits


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
