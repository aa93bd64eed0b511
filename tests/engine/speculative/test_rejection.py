"""engine/speculative/rejection.py: the verification sampler is lossless.

1a (issue 28): the output distribution, computed exactly from the algorithm (acceptance probabilities and
residuals, no sampling) for vocabularies of 3-8 tokens, equals the plain sampler's — for many random
targets p and drafts q (full, one-hot, with zeros where p has mass, uniform, q = p), k in 1..4 and every
sampling feature. Then: the implementation samples what that analysis says (chi-square over many seeded
sequences, with a control showing the test tells a wrong residual apart), greedy is token-identical to
plain greedy decoding, seeds reproduce, k = 0 is the plain sampler, and the edges (EOS under min_tokens,
every draft accepted, mixed batches)."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from engine.request import SamplingParams
from engine.sampling.sampler import sample, step_seed
from engine.speculative.rejection import Drafts, acceptance_uniform, draft_step_seed, rejection_sample, residual_probs
from tests.engine.speculative.toy import (
    EOS,
    FEATURES,
    STOP,
    ExactAnalysis,
    ToyDraft,
    ToyTarget,
    extended,
    make_request,
    params_with,
    plain_probs,
    position_masks,
)

PROMPT = [2, 1]  # ids valid in a 3-token vocabulary
TOL = 5e-6


def random_case(case: int, feature: str, vocab_size: int, k: int, draft_kind: str):
    rng, gen = random.Random(case), torch.Generator().manual_seed(case)
    target = ToyTarget(vocab_size, gen)
    outputs = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 3))]
    params, mask_fn = params_with(feature, rng, vocab_size, len(outputs), k)
    r = make_request(PROMPT + [rng.randrange(vocab_size)], outputs, params, seed=case, num_prior=0)
    draft = ToyDraft(draft_kind, vocab_size, gen, target_p=lambda toks: plain_probs(
        extended(r, toks[len(r.all_token_ids):]), target, mask_fn))
    return r, target, draft, mask_fn


def _cases():
    """(feature, vocab, k, draft kind): every feature x draft kind, sizes with V^(k+1) <= 4096."""
    rng = random.Random(28)
    sizes = [(v, k) for v in range(3, 9) for k in range(1, 5) if v ** (k + 1) <= 4096]
    return [(f, *rng.choice(sizes), kind) for f in FEATURES for kind in ToyDraft.KINDS for _ in range(2)]


@pytest.mark.parametrize("case, feature, vocab_size, k, draft_kind",
                         [(i, *c) for i, c in enumerate(_cases())])
def test_exact_output_distribution_equals_the_target(case, feature, vocab_size, k, draft_kind):
    """Equal up to TOL: the sampler's p_j are float32 softmaxes, the reference's float64 (an algorithmic
    error is orders larger: the residual replaced by p moves probabilities by ~1e-2)."""
    r, target, draft, mask_fn = random_case(case, feature, vocab_size, k, draft_kind)
    exact = ExactAnalysis(r, target, draft, k, mask_fn)
    # the target distribution at every node is the plain sampler's, drafts counted as generated
    for prefix, p in exact.spec_p.items():
        torch.testing.assert_close(p, exact.plain_p[prefix], atol=TOL, rtol=0)
    # the first emitted token is distributed as p_0
    first = torch.zeros(vocab_size, dtype=torch.float64)
    for e, w in exact.emitted.items():
        first[e[0]] += w
    torch.testing.assert_close(first, exact.plain_p[()], atol=TOL, rtol=0)
    # the emitted tokens, continued by the plain sampler to k + 1 tokens, are the plain sampler's k + 1 tokens
    want = exact.target_sequence_probs()
    assert {s for s, w in exact.completed.items() if w > 0} <= {s for s, w in want.items() if w > 0}
    assert max(abs(exact.completed.get(s, 0.0) - w) for s, w in want.items()) < TOL
    assert abs(sum(exact.emitted.values()) - 1) < TOL


@pytest.mark.parametrize("wrong", ["residual is p", "acceptance q/p"])
def test_the_exact_check_tells_wrong_algorithms_apart(monkeypatch, wrong):
    """Controls for the test above: with a wrong residual or acceptance rule the completed distribution
    misses the target by far more than TOL, in most cases."""
    import tests.engine.speculative.toy as toy

    if wrong == "residual is p":
        monkeypatch.setattr(toy, "residual_probs", lambda p, q: p)
    else:
        monkeypatch.setattr(toy, "acceptance_probs", lambda p, q: torch.where(p > 0, q / p, 0.0).clamp(max=1.0))
    misses = []
    for case, (feature, vocab_size, k, draft_kind) in enumerate(_cases()[:40]):
        exact = ExactAnalysis(*random_case(case, feature, vocab_size, k, draft_kind)[:3], k)
        want = exact.target_sequence_probs()
        misses.append(max(abs(exact.completed.get(s, 0.0) - w) for s, w in want.items()))
    assert sum(m > 100 * TOL for m in misses) >= 25  # q = p, one-hot q and such are right by accident


def test_features_change_the_target_and_the_sampler_follows():
    """A control for the test above: each feature really changes p (so equality there is not vacuous)."""
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    target, r0 = ToyTarget(6, gen), make_request(PROMPT, [4, 4, 5], SamplingParams(max_tokens=64))
    base = plain_probs(r0, target)
    for feature in FEATURES[1:]:
        params, mask_fn = params_with(feature, rng, 6, 3, 2)
        r = make_request(PROMPT, [4, 4, 5], params)
        if feature == "min_tokens":
            base_eos = make_request(PROMPT, [4, 4, 5], SamplingParams(max_tokens=64, stop_token_ids=(STOP,)))
            assert plain_probs(base_eos, target)[[EOS, STOP]].sum() > 0
        assert not torch.allclose(plain_probs(r, target, mask_fn), base, atol=1e-4), feature


# ---- the implementation samples what the analysis says ----------------------------------------------------


def sample_many(r, target, draft, k, mask_fn, n: int, draw_seed: int) -> Counter:
    """One batched rejection_sample over ``n`` copies of ``r`` (seeds 0..n-1), drafts drawn from q."""
    gen = torch.Generator().manual_seed(draw_seed)
    requests, drafts, rows = [], [], []
    per_draft: dict[tuple, tuple] = {}  # the same drafts give the same q, masks and logits
    for seed in range(n):
        ri = make_request(r.prompt_token_ids, r.output_token_ids, r.params, seed=seed)
        tokens = []
        for _ in range(k):
            tokens.append(int(torch.multinomial(draft.probs(ri.all_token_ids + tokens), 1, generator=gen)))
        key = tuple(tokens)
        if key not in per_draft:
            qs = [draft.probs(ri.all_token_ids + tokens[:j]) for j in range(k)]
            per_draft[key] = (None if draft.one_hot else torch.stack(qs).float(), position_masks(ri, tokens, mask_fn),
                              target.rows(ri.all_token_ids, tokens))
        q, masks, logits = per_draft[key]
        requests.append(ri)
        drafts.append(Drafts(tokens, q, masks))
        rows.append(logits)
    result = rejection_sample(torch.cat(rows), requests, drafts)
    for d, got, num in zip(drafts, result.token_ids, result.num_accepted):
        assert got[:-1] == list(d.token_ids[:num]) and len(got) == num + 1
    return Counter(tuple(t) for t in result.token_ids)


def chi_square_p_value(counts: Counter, probs: dict[tuple, float], n: int) -> float:
    """Pearson's test of ``counts`` against ``probs``, cells expecting < 5 pooled; 0 if an impossible
    outcome occurred."""
    if any(probs.get(e, 0.0) <= 0 for e in counts):
        return 0.0
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for e, w in probs.items():
        if n * w >= 5:
            cells.append((counts.get(e, 0), n * w))
        else:
            pooled_obs, pooled_exp = pooled_obs + counts.get(e, 0), pooled_exp + n * w
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.slow
@pytest.mark.parametrize("case, feature, vocab_size, k, draft_kind, n", [  # cases with many likely outcomes
    (100, "none", 4, 2, "full", 10000), (102, "none", 5, 2, "one_hot", 10000), (103, "none", 4, 2, "sparse", 8000),
    (200, "none", 4, 3, "near", 8000), (205, "presence_frequency", 3, 4, "near", 6000),
    (301, "history", 5, 2, "near", 6000), (214, "all", 4, 3, "near", 6000), (105, "top_p", 4, 2, "target", 3000),
])
def test_samples_follow_the_exact_distribution(case, feature, vocab_size, k, draft_kind, n):
    """Seeds 0..n-1 of one request (features processed per row by engine/sampling/sampler.py: ~0.2 ms a row here)."""
    r, target, draft, mask_fn = random_case(case, feature, vocab_size, k, draft_kind)
    exact = ExactAnalysis(r, target, draft, k, mask_fn)
    counts = sample_many(r, target, draft, k, mask_fn, n, draw_seed=case)
    assert chi_square_p_value(counts, exact.emitted, n) > 1e-4
    if draft_kind == "target":
        assert all(len(e) == k + 1 for e in counts)  # q = p: every draft accepted


def test_chi_square_tells_a_wrong_residual_apart(monkeypatch):
    """The control: the same samples against the algorithm with the residual replaced by p."""
    r, target, draft, mask_fn = random_case(7, "none", 4, 2, "full")
    counts = sample_many(r, target, draft, 2, mask_fn, 12000, draw_seed=7)
    import tests.engine.speculative.toy as toy

    monkeypatch.setattr(toy, "residual_probs", lambda p, q: p)
    wrong = ExactAnalysis(r, target, draft, 2, mask_fn)
    assert chi_square_p_value(counts, wrong.emitted, 12000) < 1e-6


def test_acceptance_uniforms_are_uniform_and_index_bound():
    u = torch.tensor([acceptance_uniform(s, n) for s in range(40) for n in range(250)], dtype=torch.float64)
    assert u.min() >= 0 and u.max() < 1
    hist = torch.histc(u, bins=10, min=0, max=1)
    assert chi_square_p_value(Counter({(i,): int(c) for i, c in enumerate(hist)}),
                              {(i,): 0.1 for i in range(10)}, len(u)) > 1e-3
    assert acceptance_uniform(3, 17) == acceptance_uniform(3, 17) != acceptance_uniform(3, 18)
    seeds = {step_seed(s, n) for s in range(10) for n in range(10)}  # the draft stream is apart from the target's
    assert not seeds & {draft_step_seed(s, n) for s in range(10) for n in range(10)}


# ---- greedy, seeds, k = 0, batches, edges ---------------------------------------------------------------


def plain_greedy(r, target, n: int) -> list[int]:
    out = []
    for _ in range(n):
        ri = extended(r, out)
        out.append(sample(target.logits(ri.all_token_ids).unsqueeze(0), [ri]).token_ids[0])
    return out


@pytest.mark.parametrize("feature", FEATURES[:1] + FEATURES[4:8])
def test_greedy_is_token_identical_to_plain_greedy(feature):
    rng, gen = random.Random(11), torch.Generator().manual_seed(11)
    target = ToyTarget(8, gen)
    for trial in range(6):
        params, _ = params_with(feature, rng, 8, 2, 3, greedy=True)
        r = make_request(PROMPT, [5, 6], params)
        want = plain_greedy(r, target, 14)
        got = []
        while len(got) < 14:  # drafts: the right continuation with a random corruption, or all right
            k = rng.randint(0, 4)
            guess = want[len(got):len(got) + k]
            if guess and rng.random() < 0.6:
                guess[rng.randrange(len(guess))] = rng.randrange(8)
            ri = extended(r, got)
            result = rejection_sample(target.rows(ri.all_token_ids, guess), [ri], [Drafts(guess)])
            got += result.token_ids[0]
        assert got[:14] == want, (feature, trial)


def test_k0_is_the_plain_sampler_token_for_token_with_logprobs():
    gen = torch.Generator().manual_seed(3)
    target = ToyTarget(50, gen, scale=1.0)
    requests = [make_request(PROMPT, [7] * (i % 3), SamplingParams(temperature=0.9, top_k=(i % 2) * 20, top_p=0.9,
                                                                   frequency_penalty=0.5, logprobs=3, max_tokens=64),
                             seed=i, num_prior=i % 2) for i in range(64)]
    logits = torch.stack([target.logits(r.all_token_ids) for r in requests])
    plain = sample(logits, requests)
    spec = rejection_sample(logits, requests, [Drafts()] * len(requests))
    assert [t[0] for t in spec.token_ids] == plain.token_ids
    assert len(set(plain.token_ids)) > 10  # the seeds matter
    assert [lp[0] for lp in spec.logprobs] == plain.logprobs
    assert [tp[0] for tp in spec.top_logprobs] == plain.top_logprobs


def multi_step(r, target, proposer, num_tokens: int) -> list[int]:
    out = []
    while len(out) < num_tokens:
        ri = extended(r, out)
        drafts = proposer(ri)
        out += rejection_sample(target.rows(ri.all_token_ids, drafts), [ri], [Drafts(drafts)]).token_ids[0]
    return out


def test_seeded_stream_reproduces_and_depends_on_the_seed():
    gen = torch.Generator().manual_seed(9)
    target = ToyTarget(30, gen, scale=0.8)
    params = SamplingParams(temperature=1.0, presence_penalty=0.4, max_tokens=64)

    def ngram(ri):  # a deterministic proposer: repeat the tokens after the last occurrence of the last token
        toks = ri.all_token_ids
        for i in range(len(toks) - 2, -1, -1):
            if toks[i] == toks[-1]:
                return toks[i + 1:i + 4]
        return []
    runs = [multi_step(make_request(PROMPT, [], params, seed=s), target, ngram, 40) for s in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]


def test_a_sequence_samples_the_same_alone_or_in_any_batch():
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    target, vocab_size = ToyTarget(16, gen), 16
    requests, drafts = [], []
    for i in range(12):
        params, _ = params_with(rng.choice(FEATURES[:-2]), rng, vocab_size, 1, 3, greedy=i % 3 == 0)
        requests.append(make_request(PROMPT, [rng.randrange(vocab_size)], params, seed=i))
        k = i % 5  # k = 0 .. 4 in one batch
        q = torch.softmax(torch.randn(k, vocab_size, generator=gen), dim=-1) if i % 2 else None
        tokens = [int(torch.multinomial(q[j], 1, generator=gen)) if q is not None else rng.randrange(vocab_size)
                  for j in range(k)]
        drafts.append(Drafts(tokens, q))
    rows = [target.rows(r.all_token_ids, d.token_ids) for r, d in zip(requests, drafts)]
    batched = rejection_sample(torch.cat(rows), requests, drafts)
    order = list(reversed(range(12)))
    shuffled = rejection_sample(torch.cat([rows[i] for i in order]), [requests[i] for i in order],
                                [drafts[i] for i in order])
    for i in range(12):
        alone = rejection_sample(rows[i], [requests[i]], [drafts[i]])
        assert alone.token_ids[0] == batched.token_ids[i] == shuffled.token_ids[order.index(i)]


def test_eos_banned_by_min_tokens_is_never_accepted_then_allowed():
    target = ToyTarget(5, torch.Generator().manual_seed(0))
    target.a[:, EOS] = 20.0  # the target wants EOS everywhere
    for greedy in (True, False):
        params = SamplingParams(temperature=0 if greedy else 1.0, min_tokens=3, max_tokens=8)
        for seed in range(20):
            r = make_request(PROMPT, [4], params, seed=seed)  # position 0, 1: 2nd and 3rd token, EOS banned
            got = rejection_sample(target.rows(r.all_token_ids, [EOS]), [r], [Drafts([EOS])])
            assert got.num_accepted == [0] and got.token_ids[0][0] != EOS
            got = rejection_sample(target.rows(r.all_token_ids, [3, 3, EOS]), [r], [Drafts([3, 3, EOS])])
            assert EOS not in got.token_ids[0][:2]
            if got.num_accepted[0] == 2:  # position 2 is the 4th token: EOS allowed, and wanted
                assert got.token_ids[0][2] == EOS


def test_drafts_equal_to_the_target_argmax_are_all_accepted_and_the_bonus_follows():
    target = ToyTarget(6, torch.Generator().manual_seed(4))
    r = make_request(PROMPT, [], SamplingParams(temperature=0, logprobs=0))
    want = plain_greedy(r, target, 5)
    got = rejection_sample(target.rows(r.all_token_ids, want[:4]), [r], [Drafts(want[:4])])
    assert got.token_ids[0] == want and got.num_accepted == [4]
    rows = torch.log_softmax(target.rows(r.all_token_ids, want[:4]), dim=-1)
    assert got.logprobs[0] == [float(rows[j, t]) for j, t in enumerate(want)] and got.top_logprobs[0] == [{}] * 5


def test_residual_has_no_mass_where_the_draft_had_more():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    q = torch.tensor([[0.1, 0.6, 0.0, 0.3]])
    torch.testing.assert_close(residual_probs(p, q), torch.tensor([[0.4, 0.0, 0.2, 0.0]]) / 0.6)
    torch.testing.assert_close(residual_probs(p, p), p)  # no mass left: p (reached only through rounding)


def test_bad_inputs_are_refused():
    r = make_request(PROMPT, [], SamplingParams())
    with pytest.raises(ValueError, match="rows"):
        rejection_sample(torch.zeros(2, 4), [r], [Drafts([1, 2])])
    with pytest.raises(ValueError, match="out of range"):
        rejection_sample(torch.zeros(2, 4), [r], [Drafts([9])])
    with pytest.raises(ValueError, match="draft probs"):
        Drafts([1], torch.ones(2, 4) / 4)
