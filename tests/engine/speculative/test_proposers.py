"""Draft proposers (engine/speculative/ngram.py, engine/speculative/suffix.py) against brute-force statements of their
rules.

The references here restate the rules from scratch on raw token lists (no index, no tree): the n-gram rule
as vLLM's (longest suffix n-gram in [min, max] with an earlier occurrence, the earliest one), the suffix rule
as ArcticInference's speculate over occurrence counts of depth-bounded suffixes.
"""
from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from engine.speculative.ngram import NgramIndex, NgramProposer
from engine.speculative.proposers import SpecSequence
from engine.speculative.suffix import SuffixCache, SuffixProposer, SuffixTree


def seq(token_ids, k=8, request_id="r", num_prompt_tokens=None) -> SpecSequence:
    return SpecSequence(request_id, list(token_ids), len(token_ids) if num_prompt_tokens is None
                        else num_prompt_tokens, k)


def words(text: str, vocab: dict[str, int]) -> list[int]:
    """A word-level tokenizer: enough to make repeated text and code into token ids."""
    return [vocab.setdefault(w, len(vocab)) for w in text.split()]


# ---------------------------------------------------------------- n-gram


def ngram_ref(toks, k, lo, hi):
    for n in range(min(hi, len(toks) - 1), lo - 1, -1):
        suffix = toks[len(toks) - n:]
        for i in range(len(toks) - n):  # occurrences ending before the last token, earliest first
            if toks[i:i + n] == suffix:
                return toks[i + n:i + n + k]
    return []


def ngram(k=4, lo=1, hi=3):
    return NgramProposer(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)


def test_ngram_vllm_docstring_example():
    # vLLM's NgramProposer.propose docstring: [1,2,3,4,2,3], min 2, max 3, k 4 -> [4, 2, 3]
    assert ngram(4, 2, 3).propose([seq([1, 2, 3, 4, 2, 3])]) == [[4, 2, 3]]


def test_ngram_longest_then_earliest():
    # the 2-gram (7, 8) first occurs at 0 (then 9); the 3-gram (5, 7, 8) only at 3 (then 6): longest wins
    toks = [7, 8, 9, 5, 7, 8, 6, 1, 5, 7, 8]
    assert ngram(2, 1, 3).propose([seq(toks)]) == [[6, 1]]
    # max 2: the 2-gram's earliest occurrence; min 4: nothing is long enough
    assert ngram(2, 1, 2).propose([seq(toks)]) == [[9, 5]]
    assert ngram(2, 4, 5).propose([seq(toks)]) == [[]]
    # several occurrences of the same n-gram: the earliest, as vLLM
    assert ngram(3, 2, 2).propose([seq([5, 6, 1, 5, 6, 2, 5, 6])]) == [[1, 5, 6]]


def test_ngram_bounds_and_no_match():
    p = ngram(3, 1, 2)
    toks = [1, 2, 3, 4, 5, 6, 1, 2]
    assert p.propose([seq(toks, k=8), seq(toks, k=2, request_id="b"), seq(toks, k=0, request_id="c")]) == \
        [[3, 4, 5], [3, 4], []]
    assert p.propose([seq([1, 2, 3, 4]), seq([9], request_id="d"), seq([], request_id="e")]) == [[], [], []]
    # the draft may run into the suffix itself, and stops at the sequence's end
    assert ngram(8, 1, 1).propose([seq([4, 4, 4])]) == [[4, 4]]


def test_ngram_matches_reference_incrementally_and_rebuilt():
    """Random sequences over small alphabets: the index, caught up one token at a time, agrees with the
    brute-force rule and with an index built from scratch at every step."""
    rng = random.Random(0)
    for _trial in range(60):
        lo = rng.randint(1, 3)
        hi = lo + rng.randint(0, 3)
        k = rng.randint(1, 5)
        p = ngram(k, lo, hi)
        toks = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randint(1, 6))]
        for _ in range(40):
            want = ngram_ref(toks, k, lo, hi)
            assert p.propose([seq(toks)]) == [want]
            assert ngram(k, lo, hi).propose([seq(toks)]) == [want]
            toks.append(rng.randrange(3))


def test_ngram_repeated_text_and_code_with_edits():
    vocab: dict[str, int] = {}
    code = "def add ( a , b ) : return a + b\n"
    prompt = words(code + " def sub ( a , b ) : return a - b", vocab)
    out = words("def add ( a , b ) :", vocab)
    # the output restarts the first function: the continuation is its body
    assert ngram(4, 2, 4).propose([seq(prompt + out, num_prompt_tokens=len(prompt))]) == [
        words("return a + b", vocab)]
    # an edit (b -> c): no 2-gram after the edit has been seen until the copy resumes
    edited = prompt + words("def add ( a , c )", vocab)
    assert ngram(4, 2, 4).propose([seq(edited)]) == [[]]
    assert ngram(4, 2, 4).propose([seq(edited + words(") :", vocab))]) == [words("return a + b", vocab)]


def test_ngram_state_follows_rollback_and_finish():
    p = ngram(3, 1, 2)
    toks = [1, 2, 3, 1, 2, 9, 1, 2]
    assert p.propose([seq(toks)]) == [[3, 1, 2]]
    # another sequence under the same id (a rollback, an id reused): rebuilt, not extended
    assert p.propose([seq([5, 6, 5])]) == [[6, 5]]
    assert p.propose([seq([1, 2, 3, 1, 2, 9, 1, 7, 1])]) == [[2, 3, 1]]
    assert p.num_tracked_requests == 1
    p.finish("r")
    assert p.num_tracked_requests == 0


def time_long_prompt(proposer, num_steps: int, num_tokens: int = 32768):
    """(seconds to build the request's state from a ``num_tokens`` prompt, seconds per proposal after it,
    the final drafts, the prompt): the output copies an earlier stretch of the prompt, so matches are long."""
    rng = random.Random(1)
    prompt = [rng.randrange(32000) for _ in range(num_tokens)]
    t0 = time.perf_counter()
    proposer.propose([seq(prompt)])
    build_s = time.perf_counter() - t0
    grown = list(prompt)
    t0 = time.perf_counter()
    for i in range(num_steps):
        grown.append(grown[1000 + i])
        proposer.propose([SpecSequence("r", grown, len(prompt), 8)])  # as the engine would: no copy
    step_s = (time.perf_counter() - t0) / num_steps
    return build_s, step_s, proposer.propose([seq(grown, num_prompt_tokens=len(prompt))])[0], prompt


def test_ngram_long_prompt_is_linear():
    """32K-token prompt, vLLM's defaults (5, 5) and a range (2, 5); indexing once, then a proposal per step.
    Measured on a loaded 2-core CPU machine: index 0.1-0.4 s for 32K tokens (0.007 s for 2K: linear); 5-25 us
    a step at 32K, as at 2K (6 us). A per-step scan in Python (vLLM's KMP rule) would cost milliseconds.
    Memory: ~160 B per token per n in the range (5.2 MB for (5, 5), 33 MB for (2, 8) at 32K)."""
    for lo, hi in ((5, 5), (2, 5)):
        build_s, step_s, drafts, prompt = time_long_prompt(ngram(5, lo, hi), 500)
        print(f"ngram ({lo}, {hi}): build {build_s:.3f} s, {step_s * 1e6:.1f} us a step")
        assert drafts == prompt[1500:1505]
        assert build_s < 5 and step_s < 2e-3, (build_s, step_s)  # ~100x headroom on the measured times


# ---------------------------------------------------------------- suffix tree


def brute_counts(seqs, depth):
    counts = Counter()
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                counts[tuple(s[i:i + n])] += 1
    return counts


def check_tree(tree: SuffixTree):
    """The tree's counts are the brute-force occurrence counts of every string it holds; every node's run
    and path are where its reference says; node count and best children are right."""
    counts = brute_counts(tree.seqs.values(), tree.max_depth)
    held, num_nodes = {}, 0
    stack = [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        num_nodes += 1
        if node is not tree.root:
            ref = tree.seqs[node.ref_seq]
            run = tuple(ref[node.ref_idx:node.ref_idx + node.length])
            assert len(run) == node.length and run[0] == node.token
            assert tuple(ref[node.ref_idx - len(path):node.ref_idx]) == path
            held.update({path + run[:n]: node.count for n in range(1, node.length + 1)})
            path += run
        if node.children:
            best = max(node.children.values(), key=lambda c: (c.count, -c.token))
            assert node.best in (None, best)
        for token, child in node.children.items():
            assert child.token == token and child.parent is node
            assert node is tree.root or child.count < node.count
            stack.append((child, path))
    assert held == dict(counts)
    assert num_nodes == tree.num_nodes


def test_tree_counts_under_appends_and_removals():
    rng = random.Random(2)
    for _trial in range(150):
        tree = SuffixTree(rng.randint(1, 6))
        growing, alive = [0, 1, 2], set()
        for _ in range(50):
            r = rng.random()
            if r < 0.75 and growing:
                s = rng.choice(growing)
                tree.append(s, rng.randrange(rng.choice([2, 3])))
                alive.add(s)
            elif alive and r < 0.9:
                s = rng.choice(sorted(alive))
                tree.remove(s)
                alive.discard(s)
                growing = [g for g in growing if g != s]
            check_tree(tree)
        for s in sorted(alive):
            tree.remove(s)
        assert tree.num_nodes == 1 and tree.root.count == 0 and not tree.root.children


def suffix_ref(seqs, depth, context, k, factor, min_prob):
    """ArcticInference's path speculation restated on occurrence counts."""
    counts = brute_counts(seqs, depth)
    ctx = list(context)[-depth:]
    best, best_score = [], 0.0
    for m in range(1, len(ctx)):
        q = tuple(ctx[len(ctx) - m:])
        if q not in counts:
            break
        limit = min(k, int(m * factor + 1e-6))
        toks, probs, prob = [], [], 1.0
        while len(toks) < limit:
            nexts = [(counts[q + (t,)], -t) for t in range(10) if q + (t,) in counts]
            if not nexts:
                break
            c, neg_t = max(nexts)
            prob *= c / counts[q]
            if prob < min_prob:
                break
            toks.append(-neg_t)
            probs.append(prob)
            q += (-neg_t,)
        # the tree adds a run's probability times its length; so does this, to compare ties exactly
        score = sum(p * n for p, n in ((p, probs.count(p)) for p in dict.fromkeys(probs)))
        if toks and score >= best_score:
            best, best_score = toks, score
    return best


def test_speculate_matches_reference():
    rng = random.Random(3)
    for _trial in range(200):
        depth = rng.randint(2, 8)
        seqs = [[rng.randrange(rng.choice([2, 3, 4])) for _ in range(rng.randint(1, 30))] for _ in range(3)]
        tree = SuffixTree(depth)
        for i, s in enumerate(seqs):
            tree.extend(i, s)
        context = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        k, factor, min_prob = rng.randint(1, 6), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.4])
        got = tree.speculate(context, k, factor, min_prob)
        assert list(got.token_ids) == suffix_ref(seqs, depth, context, k, factor, min_prob)


# ---------------------------------------------------------------- suffix proposer


def suffix(k=8, **kw):
    return SuffixProposer(num_speculative_tokens=k, **kw)


def test_suffix_repeated_text_and_code():
    vocab: dict[str, int] = {}
    prompt = words("for i in range ( n ) : total += x [ i ] print ( total )", vocab)
    out = words("for i in range ( n ) :", vocab)
    p = suffix(8)
    # an 8-token match: the prompt loop's continuation, min(k, 8 * 1.0) tokens, each of probability 1/2 (the
    # match occurs twice: in the prompt and as the context itself, with nothing after it yet)
    assert p.propose([seq(prompt + out, num_prompt_tokens=len(prompt))]) == [
        words("total += x [ i ] print (", vocab)]
    # an edit (n -> m) breaks the long match; a 2-token match (") :") gives 2 tokens (max_spec_factor 1)
    edited = prompt + words("for j in range ( m ) :", vocab)
    assert p.propose([seq(edited)]) == [words("total +=", vocab)]
    # nothing seen after the last token: no drafts
    assert p.propose([seq(prompt + words("while", vocab))]) == [[]]


def test_suffix_bounds_factor_and_probability_threshold():
    # "1 2" occurs 4 times (the last, the context's own, with nothing after it): 3 follows twice -> 1/2;
    # "1 2 3" is followed by 5 and 6 once each -> 5 (the smaller id), 1/4
    toks = [1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 4, 7, 1, 2]
    assert suffix(4).propose([seq(toks)]) == [[3, 5]]  # matched "1 2": at most 2 * 1.0 tokens, score 0.75
    assert suffix(4, min_token_prob=0.3).propose([seq(toks)]) == [[3]]
    assert suffix(4, max_spec_factor=2.0).propose([seq(toks)]) == [[3, 5, 1, 2]]
    assert suffix(4, max_spec_factor=2.0, min_token_prob=0.6).propose([seq(toks)]) == [[]]
    assert suffix(4, max_spec_factor=2.0).propose([seq(toks, k=2)]) == [[3, 5]]
    assert suffix(4, max_spec_factor=0.5).propose([seq(toks)]) == [[3]]
    assert suffix(4).propose([seq(toks, k=0)]) == [[]]
    assert suffix(4).propose([seq([1]), seq([], request_id="e")]) == [[], []]


def test_suffix_rebuilt_state_proposes_the_same():
    """Step by step, one proposer catches its trees up; another is built from the tokens at every step (a
    migration); a third sees the steps in a different batch order. Same drafts, same worker cache."""
    rng = random.Random(4)
    outputs = [[rng.randrange(5) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    stepwise, order = suffix(6), suffix(6)
    for p in (stepwise, order):
        for i, o in enumerate(outputs):
            p.finish(f"done{i}", o)
    a = [rng.randrange(5) for _ in range(10)]
    b = [rng.randrange(5) for _ in range(7)]
    for _step in range(60):
        batch = [seq(a, request_id="a", num_prompt_tokens=10), seq(b, request_id="b", num_prompt_tokens=7)]
        got = stepwise.propose(batch)
        fresh = suffix(6)
        for i, o in enumerate(outputs):
            fresh.finish(f"done{i}", o)
        assert got == fresh.propose(batch)
        assert got[::-1] == order.propose(batch[::-1])
        a.append(got[0][0] if got[0] and rng.random() < 0.7 else rng.randrange(5))
        b.append(got[1][0] if got[1] and rng.random() < 0.7 else rng.randrange(5))
    assert stepwise.num_tracked_requests == 2
    stepwise.finish("a")  # no outputs given (aborted, migrated away): nothing is cached
    assert stepwise.num_tracked_requests == 1 and "a" not in stepwise.cache.request_ids


def test_suffix_cache_drafts_from_finished_outputs():
    vocab: dict[str, int] = {}
    answer = words('{ "name" : "add" , "arguments" : { "a" : 1 , "b" : 2 } }', vocab)
    p = suffix(8)
    question = words("call add with 1 and 2", vocab)
    assert p.propose([seq(question + answer[:3], num_prompt_tokens=len(question))]) == [[]]
    p.finish("first", answer)
    # a later request starting the same JSON: the cached output continues it (its prompt has no match)
    got = p.propose([seq(words("call sub", vocab) + answer[:3], request_id="second", num_prompt_tokens=2)])
    assert got == [answer[3:6]]  # a 3-token match: min(k, 3 * 1.0) tokens, probability 1


def test_suffix_request_tree_wins_ties_with_the_cache():
    toks = [1, 2, 7, 8, 1, 2]  # own tree: "1 2" twice (one is the context's), 7 8 after it: score 1/2 + 1/2
    p = suffix(4)
    p.finish("x", [1, 2, 3, 4])  # the cache: "1 2" once, 3 4 after it: score 1 + 1, strictly better
    assert p.propose([seq(toks)]) == [[3, 4]]
    p.finish("y", [1, 2, 5, 6])  # now 3 and 5 each follow half of the cache's "1 2": 1/2 + 1/2, a tie
    assert p.propose([seq(toks)]) == [[7, 8]]


def test_suffix_cache_order_independent_and_bounded():
    rng = random.Random(5)
    outs = {f"r{i}": [rng.randrange(4) for _ in range(rng.randint(1, 30))] for i in range(12)}
    one, two = SuffixCache(max_depth=6, max_requests=100, max_nodes=10_000), \
        SuffixCache(max_depth=6, max_requests=100, max_nodes=10_000)
    for rid in outs:
        one.insert(rid, outs[rid])
    for rid in reversed(list(outs)):
        two.insert(rid, outs[rid])
    for _ in range(50):
        ctx = [rng.randrange(4) for _ in range(rng.randint(2, 8))]
        assert one.tree.speculate(ctx, 5, 1.0, 0.1).token_ids == two.tree.speculate(ctx, 5, 1.0, 0.1).token_ids
    # bounded by requests: least recently used out first (a proposal drawing on an output uses it); an id
    # finished again replaces its output
    p = suffix(4, max_cached_requests=3)
    for rid, out in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [7, 8, 9])):
        p.finish(rid, out)
    assert p.propose([seq([0, 1, 2])]) == [[3]] and p.cache.request_ids == ["b", "c", "a"]
    p.finish("d", [10, 11, 12])
    assert p.cache.request_ids == ["c", "a", "d"]
    p.finish("c", [13, 14])
    assert p.cache.request_ids == ["a", "d", "c"]
    check_tree(p.cache.tree)
    assert sorted(p.cache.tree.seqs.values()) == [[1, 2, 3], [10, 11, 12], [13, 14]]


def test_suffix_cache_node_bound_and_eviction():
    rng = random.Random(6)
    cache = SuffixCache(max_depth=8, max_requests=1000, max_nodes=200)
    for i in range(80):
        cache.insert(f"r{i}", [rng.randrange(6) for _ in range(rng.randint(1, 40))])
        assert cache.tree.num_nodes <= 200
        if i % 10 == 0:
            check_tree(cache.tree)
    assert 0 < len(cache.request_ids) < 80 and cache.request_ids[-1] == "r79"
    # one output needing more nodes than the bound alone: inserted, then evicted with everything else
    cache.insert("huge", list(range(500)))
    assert cache.request_ids == [] and cache.tree.num_nodes == 1 and not cache.tree.seqs
    off = suffix(4, max_cached_requests=0)
    off.finish("x", [1, 2, 3, 1, 2, 3])
    assert off.cache is None and off.propose([seq([1, 2])]) == [[]]


def test_suffix_request_tree_memory_and_speed():
    """Measured on a loaded 2-core CPU machine: a 32K-token request tree builds in 0.4-0.8 s (2K: 0.015-0.035 s;
    O(D) a token, D = 24) into ~41K nodes of ~0.2 KB (~8.5 MB); a proposal costs 0.08-0.35 ms at 32K tokens,
    as at 2K (it compares ~D^2 / 2 tokens to match and walks the drafts: no term in the length). The cache's
    nodes also keep endpoints: ~0.4 KB each."""
    p = suffix(8)
    build_s, step_s, drafts, prompt = time_long_prompt(p, 300)
    print(f"suffix: build {build_s:.3f} s, {step_s * 1e6:.1f} us a step")
    assert drafts == prompt[1300:1308]
    assert build_s < 20 and step_s < 0.02, (build_s, step_s)


def test_spec_sequence_checks():
    with pytest.raises(ValueError):
        SpecSequence("r", [1, 2], 3, 1)
    with pytest.raises(ValueError):
        SpecSequence("r", [1, 2], 2, -1)
    assert NgramIndex([1, 2, 1], min_n=1, max_n=1).match() == (1, 0)
