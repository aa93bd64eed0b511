"""LoRA's cost (issue 50 must-show 4): output tok/s with 8 adapters mixed in one batch vs the base model alone, in one
run.

    python -m bench.engine.lora [--tiny] [--batch 16] [--max-tokens 64] [--rank 16] [--adapters 8]
                                [--lora-dtype auto|bfloat16|float16] [--lora-ops kernel|torch] [--waves 3] [--profile]
    make bench-lora [TINY=1] [LORA_DTYPE=bfloat16]

SmolLM2-135M-Instruct as a Hugging Face directory (bench/hf_model.py; ``--tiny``: the tiny random Llama), fp32, on
the engine's default kernels. ``--adapters`` adapters written by peft on it (rank ``--rank``, every attention and MLP
projection, random weights; built once under .cache/bench/lora-adapters), ``max_lora_rank`` = ``--rank``. Two fresh
engines, the same ``--batch`` random-token prompts of 32 tokens, greedy, ``--max-tokens`` each: the base engine (no
LoRA slots) with every request on the base model, then an engine holding every adapter with request i on adapter
i mod ``--adapters``. Each engine runs a warm-up wave, then ``--waves`` measured ones; reported: each side's median
output tok/s (output tokens / wall seconds of a wave). Last line: ``ratio: <LoRA tok/s / base tok/s>``; goal (issue
50): >= 0.9. ``--lora-ops torch`` runs the adapters on engine/lora/ops.py's torch forms instead of the kernel
backend's ``lora_add`` (the path before the kernels); ``--profile`` adds one wave per engine timed by part
(``profile_parts``).

Where the time went before the kernels (``python -m bench.engine.lora --profile --lora-ops torch``, 2026-11-28 21:01
UTC, the 2-vCPU Intel Xeon dev VM, bench lock held, at 4ee8794): base 178.8, LoRA 127.0 output tok/s, ratio 0.710; in
the profiled wave the decode steps' forwards took 4.91 s (base) and 7.35 s (LoRA), of which the projections 3.21 and
5.74 s and the adapters' delta (the masked torch form: two GEMMs and a multiply per projection over every slot)
2.50 s; prefill 0.33 against 0.47 s. So the whole gap was the delta's GEMMs: the masked form computes all 8 slots
for every token (at decode about 0.55x the base's multiply-adds per layer). Not the lost CPU recordings: an fp32
model's projections are oneDNN GEMMs, torch operators a recording cannot hold, so the base decodes eagerly too
("decode recordings off" on both sides; engine/model_runner.py ``_cpu_graph_refusal``). Not the Python per
projection either: with the kernel swapped for a no-op a wave took the base's time (3.81 s vs 3.85 s, a one-off
check, 2026-11-28). Recordings matter for
packed (GGUF / GPTQ) bases, where they stay on with LoRA now (tests/engine/lora/test_lora_recorded.py).

With the C kernel (kernels/cpu/lora.c, SGMV: each adapter's A and B read once per call, only the diagonal blocks of
a fused B), same machine, 2026-11-28 21:01-21:10 UTC, bench lock held, at 4ee8794, ``python -m bench.engine.lora``
(what ``make bench-lora`` runs):
- fp32 slots (``--lora-dtype auto``), four runs: ratio 0.865, 0.793, 0.887, 0.828 (base 193.9-226.5, LoRA
  167.6-190.4 tok/s); the profiled wave: decode forwards 4.62 s (base) and 5.56 s (LoRA), the delta 0.92 s of it;
- bf16 slots (``--lora-dtype bfloat16``, the adapters rounded to bf16 once), three runs: 0.898, 0.858, 0.850.
Short of the 0.9 goal, by a margin the VM's run-to-run noise (base 179-227 tok/s over the same 10 minutes) blurs.
What is left is bandwidth: a decode step of 16 tokens on 8 adapters reads every adapter's weights once (156 MB fp32,
78 MB bf16) right after the base's GEMMs have streamed ~425 MB past them, i.e. from memory; between those GEMMs the
kernel adds 11.7 ms (fp32) / 10.1 ms (bf16) to a 39 ms step of GEMMs (``python -m bench.kernels.lora_cpu``, same
session): 13 GB/s fp32, but only 8 GB/s in bf16 (not bandwidth-bound there yet), against the 23.6 GB/s plain reads
of both cores (kernels/cpu_quant_isa.py).

The figures this docstring held before the kernels (the torch forms, one measured wave each): grouped form only
0.557, masked form for steps of <= 64 tokens 0.693; with max_lora_rank 64 for rank-16 adapters the padding cost 4x
(0.389 grouped, 0.407 masked), which the kernels still pay (an adapter of rank r < R costs rank R).
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

    out = {}
    only = "" if set(targets) == set(TARGETS) else "-" + "+".join(sorted(targets))
    for i in range(n):
        d = ADAPTER_DIR / f"{model.name}-r{rank}{only}-{i}"
        if not (d / "adapter_model.safetensors").exists():
            torch.manual_seed(i)
            base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
            pm = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                                           init_lora_weights=False))
            with torch.no_grad():
                for name, p in pm.named_parameters():
                    if "lora_" in name:
                        p.normal_(0.0, 0.02)
            pm.save_pretrained(d)
        out[f"adapter-{i}"] = str(d)
    return out


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
          f"{args.rank} on {args.targets} (max_lora_rank {args.max_lora_rank or args.rank}), lora_dtype {args.lora_dtype}, {args.waves} rounds of a wave each, "
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
