"""LoRA's cost (issue 50 must-show 4): output tok/s with 8 adapters mixed in one batch vs the base model alone, in one
run.

    python -m bench.engine.lora [--tiny | --llama-1b] [--batch 16] [--max-tokens 64] [--rank 16] [--adapters 8]
                                [--max-lora-rank R] [--targets q_proj,v_proj,...]
                                [--lora-dtype auto|bfloat16|float16] [--waves 6] [--profile]
    make bench-lora [TINY=1] [LORA_DTYPE=bfloat16]

SmolLM2-135M-Instruct as a Hugging Face directory (bench/hf_model.py; ``--tiny``: the tiny random Llama;
``--llama-1b``: random weights in Llama-3.2-1B's layers, hidden 2048, 16 layers, 32 / 8 heads, MLP 8192, with a 32,000
token vocabulary, built once under .cache/bench), fp32, on the engine's default kernels. ``--adapters`` adapters
written by peft on it (rank ``--rank``, on ``--targets``: every attention and MLP projection by default; random
weights; built once under .cache/bench/lora-adapters), ``max_lora_rank`` = ``--max-lora-rank`` (default ``--rank``).
Two engines in one process, the same ``--batch`` random-token prompts of 32 tokens, greedy, ``--max-tokens`` each: the
base engine (no LoRA slots) with every request on the base model, and an engine holding every adapter with request i
on adapter i mod ``--adapters``. A warm-up wave each, then ``--waves`` rounds of one wave per engine, the order
alternating (base first, then LoRA first), so the VM's drifting speed falls on both alike. Reported: each round's
ratio, each side's median output tok/s (output tokens / wall seconds of a wave); last line ``ratio: <median of the
rounds' LoRA / base>``; goal (issue 50): >= 0.9. ``--profile`` adds one wave per engine timed by part
(``profile_parts``).

Measured (the 2-vCPU Intel Xeon dev VM, AVX-512, 2 threads, GLIBC hugepages as ``make`` sets them, nothing else
running), 2026-11-28 22:57-23:06 UTC, at 997f34a (the slots packed per adapter, kernels/cpu/lora.c):
- fp32 slots (``--lora-dtype auto``, what ``make bench-lora`` runs), two runs: **0.840** (rounds 0.833-0.889; base
  218.3, LoRA 184.8 tok/s) and **0.852** (0.807-0.885; 247.2 / 210.9);
- bf16 slots (``LORA_DTYPE=bfloat16``, the adapters rounded to bf16 once, widened exactly in the kernel), two
  runs: **0.897** (0.864-0.923; 250.4 / 228.5) and **0.901** (0.867-0.932; 229.2 / 207.8);
- rank-8 adapters in a rank-16 pool (``--rank 8 --max-lora-rank 16``, fp32): 0.879 (each slot read at its own
  rank: before the packed slots an adapter of rank r < R cost rank R);
- rank-16 adapters on q_proj and v_proj only (``--targets q_proj,v_proj``, PEFT's default for Llama, fp32): 0.948
  (nothing stored or read for the projections an adapter leaves alone).
Then with B's blocks interleaved in groups of 4 (the expand reads one stream; 23:52-23:57, at 7f1c543): fp32
**0.851** (rounds 0.823-0.872; base 207.1, LoRA 178.4) and **0.867** (0.830-0.871), bf16 0.895 (0.761-0.960).
On a model of Llama-3.2-1B's layers (``--llama-1b``, 2026-11-29 01:44-01:49 UTC, at 2a1f64b; the same 8 rank-16
adapters on all seven projections, fp32 slots): **0.943** (rounds 0.898-0.979; base 56.1, LoRA 52.4 tok/s); with
``--max-tokens 32 --waves 4`` 0.947. SmolLM2 again at that time: 0.847 (rounds 0.829-0.877; base 264.4, LoRA 224.6).
So the goal holds for bf16 slots, for adapters of typical targets and at 1B, not for fp32 slots on every projection
of the 135M model. Why:
on SmolLM2-135M (hidden 576) eight rank-16 adapters on all seven projections are 156 MB fp32, 37 % of the bytes the
base's projections read per step (425 MB), and a decode step reads them from memory; the kernel adds 10.7 ms fp32
and 5.7-8.1 ms bf16 to a 39 ms step of GEMMs (``python -m bench.kernels.lora_cpu``, 23:06), where a plain read of
the same bytes takes 6-7.5 ms (fp32) / 3.5-4.7 ms (bf16) in the same position (a C loop of vector adds, measured in
the same harness). On a model of hidden 4096 (an 8B Llama) the same eight adapters are ~5 % of the base's bytes.
``--profile`` (fp32, 23:10, ratio 0.844): in the profiled wave the LoRA engine's decode forwards took 4.91 s against
the base's 4.16 s, the adapters' calls 0.74 s of it (11.8 ms a step) and the base GEMMs about the same as alone
(3.68 - 0.74 against 2.93 s).

Before (2026-11-28 21:01-21:10 UTC, at 4ee8794, one engine after the other, 3 waves each): the torch forms (masked
over every slot) 0.710; the first C kernel (logical zero-padded slots, a shrink and an expand phase per call)
fp32 0.793-0.887, bf16 0.850-0.898. The CPU decode recordings play no part here: an fp32 model's oneDNN GEMMs are
torch operators a recording cannot hold, so both sides decode eagerly; recordings matter for packed (GGUF / GPTQ)
bases, where they stay on with LoRA (tests/engine/lora/test_lora_recorded.py).
"""
from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

ADAPTER_DIR = Path(".cache/bench/lora-adapters")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def ensure_adapters(model: Path, n: int, rank: int, targets: tuple[str, ...] = TARGETS) -> dict[str, str]:
    import peft
    import torch
    import transformers

    only = "" if set(targets) == set(TARGETS) else "-" + "+".join(sorted(targets))
    dirs = [ADAPTER_DIR / f"{model.name}-r{rank}{only}-{i}" for i in range(n)]
    missing = [i for i, d in enumerate(dirs) if not (d / "adapter_model.safetensors").exists()]
    if missing:  # the base read once: a 1B fp32 model takes a while
        base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        pm = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                                       init_lora_weights=False))
        for i in missing:
            torch.manual_seed(i)
            with torch.no_grad():
                for name, p in pm.named_parameters():
                    if "lora_" in name:
                        p.normal_(0.0, 0.02)
            pm.save_pretrained(dirs[i])
    return {f"adapter-{i}": str(d) for i, d in enumerate(dirs)}


class Side:
    """One engine of the comparison (the base alone, or the one holding the adapters) and its waves."""

    def __init__(self, model: Path, prompts, loras, lora_modules, args) -> None:
        from engine.config import EngineConfig
        from engine.engine import Engine

        self.engine = Engine(EngineConfig(model=str(model), max_num_seqs=len(prompts), lora_modules=lora_modules,
                                          max_lora_rank=args.max_lora_rank or args.rank, lora_dtype=args.lora_dtype))
        self.prompts, self.loras, self.max_tokens = prompts, loras, args.max_tokens
        self.rates: list[float] = []

    def wave(self) -> float:
        """Output tok/s of one wave: every prompt, greedy, ``max_tokens`` each."""
        from engine.request import SamplingParams

        params = [SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True, lora=lo)
                  for lo in self.loras]
        t0 = time.perf_counter()
        res = self.engine.generate(self.prompts, params)
        return sum(len(r["token_ids"]) for r in res) / (time.perf_counter() - t0)


def measure(base: Side, lora: Side, waves: int) -> list[float]:
    """A warm-up wave each, then ``waves`` rounds of one wave each, the order alternating (base first, then LoRA
    first), so a drift of the machine's speed falls on both sides alike; returns each round's LoRA / base."""
    base.wave(), lora.wave()
    ratios = []
    for i in range(waves):
        pair = (base, lora) if i % 2 == 0 else (lora, base)
        for side in pair:
            side.rates.append(side.wave())
        ratios.append(lora.rates[-1] / base.rates[-1])
    return ratios


@contextlib.contextmanager
def profile_parts(engine):
    """Seconds of one wave by part: each step's forward (``runner.execute``: prefill steps and decode-only steps
    apart), the projections' forwards within it (``Linear.forward``: the base GEMM, and the adapters' delta), and the
    adapters' delta alone (``LoraWeights.add_``); the decode steps' recordings, if any, replace the Python (and these
    hooks) by their C calls."""
    from engine.lora.pool import LoraWeights
    from engine.models.layers import Linear

    parts: dict[str, float] = defaultdict(float)
    kind = ["prefill"]
    runner, execute, linear, add = engine.runner, engine.runner.execute, Linear.forward, LoraWeights.add_

    def timed(name, fn):
        def wrapper(*a):
            t0 = time.perf_counter()
            try:
                return fn(*a)
            finally:
                parts[f"{kind[0]} {name}"] += time.perf_counter() - t0
        return wrapper

    def timed_execute(out):
        kind[0] = "prefill" if any(s.num_new_tokens > 1 for s in out.scheduled) else "decode"
        return timed("forward", execute)(out)

    runner.execute, Linear.forward, LoraWeights.add_ = timed_execute, timed("projections", linear), timed("LoRA", add)
    try:
        yield parts
    finally:
        runner.execute, Linear.forward, LoraWeights.add_ = execute, linear, add
        parts["decode recordings"] = float(runner.decode_graphs is not None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--llama-1b", action="store_true", help="random weights in Llama-3.2-1B's layers (32k vocab)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--max-lora-rank", type=int, default=None, help="the pool's (default: --rank)")
    ap.add_argument("--targets", default=",".join(TARGETS), help="the projections the adapters touch")
    ap.add_argument("--lora-dtype", default="auto", help="EngineConfig.lora_dtype (auto: the model's, fp32)")
    ap.add_argument("--waves", type=int, default=6, help="measured rounds (a wave per engine each; medians reported)")
    ap.add_argument("--profile", action="store_true", help="one more wave per engine, timed by part")
    args = ap.parse_args()
    if args.tiny:
        from engine.loading.tiny import make_tiny_model
        model = make_tiny_model(Path(".cache/bench/tiny-llama-lora"))
    elif args.llama_1b:
        from engine.loading.tiny import make_tiny_model
        model = Path(".cache/bench/llama-1b-shaped")
        if not (model / "config.json").exists():
            make_tiny_model(model, vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                            intermediate_size=8192, max_position_embeddings=4096)
    else:
        from bench.hf_model import ensure_hf_model
        model = ensure_hf_model()
    adapters = ensure_adapters(model, args.adapters, args.rank, tuple(args.targets.split(",")))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(32)] for _ in range(args.batch)]
    names = sorted(adapters)
    base = Side(model, prompts, [None] * args.batch, None, args)
    lora = Side(model, prompts, [names[i % len(names)] for i in range(args.batch)], adapters, args)
    ratios = measure(base, lora, args.waves)
    print(f"model {model.name}, batch {args.batch}, {args.max_tokens} tokens each, {len(names)} adapters of rank "
          f"{args.rank} on {args.targets} (max_lora_rank {args.max_lora_rank or args.rank}), lora_dtype "
          f"{args.lora_dtype}, {args.waves} rounds of a wave each, "
          "alternating")
    for name, side in (("base", base), ("lora", lora)):
        if args.profile:
            with profile_parts(side.engine) as parts:
                side.wave()
            recorded = "on" if parts.pop("decode recordings") else "off"
            print(f"{name} profile (s): " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(parts.items()))
                  + f"; decode recordings {recorded}")
        side.engine.close()
    print("per-round ratios: " + " ".join(f"{r:.3f}" for r in ratios))
    print(f"base: {statistics.median(base.rates):.1f} output tok/s (median)")
    print(f"lora: {statistics.median(lora.rates):.1f} output tok/s (median)")
    print(f"ratio: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
