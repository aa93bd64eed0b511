"""How a draft model's KV reaches the decode worker (issue 28 must-show 3): measured, not assumed.

    python -m bench.engine.draft_kv [--target DIR --draft DIR] [--lengths 128,512,1024] [--batch 4]

duet's choice (engine/speculative/draft.py): a prefill worker ships only the *target's* prompt KV; the decode worker's
first draft step runs the whole prompt through the draft (the catch-up), so the draft's KV is never shipped. Two
tables:

(a) **Cost of the catch-up**: per prompt length, a batch of prompts prefilled by the target (the prefill
    worker's work: ``generate`` with max_tokens 1) against the draft's first catch-up of the same prompts (timed
    inside the engine, ``DraftModel._catch_up``; each the least of 3 rounds after a warm-up round), and the KV
    bytes per prompt of each model: what shipping the draft's KV instead would add to the transfer.
(b) **What the prompt is worth to the draft**: acceptance (accepted / drafts verified, greedy, k drafts every
    step) when the draft sees the whole prompt against when it sees only the last W prompt tokens — the
    alternative that would need neither the shipment nor the catch-up (``WindowedDraft``: the draft's context
    starts W tokens before the prompt's end; RoPE makes that a shift of every position).

Models: by default tiny local checkpoints (engine/loading/tiny.py): for (a) a target and a draft of a quarter of its
layers and width; for (b) a draft derived from the target by 5 % weight noise (engine/loading/tiny_draft.py), since two
unrelated random models agree on no token. ``--target`` / ``--draft`` take real checkpoints (they must share a
tokenizer), e.g. SmolLM2-135M (``python -m bench.hf_model``) and a draft of its first layers
(``engine.loading.tiny_draft.derive_draft(..., num_layers=10)``) for (a), one of its weights plus noise for (b),
with ``--text``.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from engine.speculative.draft import DraftModel


class WindowedDraft(DraftModel):
    """A draft that sees only the last ``window`` tokens of each prompt (its context starts there)."""

    window = 64

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._offsets: dict[str, int] = {}

    def _state(self, request):
        st = super()._state(request)
        if st.num_computed == 0:  # new here: skip the prompt's head
            off = self._offsets[request.request_id] = max(0, request.num_prompt_tokens - self.window)
            st.num_computed = off
        return st

    def _forward(self, chunks, want=None):
        return super()._forward([(r, start - self._offsets.get(r.request_id, 0), ids) for r, start, ids in chunks],
                                want)


def engine_with(target: str, draft: str | None, k: int = 4, **kw):
    from engine.config import EngineConfig
    from engine.engine import Engine

    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k} if draft else None
    engine = Engine(EngineConfig(model=target, speculative_config=spec, **kw))
    if engine.spec is not None:
        engine.spec.cost.fit = lambda: None  # verify every draft: acceptance measured at every position
    return engine


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Token prompts with repeats (a phrase recurs, as in documents): the context predicts the next token."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrases = [[rng.randrange(10, vocab) for _ in range(rng.randint(4, 12))] for _ in range(8)]
        p: list[int] = []
        while len(p) < length:
            p += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(10, vocab)]
        out.append(p[:length])
    return out


def catch_up_cost(target: str, draft: str, lengths: list[int], batch: int, repeats: int = 3) -> list[dict]:
    """Per length: the least of ``repeats`` timings of each (after one warm-up round)."""
    from engine.request import SamplingParams

    rows = []
    plain = engine_with(target, None, max_model_len=max(lengths) + 64, max_num_seqs=batch)
    spec = engine_with(target, draft, max_model_len=max(lengths) + 64, max_num_seqs=batch)
    vocab = plain.model_config.vocab_size
    timed: list[float] = []
    inner = spec.spec.draft._catch_up

    def timing(requests, starts):
        t0 = time.perf_counter()
        out = inner(requests, starts)
        timed.append(time.perf_counter() - t0)
        return out

    spec.spec.draft._catch_up = timing
    for length in lengths:
        target_s, draft_s = [], []
        for rep in range(repeats + 1):  # the first round warms up this length's shapes
            prompts = random_prompts(batch, length, vocab, 1000 * length + rep)  # new prompts: no prefix hits
            t0 = time.perf_counter()
            plain.generate(prompts, SamplingParams(max_tokens=1))
            target_s.append(time.perf_counter() - t0)
            timed.clear()
            # 3 tokens: the first from the prefill, then one step with a draft (its catch-up: the prompt + 1 token)
            spec.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
            draft_s.append(sum(timed))
        target_s, draft_s = min(target_s[1:]), min(draft_s[1:])
        blocks = -(-length // plain.config.block_size)
        rows.append({"length": length, "target_prefill_s": target_s, "draft_catch_up_s": draft_s,
                     "target_kv_bytes": blocks * plain.runner.bytes_per_block,
                     "draft_kv_bytes": blocks * spec.spec.draft.bytes_per_block})
    return rows


def acceptance(target: str, draft: str, windows: list[int | None], length: int, n: int, max_tokens: int,
               text: bool = False) -> list[dict]:
    """``text``: the first ``n`` input-grounded chat prompts of bench/engine/speculative_prompts.py (a real tokenizer's
    target) instead of ``n`` token prompts of ``length``."""
    from bench.engine.speculative_prompts import prompts as text_prompts
    from engine.request import SamplingParams

    rows = []
    for w in windows:
        engine = engine_with(target, draft, max_model_len=length + max_tokens + 16)
        if w is not None:  # the same runner, seen through a window
            d = engine.spec.draft
            windowed = WindowedDraft(d.runner, d.num_speculative_tokens, d.max_tokens_per_forward)
            windowed.window = w
            engine.spec.draft = engine.spec.proposer = windowed
        if text:
            prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": t}])
                       for t in text_prompts("input-grounded", n)[0]]
        else:
            prompts = random_prompts(n, length, engine.model_config.vocab_size, 7)
        engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        st = engine.spec.stats
        rows.append({"window": "full prompt" if w is None else f"last {w}", "drafts": st.num_draft_tokens,
                     "accepted": st.num_accepted_tokens, "rate": st.num_accepted_tokens / max(st.num_draft_tokens, 1),
                     "per_pos": [round(a / max(st.num_drafts, 1), 3) for a in st.accepted_per_pos]})
    return rows


def tiny_models(root: Path) -> tuple[str, str, str]:
    """(target, small draft for timing, near draft for acceptance)."""
    from engine.loading.tiny import make_tiny_model
    from engine.loading.tiny_draft import derive_draft

    target = make_tiny_model(root / "target", hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
                             intermediate_size=768, max_position_embeddings=4096)
    small = make_tiny_model(root / "small", seed=1, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=384, max_position_embeddings=4096)
    near = derive_draft(target, root / "near", noise=0.05)
    return str(target), str(small), str(near)


def print_catch_up_cost(target: str, small: str, args) -> None:
    print(f"(a) catch-up cost: target {target}, draft {small}, batch {args.batch}")
    print(f"{'prompt':>7} {'target prefill s':>17} {'draft catch-up s':>17} {'ratio':>6} "
          f"{'target KV/prompt':>17} {'draft KV/prompt':>16} {'draft/target KV':>15}")
    for r in catch_up_cost(target, small, [int(x) for x in args.lengths.split(",")], args.batch):
        print(f"{r['length']:>7} {r['target_prefill_s']:>17.3f} {r['draft_catch_up_s']:>17.3f} "
              f"{r['draft_catch_up_s'] / r['target_prefill_s']:>6.2f} {r['target_kv_bytes'] / 1024:>15.0f}KB "
              f"{r['draft_kv_bytes'] / 1024:>14.0f}KB {r['draft_kv_bytes'] / r['target_kv_bytes']:>15.2f}")


def print_acceptance(target: str, near: str, args) -> None:
    windows = [None] + [int(x) for x in args.windows.split(",")]
    what = "input-grounded chat prompts" if args.text else f"prompts of {args.accept_length} tokens"
    print(f"\n(b) acceptance: target {target}, draft {near}, {args.accept_prompts} {what}, {args.max_tokens} greedy "
          "tokens, 4 drafts a step")
    print(f"{'draft sees':>12} {'drafts':>7} {'accepted':>9} {'rate':>6}  per position")
    for r in acceptance(target, near, windows, args.accept_length, args.accept_prompts, args.max_tokens, args.text):
        print(f"{r['window']:>12} {r['drafts']:>7} {r['accepted']:>9} {r['rate']:>6.3f}  {r['per_pos']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--draft", help="the draft of table (b), and of (a) without --timing-draft (default: tiny "
                    "ones, see the module docstring)")
    ap.add_argument("--timing-draft", help="the draft of table (a)")
    ap.add_argument("--text", action="store_true", help="(b) on input-grounded chat prompts (a real tokenizer)")
    ap.add_argument("--lengths", default="128,512,1024")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--windows", default="16,64,256")
    ap.add_argument("--accept-length", type=int, default=512)
    ap.add_argument("--accept-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tables", default="a,b", help="which tables to measure")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.target:
            target, small, near = args.target, args.timing_draft or args.draft, args.draft
        else:
            target, small, near = tiny_models(Path(tmp))
        if "a" in args.tables:
            print_catch_up_cost(target, small, args)
        if "b" in args.tables:
            print_acceptance(target, near, args)


if __name__ == "__main__":
    main()
