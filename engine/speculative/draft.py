"""Speculative decoding with a draft model (vLLM's method ``draft_model``): a second, smaller checkpoint with the
target's vocabulary proposes up to k drafts per sequence and step; the target verifies them
(engine/speculative/rejection.py).

**Its KV.** The draft has its own KV tensor (a second ``ModelRunner``, on rank 0's device, never split) with as many
blocks as the target's and indexed by the same block ids: a sequence's draft KV at position p lies in the draft
tensor's copy of the target's block for p. So there is no second block table and no second allocator: the
scheduler's blocks serve both (a block shared through the prefix cache holds the same tokens, hence the same draft
KV). The engine sizes the target's cache for both (``ModelRunner(extra_bytes_per_block=...)``), the draft's
weights loaded first so that they count as memory in use. Correctness never depends on the draft's KV: a stale
one only makes worse drafts, which verification rejects; greedy outputs stay token-exact, sampled ones lossless
(each draft's q is the distribution it was drawn from).

**Per request** (:class:`_DraftState`): ``num_computed`` positions whose draft KV is valid, for the ``Request``
object and preemption count it was computed under: a preempted request has new blocks and starts over from 0; so
does a request new to this worker — handed off by a prefill worker with only the *target's* prompt KV, or migrated
— whose first draft step computes the prompt's draft KV here (the *catch-up*; bench/engine/draft_kv.py measures
that choice).

**Per step** (engine/speculative/decoder.py): ``propose`` returns placeholders of the most drafts a sequence may verify
(a draft model always has k), the policy cuts them, the scheduler fits them and allocates their blocks; then
:meth:`DraftModel.draft` runs, for each sequence that got n_d drafts:

1. the catch-up: ``all_token_ids[num_computed:n]`` (n: the request's tokens; the last is the one this step
   computes) through the prefill path, in forwards of at most ``max_num_batched_tokens`` tokens; the logits of
   its last token give d_0;
2. n_d - 1 batched one-token steps feeding d_0 .. d_{n_d-2}.

The draft's logits at position j are processed as the target's are (engine/speculative/targets.py: min_tokens,
logit_bias, penalties with d_<j counted as generated, the grammar mask advanced over d_<j); greedy requests take
the argmax, sampled ones draw d_j from q_j (temperature, top-k, top-p, softmax: ``target_probs``) with
``draft_step_seed`` (never the request's own step seed: the residual draw would be correlated with the draft) and
hand q to verification. After verification with a accepted, ``num_computed = n + min(a, n_d - 1)``: d_{n_d-1}
was never fed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.loading.checkpoint import load_model_config, load_tokenizer
from engine.model_runner import ModelRunner
from engine.models.config import ModelConfig
from engine.request import Request
from engine.speculative.proposers import Proposer, SpecSequence
from engine.speculative.rejection import draft_step_seed
from engine.speculative.targets import GrammarCursor, PositionView, position_logits, target_probs
from engine.text.tokenizer import Tokenizer

_PROBE_TEXTS = ("Hello, world!", "  def f(x):\n\treturn x ** 2  # ünïcödé, 日本語 🙂")


@dataclass
class _DraftState:
    request: Request  # the object the draft KV was computed for: a request id reused by another starts over
    num_preemptions: int  # its preemption count then: a preempted request has new blocks
    num_computed: int = 0  # positions 0 .. num_computed - 1 hold valid draft KV
    num_fed: int = 0  # drafts fed through the draft in the last step, their KV valid if verification accepts them


@dataclass
class DraftProposal:
    """One sequence's drafts; ``probs`` [len(token_ids), vocab]: q_j, for a sampled request (None: greedy)."""

    token_ids: list[int]
    probs: torch.Tensor | None


class DraftModel(Proposer):
    """The draft runner and its per-request KV bookkeeping. ``propose`` only reserves room (placeholders);
    :meth:`draft` makes the drafts once the step's blocks are allocated."""

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int, max_tokens_per_forward: int) -> None:
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tokens_per_forward = max_tokens_per_forward
        self.vocab_size = runner.model_cfg.vocab_size
        self._states: dict[str, _DraftState] = {}

    @classmethod
    def load(cls, config: EngineConfig, target: ModelConfig, max_model_len: int, tokenizer: Tokenizer) -> DraftModel:
        """The draft checkpoint of ``config.speculative_config``, checked against the target (``ConfigError``:
        another vocabulary or tokenizer, a shorter context), its weights loaded; its cache comes with
        :meth:`allocate`, once the target's is sized."""
        spec = config.speculative_config
        draft_cfg = load_model_config(spec.model)
        check_draft(spec.model, draft_cfg, load_tokenizer(spec.model), config.model, target, tokenizer,
                    max_model_len)
        draft_config = EngineConfig(
            model=spec.model, block_size=config.block_size, device=config.device, kernels=config.kernels,
            dtype=target.checkpoint_dtype if config.dtype == "auto" else config.dtype,  # the target's
            kv_cache_dtype=config.kv_cache_dtype,  # the engine's KV in one dtype (the draft's cache is sized with it)
            cuda_graph_max_batch=0, cpu_graph_max_batch=0, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, enable_prefix_caching=False)
        runner = ModelRunner(draft_cfg, draft_config, max_model_len, kv_blocks=False)
        return cls(runner, spec.num_speculative_tokens, config.max_num_batched_tokens)

    @property
    def bytes_per_block(self) -> int:
        return self.runner.bytes_per_block

    def allocate(self, num_blocks: int) -> DraftModel:
        """The draft's cache: ``num_blocks``, the target's count (the same block ids index both)."""
        self.runner.allocate_kv(num_blocks)
        return self

    # ---- the proposer interface ---------------------------------------------------------------------
    def propose(self, seqs: Sequence[SpecSequence]) -> list[list[int]]:
        """Placeholders (zeros) of the most drafts each sequence may verify: the draft runs after scheduling."""
        return [[0] * min(s.max_num_draft_tokens, self.num_speculative_tokens) for s in seqs]

    def finish(self, request_id: str, output_token_ids: Sequence[int] | None = None) -> None:
        self._states.pop(request_id, None)

    # ---- the step -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, requests: Sequence[Request], counts: Sequence[int]) -> list[DraftProposal]:
        """``counts[i]`` (>= 1) drafts for each of ``requests``, all decoding this step (one uncomputed token),
        their blocks allocated up to position ``num_tokens + counts[i] - 2``."""
        states = [self._state(r) for r in requests]
        ns = [r.num_tokens for r in requests]
        logits = self._catch_up(requests, [st.num_computed for st in states])
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        cursors = [GrammarCursor(r.grammar, self.vocab_size) if r.grammar is not None else None for r in requests]
        live = list(range(len(requests)))
        try:
            for j in range(max(counts)):
                if j:
                    live = [i for i in live if counts[i] > j]
                    logits = self._forward([(requests[i], ns[i] + j - 1, [tokens[i][-1]]) for i in live])
                chosen, q = self._choose(logits, [requests[i] for i in live], [tokens[i] for i in live],
                                         [cursors[i] for i in live], j)
                for at, i in enumerate(live):
                    tokens[i].append(chosen[at])
                    if q[at] is not None:
                        probs[i].append(q[at])
                    if cursors[i] is not None:
                        cursors[i].advance(chosen[at])
        finally:
            for c in cursors:
                if c is not None:
                    c.close()
        for st, n, k in zip(states, ns, counts):
            st.num_computed, st.num_fed = n, k - 1
        return [DraftProposal(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def observe(self, request: Request, num_accepted: int) -> None:
        """The step verified the request's drafts and accepted ``num_accepted``: the fed ones among them are
        real tokens now, their draft KV valid."""
        st = self._states.get(request.request_id)
        if st is not None and st.request is request:
            st.num_computed += min(num_accepted, st.num_fed)
            st.num_fed = 0

    def _state(self, request: Request) -> _DraftState:
        st = self._states.get(request.request_id)
        if (st is None or st.request is not request or st.num_preemptions != request.num_preemptions
                or st.num_computed >= request.num_tokens):  # (the last: never, short of a bug; recompute then)
            st = self._states[request.request_id] = _DraftState(request, request.num_preemptions)
        return st

    def _catch_up(self, requests: Sequence[Request], starts: Sequence[int]) -> torch.Tensor:
        """Run ``all_token_ids[start:]`` of every request through the draft, in forwards of at most
        ``max_tokens_per_forward`` tokens: the logits [len(requests), vocab] of each one's last token (host)."""
        ends = [r.num_tokens for r in requests]
        pending = list(range(len(requests)))
        at = list(starts)
        rows: list[torch.Tensor | None] = [None] * len(requests)
        while pending:
            budget, chunks, owners = self.max_tokens_per_forward, [], []
            for i in pending:
                take = min(ends[i] - at[i], budget)
                if take <= 0:
                    break
                r = requests[i]
                chunks.append((r, at[i], r.all_token_ids[at[i]:at[i] + take]))
                owners.append(i)
                at[i] += take
                budget -= take
            done = [n for n, i in enumerate(owners) if at[i] == ends[i]]
            logits = self._forward(chunks, done)
            for row, n in enumerate(done):
                rows[owners[n]] = logits[row]
            pending = [i for i in pending if at[i] < ends[i]]
        return torch.stack(rows)

    def _forward(self, chunks: list[tuple[Request, int, list[int]]], want: list[int] | None = None) -> torch.Tensor:
        """One draft forward over ``chunks`` (request, first position, token ids): the logits of the last token
        of the chunks ``want`` names (default: all), in that order, fp32 on the host."""
        B = self.runner.block_size
        order = sorted(range(len(chunks)), key=lambda c: len(chunks[c][2]) == 1)  # prefill chunks first
        input_ids, positions, slots, seq_lens, tables, cu_q = [], [], [], [], [], [0]
        last = [0] * len(chunks)
        for c in order:
            r, start, ids = chunks[c]
            block_ids = r.block_ids
            end = start + len(ids)
            input_ids += ids
            positions += self.runner.model.rope.rows(r.params.rope_factors, start, end)  # the request's LongRoPE set
            slots += [block_ids[p // B] * B + p % B for p in range(start, end)]
            seq_lens.append(end)
            tables.append(block_ids)
            cu_q.append(cu_q[-1] + len(ids))
            last[c] = cu_q[-1] - 1
        num_prefills = sum(1 for r, s, ids in chunks if len(ids) > 1)
        self.runner.forward(input_ids, positions, slots, cu_q, tables, seq_lens, num_prefills)
        want = range(len(chunks)) if want is None else want
        if not want:
            return torch.empty(0, self.vocab_size)
        return self.runner.logits([last[c] for c in want]).float().cpu()

    def _choose(self, logits: torch.Tensor, requests: list[Request], prior: list[list[int]],
                cursors: list[GrammarCursor | None], j: int) -> tuple[list[int], list[torch.Tensor | None]]:
        """Draft j of each request from the draft's logits at that position (one row each): the processed
        argmax (greedy) or a draw from q_j (sampled, q_j returned)."""
        views = [PositionView(r, d) for r, d in zip(requests, prior)]
        allowed = [c.mask().unsqueeze(0) if c is not None else None for c in cursors]
        x = position_logits(logits, views, [()] * len(requests), allowed)
        chosen = x.argmax(dim=-1).tolist()
        q: list[torch.Tensor | None] = [None] * len(requests)
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if sampled:
            p = target_probs(x[sampled], [requests[i].params for i in sampled])
            noise = torch.empty_like(p)
            gen = torch.Generator()
            for row, i in enumerate(sampled):
                r = requests[i]
                gen.manual_seed(draft_step_seed(r.seed, r.num_prior_output_tokens + len(r.output_token_ids) + j))
                noise[row].exponential_(generator=gen)
            for row, (i, t) in enumerate(zip(sampled, (p / noise).argmax(dim=-1).tolist())):
                chosen[i], q[i] = t, p[row]
        return chosen, q


def check_draft(draft_path: str, draft: ModelConfig, draft_tokenizer: Tokenizer, target_path: str,
                target: ModelConfig, target_tokenizer: Tokenizer, max_model_len: int) -> None:
    """``ConfigError`` naming both checkpoints unless the draft's token ids mean what the target's do (the same
    vocabulary size, tokens, EOS ids and encodings) and its context holds ``max_model_len``."""
    def refuse(what: str) -> ConfigError:
        return ConfigError(f"speculative config: the draft model {draft_path} does not fit the target {target_path}: "
                           f"{what}")

    if draft.vocab_size != target.vocab_size:
        raise refuse(f"vocab_size {draft.vocab_size} != {target.vocab_size}")
    draft_tokens, target_tokens = draft_tokenizer.token_bytes(), target_tokenizer.token_bytes()
    if draft_tokens != target_tokens:
        i = next((i for i, (a, b) in enumerate(zip(draft_tokens, target_tokens)) if a != b),
                 min(len(draft_tokens), len(target_tokens)))
        d, t = (toks[i] if i < len(toks) else None for toks in (draft_tokens, target_tokens))
        raise refuse(f"their tokenizers differ at token id {i} ({d!r} vs {t!r})")
    if draft_tokenizer.eos_token_ids != target_tokenizer.eos_token_ids:
        raise refuse(f"EOS token ids {sorted(draft_tokenizer.eos_token_ids)} != "
                     f"{sorted(target_tokenizer.eos_token_ids)}")
    for text in _PROBE_TEXTS:
        if draft_tokenizer.encode(text) != target_tokenizer.encode(text):
            raise refuse(f"their tokenizers encode {text!r} differently")
    if draft.max_position_embeddings < max_model_len:
        raise refuse(f"its max_position_embeddings {draft.max_position_embeddings} is below the engine's "
                     f"max_model_len {max_model_len} (set max_model_len <= {draft.max_position_embeddings})")
    if draft.longrope_original_len not in (None, target.longrope_original_len):  # one factor set per request
        raise refuse(f"its LongRoPE pre-training length {draft.longrope_original_len} differs from the target's "
                     f"{target.longrope_original_len} (each request takes one LongRoPE factor set, chosen on the "
                     "target's length)")
