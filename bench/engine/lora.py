"""LoRA's cost (issue 50 must-show 4): output tok/s with 8 adapters mixed in one batch vs the base model alone, in one
run.

    python -m bench.engine.lora [--tiny] [--batch 16] [--max-tokens 64] [--rank 16] [--adapters 8]
    make bench-lora [TINY=1]

SmolLM2-135M-Instruct as a Hugging Face directory (bench/hf_model.py; ``--tiny``: the tiny random Llama), fp32, on
the engine's default kernels. ``--adapters`` adapters written by peft on it (rank ``--rank``, every attention and MLP
projection, random weights; built once under .cache/bench/lora-adapters), ``max_lora_rank`` = ``--rank``. Two fresh
engines, the same ``--batch``
random-token prompts of 32 tokens, greedy, ``--max-tokens`` each, after one warm-up wave: the base engine (no LoRA
slots) with every request on the base model, then an engine holding every adapter with request i on adapter
i mod ``--adapters``. Reported: each side's output tok/s (output tokens / wall seconds of the measured wave).
Last line: ``ratio: <LoRA tok/s / base tok/s>``; goal (issue 50): >= 0.9.

Measured on the 2-core dev VM (bench lock held, ``make bench-lora``'s defaults: batch 16, 64 tokens, 8 adapters of
rank 16, max_lora_rank 16), with the torch shrink / expand of engine/lora/ops.py:
- grouped form only (two GEMMs per adapter per projection): base 260.4, LoRA 145.1 output tok/s, ratio 0.557;
- masked form for steps of <= 64 tokens (decode), grouped for longer ones: base 239.9, LoRA 166.3, ratio 0.693.
(With max_lora_rank 64 for rank-16 adapters, the padding cost 4x: ratio 0.389 grouped, 0.407 masked.) Short of the
0.9 goal: batched C / Triton kernels are still to come.
"""
from __future__ import annotations

import argparse
import contextlib
import random
import time
from collections import defaultdict
from pathlib import Path

ADAPTER_DIR = Path(".cache/bench/lora-adapters")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def ensure_adapters(model: Path, n: int, rank: int) -> dict[str, str]:
    import peft
    import torch
    import transformers

    out = {}
    for i in range(n):
        d = ADAPTER_DIR / f"{model.name}-r{rank}-{i}"
        if not (d / "adapter_model.safetensors").exists():
            torch.manual_seed(i)
            base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
            pm = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS),
                                                           init_lora_weights=False))
            with torch.no_grad():
                for name, p in pm.named_parameters():
                    if "lora_" in name:
                        p.normal_(0.0, 0.02)
            pm.save_pretrained(d)
        out[f"adapter-{i}"] = str(d)
    return out


def measure(model: Path, prompts, loras, lora_modules, args) -> tuple[float, dict[str, float] | None]:
    """The median output tok/s over ``args.waves`` waves after a warm-up one; with ``args.profile`` also the last
    wave's seconds by part (``profile_parts``)."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    engine = Engine(EngineConfig(model=str(model), max_num_seqs=len(prompts), lora_modules=lora_modules,
                                 max_lora_rank=args.rank, lora_dtype=args.lora_dtype))
    if args.lora_ops == "torch" and engine.runner.lora is not None:  # the torch forms, as before the kernels
        engine.runner.lora.kernel = None

    def wave() -> float:
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, lora=lo) for lo in loras]
        t0 = time.perf_counter()
        res = engine.generate(prompts, params)
        return sum(len(r["token_ids"]) for r in res) / (time.perf_counter() - t0)

    wave()  # warm-up
    rates = sorted(wave() for _ in range(args.waves))
    parts = None
    if args.profile:
        with profile_parts(engine) as parts:
            wave()
    engine.close()
    return rates[len(rates) // 2], parts


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
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--lora-dtype", default="auto", help="EngineConfig.lora_dtype (auto: the model's, fp32)")
    ap.add_argument("--lora-ops", choices=("kernel", "torch"), default="kernel",
                    help="the adapters' delta by the kernel backend's lora_add, or engine/lora/ops.py's torch forms")
    ap.add_argument("--waves", type=int, default=3, help="measured waves per engine (the median is reported)")
    ap.add_argument("--profile", action="store_true", help="one more wave per engine, timed by part")
    args = ap.parse_args()
    if args.tiny:
        from engine.loading.tiny import make_tiny_model
        model = make_tiny_model(Path(".cache/bench/tiny-llama-lora"))
    else:
        from bench.hf_model import ensure_hf_model
        model = ensure_hf_model()
    adapters = ensure_adapters(model, args.adapters, args.rank)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(32)] for _ in range(args.batch)]
    names = sorted(adapters)
    base, base_parts = measure(model, prompts, [None] * args.batch, None, args)
    lora, lora_parts = measure(model, prompts, [names[i % len(names)] for i in range(args.batch)], adapters, args)
    print(f"model {model.name}, batch {args.batch}, {args.max_tokens} tokens each, {len(names)} adapters of rank "
          f"{args.rank}, lora_dtype {args.lora_dtype}, LoRA ops {args.lora_ops}, median of {args.waves} waves")
    for name, parts in (("base", base_parts), ("lora", lora_parts)):
        if parts is not None:
            recorded = "on" if parts.pop("decode recordings") else "off"
            print(f"{name} profile (s): " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(parts.items()))
                  + f"; decode recordings {recorded}")
    print(f"base: {base:.1f} output tok/s")
    print(f"lora: {lora:.1f} output tok/s")
    print(f"ratio: {lora / base:.3f}")


if __name__ == "__main__":
    main()
