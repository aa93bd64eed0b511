"""Suffix proposer: SuffixDecoding (arXiv 2411.04975), vLLM's ``suffix`` method, after ArcticInference.

Suffix trees of bounded depth D (``suffix_decoding_max_tree_depth``): each suffix of a sequence is kept to
its first D tokens; a node counts the suffixes that pass through or end in it. Two trees propose: the
request's own, over prompt then outputs (vLLM's prompt tree, which ArcticInference extends with the response),
caught up from the tokens (:class:`RequestStates`); and the worker's :class:`SuffixCache` over the outputs
of requests that *finished* here, bounded by ``max_cached_requests`` and ``max_cached_nodes`` (its memory).

A proposal (ArcticInference ``SuffixTree::speculate``, path mode): for each match length m = 1, 2, ... (the
last m of the last D tokens, m < D) found in the tree, walk on along the most frequent child (ties: smallest
token id); a token's probability is the product of count(child) / count(node) on the way; stop below
``min_token_prob`` or at min(k, floor(m * ``max_spec_factor``)) tokens. A draft scores the sum of its
probabilities; the best wins (ties: the longer match), the cache's only if strictly better than the
request tree's. ArcticInference's tree-structured speculation is flattened to that one path (verification
here takes one chain of drafts per sequence).

Unlike vLLM + ArcticInference: the cache holds finished outputs only (not active requests' outputs token by
token), so drafts depend on the request's tokens and on what finished on this worker, not on batch order,
and a migrated request rebuilt from its tokens proposes the same; eviction is LRU (a proposal drawing on a
cached output touches it), not FIFO; and there is a node bound (~0.2 KB a node, ~0.4 KB in the cache,
which keeps endpoints to remove sequences).

The tree is ArcticInference's compressed suffix tree (``csrc/suffix_decoding/suffix_tree.cc``): a node holds
a run of tokens by reference (``ref_seq``, ``ref_idx``) into a stored sequence; appending a token updates
the <= D suffixes still growing in O(D); removing a sequence walks its suffixes. O(tokens) nodes, not
O(tokens * D) as a plain trie. Each node keeps its best child: a proposal never scans a wide node.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from engine.config import (
    DEFAULT_MAX_CACHED_NODES,
    DEFAULT_MAX_CACHED_REQUESTS,
    DEFAULT_MAX_SPEC_FACTOR,
    DEFAULT_MAX_TREE_DEPTH,
    DEFAULT_MIN_TOKEN_PROB,
)
from engine.speculative.proposers import Proposer, RequestStates, SpecSequence

_NONE: Mapping = MappingProxyType({})  # a node's children / endpoints until it has some (a dict is ~0.2 KB)


class _Node:
    __slots__ = ("token", "count", "parent", "length", "ref_seq", "ref_idx", "children", "best", "endpoints")

    def __init__(self, token: int = -1, parent: _Node | None = None, count: int = 0, length: int = 0,
                 ref_seq: int = -1, ref_idx: int = -1):
        self.token = token  # the first token of the run: the key in parent.children
        self.count = count  # suffixes passing through or ending here
        self.parent = parent
        self.length = length  # tokens in the run
        self.ref_seq, self.ref_idx = ref_seq, ref_idx  # the run is seqs[ref_seq][ref_idx:ref_idx + length]
        self.children: Mapping[int, _Node] = _NONE
        self.best: _Node | None = None  # the child with the highest (count, -token); None: not known
        # seq id -> end index of one of its suffixes that ends here; kept only where sequences are removed
        self.endpoints: Mapping[int, int] = _NONE

    def add_child(self, child: _Node) -> None:
        if self.children is _NONE:
            self.children = {}
        self.children[child.token] = child
        self.raised(child)

    def raised(self, child: _Node) -> None:
        """``child`` was added or its count went up: it may be the best child now (counts only grow in
        append, so comparing with the best is enough; remove forgets the best instead)."""
        b = self.best
        if b is None and len(self.children) == 1 or b is not None and (child.count, -child.token) > (b.count, -b.token):
            self.best = child

    def best_child(self) -> _Node | None:
        if self.best is None and self.children:
            self.best = max(self.children.values(), key=lambda c: (c.count, -c.token))
        return self.best


def _drop_end(node: _Node, seq_id: int) -> None:
    if seq_id in node.endpoints:
        del node.endpoints[seq_id]
        if not node.endpoints:  # an emptied dict keeps its table
            node.endpoints = _NONE


def _move_end(old: _Node, new: _Node, seq_id: int, end: int) -> None:
    """A suffix of ``seq_id`` that ended in ``old`` now ends in ``new``, at index ``end``."""
    if old is not new:
        _drop_end(old, seq_id)
    if new.endpoints is _NONE:
        new.endpoints = {}
    new.endpoints[seq_id] = end


@dataclass(frozen=True)
class Draft:
    token_ids: tuple[int, ...] = ()
    score: float = 0.0  # sum of the tokens' estimated probabilities
    match_len: int = 0
    ref_seq: int = -1  # a sequence holding the match and the draft (the cache's LRU touch)


class SuffixTree:
    """Bounded-depth compressed suffix tree over sequences (int ids) of token ids, with counts.
    ``removable``: sequences can be removed, which needs every node's endpoints (half a node's memory);
    a request's own tree grows only and goes whole, so it keeps none."""

    def __init__(self, max_depth: int, *, removable: bool = True):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.removable = removable
        self.root = _Node()
        self.seqs: dict[int, list[int]] = {}
        self._active: dict[int, list[_Node]] = {}  # per sequence: where its last <= D suffixes end
        self._move_end = _move_end if removable else lambda *_: None
        self.num_nodes = 1  # root included

    def extend(self, seq_id: int, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            self.append(seq_id, t)

    def close(self, seq_id: int) -> None:
        """No more tokens for ``seq_id``: drop its active-suffix list (D pointers)."""
        self._active.pop(seq_id, None)

    def append(self, seq_id: int, token: int) -> None:  # the cases of suffix_tree.cc's append
        seqs, root, move_end = self.seqs, self.root, self._move_end
        seq = seqs.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, [])
        active.append(root)
        move_end(root, root, seq_id, len(seq))
        root.count += 1
        if len(active) > self.max_depth:
            del active[0]  # that suffix is D tokens long: it ends where it is
        seq.append(token)
        end = len(seq)
        for i in range(len(active)):
            node = active[i]
            child = node.children.get(token)
            if child is None:
                if node.count == 1 and node is not root:  # only this suffix here: a leaf, which grows
                    node.length += 1
                    move_end(node, node, seq_id, end)
                else:
                    new = _Node(token, node, 1, 1, seq_id, end - 1)
                    node.add_child(new)
                    move_end(node, new, seq_id, end)
                    active[i] = new
                    self.num_nodes += 1
            elif node.count == child.count + 1 and node is not root:
                active[i] = self._grow_into(node, child, seq_id, end)
            elif child.length == 1:  # step into child
                child.count += 1
                node.raised(child)
                move_end(node, child, seq_id, end)
                child.ref_seq, child.ref_idx = seq_id, end - 1
                active[i] = child
            else:  # split child after its first token
                new = _Node(token, node, child.count + 1, 1, seq_id, end - 1)
                child.token = seqs[child.ref_seq][child.ref_idx + 1]
                new.add_child(child)
                node.children[token] = new
                if node.best is child:
                    node.best = new  # the same path, one more suffix
                else:
                    node.raised(new)
                move_end(node, new, seq_id, end)
                child.parent = new
                child.length -= 1
                child.ref_idx += 1
                active[i] = new
                self.num_nodes += 1

    def _grow_into(self, node: _Node, child: _Node, seq_id: int, end: int) -> _Node:
        """The growing suffix ended in ``node``, which every other suffix through it leaves for ``child``,
        and now goes on into ``child`` too: returns the node where it ends now."""
        if child.length == 1:  # node + token is exactly child's path: fuse node into child
            child.token, child.parent = node.token, node.parent
            child.count += 1
            child.length = node.length + 1
            self._move_end(child, child, seq_id, end)
            child.ref_seq, child.ref_idx = seq_id, end - child.length
            node.parent.children[child.token] = child
            if node.parent.best is node:  # child takes node's place, count and first token
                node.parent.best = child
            self.num_nodes -= 1
            return child
        token = child.token  # else move the boundary between node and child one token down
        node.length += 1
        self._move_end(node, node, seq_id, end)
        node.ref_seq, node.ref_idx = seq_id, end - node.length
        child.length -= 1
        child.ref_idx += 1
        child.token = self.seqs[child.ref_seq][child.ref_idx]
        if child.token != token:
            del node.children[token]
            node.children[child.token] = child
        return node

    def remove(self, seq_id: int) -> None:
        """Drop a sequence's suffixes; nodes left referring to it are re-pointed at another sequence."""
        if not self.removable:
            raise ValueError("this tree keeps no endpoints: its sequences cannot be removed")
        seq, root = self.seqs[seq_id], self.root
        path: list[_Node] = []
        for start in range(len(seq)):
            node = root
            node.count -= 1
            idx = start
            path.clear()
            while idx < len(seq):
                child = node.children.get(seq[idx])
                if child is None:
                    break
                child.count -= 1
                if node.best is child:
                    node.best = None  # another child may be ahead now
                if child.count == 0:  # count 1 nodes have no children: one node goes
                    del node.children[seq[idx]]
                    self.num_nodes -= 1
                    break
                _drop_end(child, seq_id)
                idx += child.length
                node = child
                path.append(node)
            if node is not root and len(node.children) == 1:
                only = next(iter(node.children.values()))
                if node.count == only.count:  # nothing ends at node any more: merge it into its child
                    only.token, only.parent = node.token, node.parent
                    only.length += node.length
                    only.ref_idx -= node.length
                    node.parent.children[only.token] = only
                    if node.parent.best is node:
                        node.parent.best = only
                    path[-1] = node = only
                    self.num_nodes -= 1
            leaf, distance = node, 0  # re-point the path at a leaf's endpoint in another sequence
            while leaf.children:
                leaf = next(iter(leaf.children.values()))
                distance += leaf.length
            if not leaf.endpoints or seq_id in leaf.endpoints:
                continue  # visited again later in this loop
            ref_seq, ref_idx = next(iter(leaf.endpoints.items()))
            ref_idx -= distance
            while path:
                n = path.pop()
                ref_idx -= n.length
                if n.ref_seq == seq_id:
                    n.ref_seq, n.ref_idx = ref_seq, ref_idx
        del self.seqs[seq_id]
        self._active.pop(seq_id, None)

    def match(self, context: Sequence[int], start: int) -> tuple[_Node, int] | None:
        """The node where ``context[start:]`` ends and how many of its run's tokens it takes, or None."""
        node, idx, i, n = self.root, 0, start, len(context)
        while i < n:
            node = node.children.get(context[i])
            if node is None:
                return None
            idx = min(node.length, n - i)
            if self.seqs[node.ref_seq][node.ref_idx:node.ref_idx + idx] != context[i:i + idx]:
                return None
            i += idx
        return node, idx

    def speculate(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> Draft:
        """The best draft after ``context`` (its last D tokens are used)."""
        context = list(context[max(0, len(context) - self.max_depth):])
        best, best_score, best_match_len, best_node = [], 0.0, 0, self.root
        for match_len in range(1, len(context)):
            found = self.match(context, len(context) - match_len)
            if found is None:
                break
            node, idx = found
            if idx == node.length and not node.children:
                break  # nothing follows this match, so nothing follows a longer one (it ends here too)
            limit = min(max_spec_tokens, int(match_len * max_spec_factor + 1e-6))
            if limit <= 0:
                continue
            token_ids, score, last = self._path(node, idx, limit, min_token_prob)
            if score >= best_score:
                best, best_score, best_match_len, best_node = token_ids, score, match_len, last
        return Draft(tuple(best), best_score, best_match_len, best_node.ref_seq if best else -1)

    def _path(self, node: _Node, idx: int, max_tokens: int, min_token_prob: float) -> tuple[list[int], float, _Node]:
        """From ``idx`` tokens into ``node``'s run, the most frequent continuation: (tokens, score, last node)."""
        token_ids: list[int] = []
        prob, score = 1.0, 0.0
        while len(token_ids) < max_tokens and prob >= min_token_prob:
            if idx < node.length:  # the rest of a run: every suffix here goes on the same way
                take = min(node.length - idx, max_tokens - len(token_ids))
                start = node.ref_idx + idx
                token_ids.extend(self.seqs[node.ref_seq][start:start + take])
                score += prob * take
                idx += take
            else:
                child = node.best_child()
                if child is None:
                    break
                prob *= child.count / node.count
                node, idx = child, 0
        return token_ids, score, node


class SuffixCache:
    """The worker's tree over finished requests' outputs, LRU-bounded by requests and by nodes. A request
    whose output alone needs more than ``max_nodes`` nodes is evicted right after it is inserted."""

    def __init__(self, *, max_depth: int, max_requests: int, max_nodes: int):
        if max_requests < 0 or max_nodes < 1:
            raise ValueError(f"need max_requests >= 0 and max_nodes >= 1, got {max_requests}, {max_nodes}")
        self.max_requests, self.max_nodes = max_requests, max_nodes
        self.tree = SuffixTree(max_depth)
        self._lru: OrderedDict[str, int] = OrderedDict()  # request id -> seq id, least recently used first
        self._request_of: dict[int, str] = {}
        self._next_seq_id = 0

    def insert(self, request_id: str, token_ids: Sequence[int]) -> None:
        if request_id in self._lru:
            self.evict(request_id)
        if not token_ids or self.max_requests == 0:
            return
        seq_id, self._next_seq_id = self._next_seq_id, self._next_seq_id + 1
        self._lru[request_id] = seq_id
        self._request_of[seq_id] = request_id
        self.tree.extend(seq_id, token_ids)
        self.tree.close(seq_id)
        while self._lru and (len(self._lru) > self.max_requests or self.tree.num_nodes > self.max_nodes):
            self.evict(next(iter(self._lru)))

    def evict(self, request_id: str) -> None:
        seq_id = self._lru.pop(request_id)
        del self._request_of[seq_id]
        self.tree.remove(seq_id)

    def touch(self, seq_id: int) -> None:
        """The request holding sequence ``seq_id`` was just drawn on: it becomes the most recently used."""
        request_id = self._request_of.get(seq_id)
        if request_id is not None:
            self._lru.move_to_end(request_id)

    @property
    def request_ids(self) -> list[str]:
        """Cached requests, least recently used first."""
        return list(self._lru)


def _request_tree(token_ids: Sequence[int], max_depth: int) -> SuffixTree:
    """A request's own tree: its tokens are sequence 0; it only grows and is dropped whole."""
    tree = SuffixTree(max_depth, removable=False)
    tree.extend(0, token_ids)
    return tree


class SuffixProposer(Proposer):
    """vLLM's ``suffix`` speculative method: the request's own tree and the worker's :class:`SuffixCache`.
    ``max_cached_requests`` = 0 turns the cache off (vLLM's meaning); the request trees stay."""

    def __init__(self, *, num_speculative_tokens: int, max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH,
                 max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS,
                 max_cached_nodes: int = DEFAULT_MAX_CACHED_NODES, max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR,
                 min_token_prob: float = DEFAULT_MIN_TOKEN_PROB):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.cache = SuffixCache(max_depth=max_tree_depth, max_requests=max_cached_requests,
                                 max_nodes=max_cached_nodes) if max_cached_requests else None
        self._states: RequestStates[SuffixTree] = RequestStates(lambda ids: _request_tree(ids, max_tree_depth),
                                                                lambda tree, ids: tree.extend(0, ids))

    def propose(self, seqs: Sequence[SpecSequence]) -> list[list[int]]:
        return [list(self.propose_one(seq).token_ids) for seq in seqs]

    def propose_one(self, seq: SpecSequence) -> Draft:
        k = min(seq.max_num_draft_tokens, self.num_speculative_tokens)
        if k <= 0 or not seq.token_ids:
            return Draft()
        context = seq.token_ids[max(0, len(seq.token_ids) - self.max_tree_depth):]
        draft = self._states.get(seq).speculate(context, k, self.max_spec_factor, self.min_token_prob)
        if self.cache is not None:
            cached = self.cache.tree.speculate(context, k, self.max_spec_factor, self.min_token_prob)
            if cached.score > draft.score:
                self.cache.touch(cached.ref_seq)
                draft = cached
        return draft

    def finish(self, request_id: str, output_token_ids: Sequence[int] | None = None) -> None:
        self._states.pop(request_id)
        if self.cache is not None and output_token_ids is not None:
            self.cache.insert(request_id, output_token_ids)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._states)
