"""Speculative decoding's verification sampler (Leviathan et al. 2023; vLLM's rejection sampler).

Inputs per sequence: k >= 0 draft tokens d_0 .. d_{k-1}, the distribution q_j each was drawn from (a draft
model's, or none for n-gram / suffix proposers: one-hot at the draft), and the target model's logits at
k + 1 positions (position j: after the request's tokens and d_0 .. d_{j-1}). The target distribution p_j
at position j is exactly what engine/sampling/sampler.py would sample from there, every sampling feature applied
with d_<j counted as generated (engine/speculative/targets.py).

- **Greedy** (temperature 0): d_j is accepted while it equals argmax p_j (the processed logits' argmax, as
  the sampler's); at the first mismatch the argmax is emitted; with all k accepted, the bonus argmax at
  position k. Token for token what plain greedy decoding emits.
- **Sampled**: d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection a token
  is drawn from norm(max(p_j - q_j, 0)) and the step ends; with all k accepted a bonus token is drawn from
  p_k. Every emitted token is then distributed as p_j given the tokens before it (lossless in distribution;
  tests/engine/speculative computes the output distribution exactly and compares it with the target's).
- **Sampled, one-hot drafts** (n-gram, suffix: q_j one-hot at d_j) take the same test in its coupled form: the
  plain sampler's own token at each index (the race below) is drawn, and d_j is accepted while it equals it.
  Acceptance then has probability p_j(d_j) = min(1, p/q) and a rejection's token is the race's winner among the
  other tokens, distributed as norm(max(p_j - q_j, 0)) — the same algorithm, with its randomness coupled to the
  plain sampler's, so the output is the plain sampler's **token for token** whatever drafts were proposed.

**Randomness** is stateless per output index, like the sampler's. Position j of a request is output index
n_j = num_prior_output_tokens + len(output_token_ids) + j, and each index owns two random numbers:

- the acceptance test of a draft model's draft at n: ``u = acceptance_uniform(seed, n)``, a 53-bit uniform in
  [0, 1) from splitmix64(step_seed(seed, n) ^ a salt) — integer arithmetic, the same on every device; accept
  when u < min(1, p / q);
- the token drawn at n (the residual at a rejection, or the bonus): the plain sampler's own noise for n —
  Exp(1) over the vocabulary from ``torch.Generator().manual_seed(step_seed(seed, n))`` (on the host) —
  and the exponential race argmax(weights / noise), which draws exactly from the normalised weights.

An index's token is emitted once, so each number is used once, whatever the batch, the number of drafts or
how steps split the output; with one-hot drafts, or k = 0, a seeded request gives the plain sampler's tokens;
with a draft model's, the same tokens given the same drafts (which positions had drafts changes the draws). A draft
model must draw its drafts with :func:`draft_step_seed`, never the request's step_seed: the residual draw would be
correlated with the draft.

**Logprobs** of the emitted tokens are what the plain sampler reports: log-softmax of the model's raw logits
at that position (before any processing), plus the top ``params.logprobs``.

Stopping is the caller's: the emitted tokens are appended one at a time through apply_stop_conditions and
the rest dropped after one finishes the request (an EOS draft, max_tokens). Capping k so that k + 1 tokens
fit max_tokens and the context is the scheduler's; nothing here truncates.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import Request
from engine.sampling.sampler import exponential_race, step_seed
from engine.speculative.targets import position_logits, target_probs

_MASK64 = (1 << 64) - 1
_ACCEPT_SALT = 0x243F6A8885A308D3  # pi's hex digits: the acceptance stream of an index
_DRAFT_SALT = 0x13198A2E03707344  # the next ones: a draft model's stream


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def acceptance_uniform(seed: int, index: int) -> float:
    """The uniform in [0, 1) that decides whether the draft at output ``index`` is accepted."""
    return (_splitmix64(step_seed(seed, index) ^ _ACCEPT_SALT) >> 11) * 2.0 ** -53


def draft_step_seed(seed: int, index: int) -> int:
    """The seed a draft model samples its draft for output ``index`` with (independent of the target's)."""
    return step_seed(seed, index) ^ _DRAFT_SALT


@dataclass(frozen=True)
class Drafts:
    """One sequence's proposal. ``probs`` [k, vocab]: q_j, the distribution ``token_ids[j]`` was drawn from
    (rows sum to 1); None for a proposer without one (n-gram, suffix): one-hot at the draft. ``allowed``
    [k + 1, vocab] bool: the tokens allowed at each position, instead of the request's grammar."""

    token_ids: tuple[int, ...] = ()
    probs: torch.Tensor | None = None
    allowed: torch.Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != len(self.token_ids)):
            raise ValueError(f"draft probs must be [k={len(self.token_ids)}, vocab], got {tuple(self.probs.shape)}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class VerifyResult:
    """Per sequence: the accepted drafts then the one token sampled after them (1 .. k + 1 tokens)."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[float] | None]  # None where params.logprobs is None
    top_logprobs: list[list[dict[int, float]] | None]


def acceptance_probs(p_at_draft: torch.Tensor, q_at_draft: torch.Tensor) -> torch.Tensor:
    """min(1, p / q) elementwise; where q = 0 (a draft its proposer gave no mass): 1 if p > 0 else 0."""
    p, q = p_at_draft.double(), q_at_draft.double()
    ratio = torch.where(q > 0, p / q.clamp_min(torch.finfo(torch.float64).tiny), (p > 0).double())
    return ratio.clamp(max=1.0)


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) per row ([n, vocab]). A row with no mass left (p <= q everywhere: then a rejection
    has probability 0, so only rounding reaches it) falls back to p."""
    r = (p - q).clamp_min(0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def rejection_sample(target_logits: torch.Tensor, requests: Sequence[Request],
                     drafts: Sequence[Drafts]) -> VerifyResult:
    """Verify every sequence's drafts. ``target_logits``: [sum(k_i + 1), vocab] fp32, the k_i + 1 rows of
    request i consecutive and in order (k_i = 0: its one next-token row). See the module docstring."""
    if len(requests) != len(drafts):
        raise ValueError(f"{len(requests)} requests but {len(drafts)} draft sets")
    vocab_size = target_logits.shape[1]
    for d in drafts:
        if any(not 0 <= t < vocab_size for t in d.token_ids):
            raise ValueError(f"draft token ids out of range [0, {vocab_size}): {d.token_ids}")
    draft_ids = [list(d.token_ids) for d in drafts]
    processed = position_logits(target_logits, requests, draft_ids, [d.allowed for d in drafts])
    row0s, row = [], 0
    for d in drafts:
        row0s.append(row)
        row += d.num_tokens + 1
    num_accepted = [0] * len(requests)
    final = [0] * len(requests)
    greedy = [i for i, r in enumerate(requests) if r.params.greedy]
    sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
    if greedy:
        _verify_greedy(processed, row0s, draft_ids, greedy, num_accepted, final)
    if sampled:
        _verify_sampled(processed, row0s, requests, drafts, sampled, num_accepted, final)
    token_ids = [draft_ids[i][:num_accepted[i]] + [final[i]] for i in range(len(requests))]
    logprobs, tops = _logprobs(target_logits, row0s, requests, token_ids)
    return VerifyResult(token_ids, num_accepted, logprobs, tops)


def _verify_greedy(processed: torch.Tensor, row0s: list[int], draft_ids: list[list[int]], seqs: list[int],
                   num_accepted: list[int], final: list[int]) -> None:
    rows = [row0s[i] + j for i in seqs for j in range(len(draft_ids[i]) + 1)]
    argmax = processed[rows].argmax(dim=-1).tolist()
    at = 0
    for i in seqs:
        drafts, j = draft_ids[i], 0
        while j < len(drafts) and drafts[j] == argmax[at + j]:
            j += 1
        num_accepted[i], final[i] = j, argmax[at + j]
        at += len(drafts) + 1


def _verify_sampled(processed: torch.Tensor, row0s: list[int], requests: Sequence[Request],
                    drafts: Sequence[Drafts], seqs: list[int], num_accepted: list[int], final: list[int]) -> None:
    rows = [row0s[i] + j for i in seqs for j in range(drafts[i].num_tokens + 1)]
    probs = target_probs(processed[rows], [requests[i].params for i in seqs for _ in range(drafts[i].num_tokens + 1)])
    local0s, at = [], 0  # each sequence's first row in probs
    for i in seqs:
        local0s.append(at)
        at += drafts[i].num_tokens + 1
    # the acceptance probabilities of every draft at once
    draft_rows = [local0s[s] + j for s, i in enumerate(seqs) for j in range(drafts[i].num_tokens)]
    draft_tokens = [t for i in seqs for t in drafts[i].token_ids]
    ratios: list[float] = []
    if draft_rows:
        index = torch.tensor(draft_tokens, device=probs.device)
        p_at = probs[torch.tensor(draft_rows, device=probs.device), index]
        q_at = torch.cat([_q_at_drafts(drafts[i], probs.device) for i in seqs])
        ratios = acceptance_probs(p_at, q_at).tolist()
    # one-hot drafts (n-gram, suffix): the plain sampler's own token at each position, accepted while the draft
    # equals it — P(accept d_j) = p_j(d_j) as Leviathan's test, and a rejection's token is the race's winner among
    # the others, distributed as norm(max(p_j - q_j, 0)); so the output is the plain sampler's, token for token
    onehot = [s for s, i in enumerate(seqs) if drafts[i].probs is None and drafts[i].num_tokens]
    plain: dict[int, list[int]] = {}
    if onehot:
        rows, row_seeds = [], []
        for s in onehot:
            r, d = requests[seqs[s]], drafts[seqs[s]]
            base = r.num_prior_output_tokens + len(r.output_token_ids)
            rows += [local0s[s] + j for j in range(d.num_tokens + 1)]
            row_seeds += [step_seed(r.seed, base + j) for j in range(d.num_tokens + 1)]
        tokens = exponential_race(probs[rows], row_seeds)
        at = 0
        for s in onehot:
            n = drafts[seqs[s]].num_tokens + 1
            plain[s], at = tokens[at:at + n], at + n
    emit_rows, seeds, rejected, emit_seqs = [], [], [], []  # rejected: (row in weights, sequence, position)
    at = 0
    for s, i in enumerate(seqs):
        r, d = requests[i], drafts[i]
        if s in plain:
            j = 0
            while j < d.num_tokens and d.token_ids[j] == plain[s][j]:
                j += 1
            num_accepted[i], final[i] = j, plain[s][j]
            at += d.num_tokens
            continue
        base = r.num_prior_output_tokens + len(r.output_token_ids)
        j = 0
        while j < d.num_tokens and acceptance_uniform(r.seed, base + j) < ratios[at + j]:
            j += 1
        at += d.num_tokens
        num_accepted[i] = j
        if j < d.num_tokens:  # rejected: draw from the residual of p_j and q_j
            rejected.append((len(emit_rows), i, j))
        emit_rows.append(local0s[s] + j)
        seeds.append(step_seed(r.seed, base + j))
        emit_seqs.append(i)
    if not emit_rows:
        return
    weights = probs[emit_rows]
    if rejected:
        index = torch.tensor([s for s, _, _ in rejected], device=probs.device)
        q = _q_rows(weights, [(drafts[i], j) for _, i, j in rejected])
        weights[index] = residual_probs(weights[index], q)
    for i, token in zip(emit_seqs, exponential_race(weights, seeds)):
        final[i] = token


def _q_at_drafts(d: Drafts, device: torch.device) -> torch.Tensor:
    """q_j(d_j) for j < k: ones for a one-hot proposer."""
    if d.probs is None:
        return torch.ones(d.num_tokens, dtype=torch.float64, device=device)
    index = torch.tensor(d.token_ids, device=device).unsqueeze(1)
    return d.probs.to(device=device, dtype=torch.float64).gather(1, index).squeeze(1)


def _q_rows(like: torch.Tensor, positions: list[tuple[Drafts, int]]) -> torch.Tensor:
    """[len(positions), vocab]: q_j of each (drafts, j), one-hot at the draft where there is no q."""
    q = torch.zeros(len(positions), like.shape[1], dtype=like.dtype, device=like.device)
    for row, (d, j) in enumerate(positions):
        if d.probs is None:
            q[row, d.token_ids[j]] = 1.0
        else:
            q[row] = d.probs[j]
    return q


def _logprobs(target_logits: torch.Tensor, row0s: list[int], requests: Sequence[Request],
              token_ids: list[list[int]]) -> tuple[list, list]:
    """The raw model distribution's logprob of every emitted token, and the top ``params.logprobs``."""
    n = len(requests)
    logprobs: list[list[float] | None] = [None] * n
    tops: list[list[dict[int, float]] | None] = [None] * n
    want = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not want:
        return logprobs, tops
    rows = [row0s[i] + j for i in want for j in range(len(token_ids[i]))]
    lp = torch.log_softmax(target_logits[rows], dim=-1)
    chosen = lp[torch.arange(len(rows), device=lp.device),
                torch.tensor([t for i in want for t in token_ids[i]], device=lp.device)].tolist()
    num_top = max(requests[i].params.logprobs for i in want)
    top_v, top_i = lp.topk(num_top, dim=-1) if num_top else (None, None)
    at = 0
    for i in want:
        m, n_top = len(token_ids[i]), requests[i].params.logprobs
        logprobs[i] = chosen[at:at + m]
        tops[i] = [{int(t): float(v) for t, v in zip(top_i[at + j, :n_top], top_v[at + j, :n_top])} if n_top else {}
                   for j in range(m)]
        at += m
    return logprobs, tops
