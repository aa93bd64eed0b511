"""Mixture-of-experts speed: the engine's grouped expert GEMMs (engine/models/moe.py) against a per-token loop over each
token's experts — the way MoE is written when it is written naively — on the same tiny Qwen3-MoE checkpoint
that transformers builds, through the whole engine (offline generation, greedy), both measured in this run.

    python -m bench.engine.moe [--experts 16 --top-k 4 --layers 4 --hidden 256 --prompts 8 --prompt-len 256]
    make bench-moe

Also checks that both paths give the same tokens (else the figure means nothing). Prints tok/s for the
prefill-heavy and the decode phase of each, and ``ratio:`` grouped / per-token loop, end to end.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from engine.models import moe


def per_token_loop(x, weights, ids, experts, ops, counts_out=None):
    """The naive MoE: for every token, for each of its experts, two GEMVs."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = ops.linear(x[t:t + 1], experts.gate_up_proj[e], None).split([experts.inter] * 2, dim=-1)
            y = ops.linear(torch.nn.functional.silu(gate) * up, experts.down_proj[e], None)
            out[t] += (y[0] * weights[t, j]).to(x.dtype)
        if counts_out is not None:
            counts_out += torch.bincount(ids[t], minlength=counts_out.numel())
    return out


def build(args, out: Path) -> Path:
    import transformers

    from engine.loading.tiny import make_tiny_model
    from tests.engine.loading.hf_saved import save_with_transformers  # the same random checkpoint the parity tests use

    tok_dir = make_tiny_model(out / "tok", arch="llama")
    cfg = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=args.hidden // 4, max_position_embeddings=4096,
                                      num_experts=args.experts, num_experts_per_tok=args.top_k,
                                      moe_intermediate_size=args.hidden, norm_topk_prob=True)
    return save_with_transformers(out / "moe", cfg, tok_dir)


def run(model_dir: Path, args) -> tuple[list, dict]:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    engine = Engine(EngineConfig(model=str(model_dir), num_blocks=1024, max_num_seqs=args.prompts,
                                 max_num_batched_tokens=args.prompts * args.prompt_len))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = engine.generate([p[::-1] for p in prompts], SamplingParams(max_tokens=args.new_tokens, temperature=0,
                                                                    ignore_eos=True))
    total_s = time.perf_counter() - t0
    engine.close()
    n_new = args.prompts * args.new_tokens
    return [r["token_ids"] for r in res], {"prefill_tok_s": args.prompts * args.prompt_len / prefill_s,
                                           "generate_tok_s": n_new / total_s, "generate_s": total_s}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    print(f"tiny Qwen3-MoE: hidden {args.hidden}, {args.layers} layers, {args.experts} experts top {args.top_k}; "
          f"{args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new; torch threads "
          f"{torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(args, Path(tmp))
        grouped_tokens, grouped = run(model_dir, args)
        original = moe.grouped_experts
        moe.grouped_experts = per_token_loop
        try:
            loop_tokens, loop = run(model_dir, args)
        finally:
            moe.grouped_experts = original
    assert grouped_tokens == loop_tokens, "the two MoE paths gave different tokens"
    for name, r in (("grouped (engine/models/moe.py)", grouped), ("per-token loop", loop)):
        print(f"{name:24s} prefill {r['prefill_tok_s']:9.0f} tok/s   prefill+decode {r['generate_tok_s']:7.1f} "
              f"new tok/s ({r['generate_s']:.2f} s)")
    print(f"prefill: grouped / per-token loop {grouped['prefill_tok_s'] / loop['prefill_tok_s']:.1f}x")
    print(f"ratio: {loop['generate_s'] / grouped['generate_s']:.2f} (grouped expert GEMMs vs a per-token loop, "
          "end to end: prefill + decode of the batch, same tokens)")


if __name__ == "__main__":
    main()
