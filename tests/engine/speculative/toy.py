"""Tiny-vocabulary stand-ins for the target and draft models, the plain sampler's next-token distribution
as the reference, and the verification algorithm's output distribution computed exactly (no sampling).

The toy target's logits depend on the last two tokens, so every position of a verification differs and the
history-reading features (penalties, min_tokens, the mask) see the drafts."""
from __future__ import annotations

import itertools
import random
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from engine.request import Request, SamplingParams
from engine.sampling.sampler import process_logits
from engine.speculative.rejection import acceptance_probs, residual_probs
from engine.speculative.targets import position_logits, target_probs

EOS = 0
STOP = 1  # a stop token id: min_tokens bans it too
MaskFn = Callable[[Sequence[int]], torch.Tensor]  # output tokens -> [vocab] bool, the tokens allowed next


class ToyTarget:
    def __init__(self, vocab_size: int, gen: torch.Generator, scale: float = 1.5):
        self.vocab_size = vocab_size
        self.a = torch.randn(vocab_size, vocab_size, generator=gen) * scale
        self.b = torch.randn(vocab_size, vocab_size, generator=gen) * scale / 2

    def logits(self, tokens: Sequence[int]) -> torch.Tensor:
        return self.a[tokens[-1]] + self.b[tokens[-2]]

    def rows(self, tokens: Sequence[int], drafts: Sequence[int]) -> torch.Tensor:
        """The verification forward's logits: [len(drafts) + 1, vocab], position j after drafts[:j]."""
        seq = list(tokens) + list(drafts)
        return torch.stack([self.logits(seq[:len(tokens) + j]) for j in range(len(drafts) + 1)])


class ToyDraft:
    """q given the tokens so far. kinds: full (softmax), one_hot (n-gram-like: None probs), sparse (zeros,
    also where the target has mass), uniform, target (q = the target's own p: every draft accepted), near
    (a mixture of p and another distribution: most drafts accepted, some rejected)."""

    KINDS = ("full", "one_hot", "sparse", "uniform", "target", "near")

    def __init__(self, kind: str, vocab_size: int, gen: torch.Generator, target_p: Callable | None = None):
        self.kind, self.vocab_size, self.target_p = kind, vocab_size, target_p
        self.table = torch.randn(vocab_size, vocab_size, generator=gen) * 2
        self.zeros = torch.rand(vocab_size, vocab_size, generator=gen) < 0.5
        self._memo: dict[tuple, torch.Tensor] = {}

    @property
    def one_hot(self) -> bool:
        return self.kind == "one_hot"

    def probs(self, tokens: Sequence[int]) -> torch.Tensor:
        key = tuple(tokens)
        if key not in self._memo:
            self._memo[key] = self._probs(tokens)
        return self._memo[key]

    def _probs(self, tokens: Sequence[int]) -> torch.Tensor:
        row = self.table[tokens[-1]]
        if self.kind == "one_hot":
            return torch.nn.functional.one_hot(row.argmax(), self.vocab_size).double()
        if self.kind == "uniform":
            return torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        if self.kind == "target":
            return self.target_p(tokens)
        if self.kind == "near":
            return 0.7 * self.target_p(tokens) + 0.3 * torch.softmax(row.double(), dim=-1)
        if self.kind == "sparse":
            zeros = self.zeros[tokens[-1]].clone()
            zeros[row.argmax()] = False  # at least one token keeps mass
            row = row.masked_fill(zeros, float("-inf"))
        return torch.softmax(row.double(), dim=-1)


def make_request(prompt: Sequence[int], outputs: Sequence[int], params: SamplingParams, seed: int = 0,
                 num_prior: int = 0) -> Request:
    r = Request(f"r{seed}", list(prompt), params, seed=seed, eos_token_ids=frozenset({EOS}))
    r.num_prior_output_tokens = num_prior
    for t in outputs:
        r.append_output_token(t)
    return r


def extended(r: Request, tokens: Sequence[int]) -> Request:
    """``r`` as if ``tokens`` had been generated after its outputs (a real Request: the plain sampler's view)."""
    return make_request(r.prompt_token_ids, r.output_token_ids + list(tokens), r.params, r.seed,
                        r.num_prior_output_tokens)


FEATURES = ("none", "temperature", "top_k", "top_p", "repetition", "presence_frequency", "logit_bias",
            "min_tokens", "mask", "history", "all")
HISTORY = {"temperature", "repetition", "presence_frequency", "logit_bias", "min_tokens", "mask"}  # "history":
# what reads the drafts, without top-k / top-p (which leave few tokens: "all" has them too)


def params_with(feature: str, rng: random.Random, vocab_size: int, num_outputs: int, k: int,
                greedy: bool = False) -> tuple[SamplingParams, MaskFn | None]:
    """Sampling params exercising ``feature`` (every one for "all"), and a per-position mask for "mask"."""
    kw: dict = {"temperature": 0.0 if greedy else 1.0, "max_tokens": 64, "stop_token_ids": (STOP,)}
    on = set(FEATURES) if feature == "all" else HISTORY if feature == "history" else {feature}
    if "temperature" in on and not greedy:
        kw["temperature"] = rng.choice([0.4, 0.8, 1.7])
    if "top_k" in on:
        kw["top_k"] = rng.randint(1, vocab_size - 1)
    if "top_p" in on:
        kw["top_p"] = rng.choice([0.5, 0.8, 0.95])
    if "repetition" in on:
        kw["repetition_penalty"] = rng.choice([0.6, 1.6, 3.0])
    if "presence_frequency" in on:
        kw["presence_penalty"] = rng.uniform(-2, 2)
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if "logit_bias" in on:
        kw["logit_bias"] = {t: rng.choice([-100.0, -3.0, 2.0, 5.0]) for t in rng.sample(range(vocab_size), 2)}
    if "min_tokens" in on:
        kw["min_tokens"] = num_outputs + rng.randint(1, k + 1)  # EOS and STOP banned at the first positions
    return SamplingParams(**kw), (grammar_like_mask(vocab_size, rng.randrange(1000)) if "mask" in on else None)


def grammar_like_mask(vocab_size: int, salt: int) -> MaskFn:
    """A mask that depends on the output so far, as a grammar's does; never empty with min_tokens on."""
    def mask_fn(outputs: Sequence[int]) -> torch.Tensor:
        allowed = torch.tensor([(t * 7 + sum(outputs) * 3 + len(outputs) + salt) % 4 != 0 for t in range(vocab_size)])
        allowed[2 + sum(outputs) % (vocab_size - 2)] = True  # one token that is neither EOS nor STOP
        return allowed
    return mask_fn


def position_masks(r: Request, drafts: Sequence[int], mask_fn: MaskFn | None) -> torch.Tensor | None:
    if mask_fn is None:
        return None
    return torch.stack([mask_fn(r.output_token_ids + list(drafts[:j])) for j in range(len(drafts) + 1)])


def plain_probs(r: Request, target: ToyTarget, mask_fn: MaskFn | None = None) -> torch.Tensor:
    """The distribution the plain sampler draws ``r``'s next token from: engine.sampling.sampler.process_logits on
    the real request, the mask last (as a grammar's), then temperature, top-k, top-p written out here."""
    x = process_logits(target.logits(r.all_token_ids).unsqueeze(0), [r])[0].double()
    if mask_fn is not None:
        x = x.masked_fill(~mask_fn(r.output_token_ids), float("-inf"))
    p, vocab_size = r.params, x.shape[0]
    if p.greedy:
        return torch.nn.functional.one_hot(x.argmax(), vocab_size).double()
    x = x / p.temperature
    if 0 < p.top_k < vocab_size:
        x = x.masked_fill(x < x.sort(descending=True).values[p.top_k - 1], float("-inf"))
    if p.top_p < 1:
        probs = torch.softmax(x, dim=-1)
        mass_above = torch.tensor([probs[probs > probs[t]].sum() + probs[(probs == probs[t]) & (
            torch.arange(vocab_size) < t)].sum() for t in range(vocab_size)], dtype=torch.float64)
        x = x.masked_fill(mass_above >= p.top_p, float("-inf"))
    return torch.softmax(x, dim=-1)


class ExactAnalysis:
    """The verification of one request's step over every draft tree of depth k, in closed form.

    ``spec_p[prefix]``: the target distribution engine.speculative computes at position len(prefix) after drafts
    ``prefix``; ``plain_p[prefix]``: the plain sampler's, after ``prefix`` was generated; ``q[prefix]``: the
    draft's. ``emitted``: P(a step emits exactly this tuple), built from acceptance_probs and residual_probs:
    draft y at a node is accepted with probability q(y) a(y); otherwise (total 1 - sum q a) the residual
    draws the last token. ``completed``: the emitted tuple continued to k + 1 tokens by the plain sampler."""

    def __init__(self, r: Request, target: ToyTarget, draft: ToyDraft, k: int, mask_fn: MaskFn | None = None):
        self.r, self.k, self.vocab_size = r, k, target.vocab_size
        self.spec_p: dict[tuple, torch.Tensor] = {}
        self.plain_p: dict[tuple, torch.Tensor] = {}
        self.q: dict[tuple, torch.Tensor] = {}
        for depth in range(k + 1):
            prefixes = list(itertools.product(range(self.vocab_size), repeat=depth))
            rows = torch.cat([target.rows(r.all_token_ids, prefix) for prefix in prefixes])
            masks = [position_masks(r, prefix, mask_fn) for prefix in prefixes]
            processed = position_logits(rows, [r] * len(prefixes), prefixes, masks)
            last = [(i + 1) * (depth + 1) - 1 for i in range(len(prefixes))]  # position `depth` of each
            probs = target_probs(processed[last], [r.params] * len(prefixes)).double()
            for prefix, p in zip(prefixes, probs):
                self.spec_p[prefix] = p
                self.plain_p[prefix] = plain_probs(extended(r, prefix), target, mask_fn)
                if depth < k:
                    self.q[prefix] = draft.probs(r.all_token_ids + list(prefix))
        self.emitted: dict[tuple, float] = defaultdict(float)
        self._walk((), 1.0)
        self.completed: dict[tuple, float] = defaultdict(float)
        for e, w in self.emitted.items():
            self._complete(e, w)

    def _walk(self, prefix: tuple, reach: float) -> None:
        p = self.spec_p[prefix]
        if len(prefix) == self.k:  # every draft accepted: the bonus token from p_k
            for y in range(self.vocab_size):
                self.emitted[prefix + (y,)] += reach * float(p[y])
            return
        q = self.q[prefix]
        accept = q * acceptance_probs(p, q)  # P(draft = y and accepted)
        residual = residual_probs(p.unsqueeze(0), q.unsqueeze(0))[0]
        reject = max(0.0, 1.0 - float(accept.sum()))
        for y in range(self.vocab_size):
            self.emitted[prefix + (y,)] += reach * reject * float(residual[y])
            if accept[y] > 0:
                self._walk(prefix + (y,), reach * float(accept[y]))

    def _complete(self, seq: tuple, w: float) -> None:
        if len(seq) == self.k + 1:
            self.completed[seq] += w
            return
        p = self.plain_p[seq]
        for y in range(self.vocab_size):
            if p[y] > 0:
                self._complete(seq + (y,), w * float(p[y]))

    def target_sequence_probs(self) -> dict[tuple, float]:
        """prod_j p_plain(y_j | y_<j) for every y in V^(k+1): the plain sampler's k + 1 tokens."""
        out = {}
        for seq in itertools.product(range(self.vocab_size), repeat=self.k + 1):
            prob = 1.0
            for j in range(self.k + 1):
                prob *= float(self.plain_p[seq[:j]][seq[j]])
                if prob == 0:
                    break
            out[seq] = prob
        return out
