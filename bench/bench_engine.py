"""make bench-engine: duet's engine vs transformers ``generate`` (static batches), same model, same requests.

The model is the default one, SmolLM2-135M-Instruct (its GGUF file, dequantized to float32 by both sides:
transformers loads the same file), or ``--model PATH`` (HF directory or GGUF), or ``--tiny`` (a generated
4-layer random Llama, the workload of the first measurements). 64 requests with mixed prompt lengths
(16–512 tokens) and output lengths (16–128 tokens), greedy, EOS ignored so both produce exactly the
requested tokens. duet gets all 64 at once (continuous batching,
chunked prefill, paged KV); transformers runs them in static, left-padded batches of ``--hf-batch`` and
each batch generates until its longest request is done (the usual way to serve with ``generate``).
Reported: useful output tokens per second of each, and ``ratio: <duet/transformers>`` as the last line.

The VM this runs on has noisy neighbours (±50 % between runs), so the two are timed alternately
``--repeats`` times and each side's best run is compared (duet builds a fresh engine per run, so no run
profits from an earlier run's prefix cache).
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import time

import torch


def workload(n: int, vocab: int, seed: int = 0, small: bool = False):
    rng = random.Random(seed)
    max_prompt, max_out = (64, 16) if small else (512, 128)
    reqs = []
    for _ in range(n):
        p_len = rng.randint(16, max_prompt)
        o_len = rng.randint(min(16, max_out), max_out)
        reqs.append(([rng.randrange(3, vocab) for _ in range(p_len)], o_len))
    return reqs


def bench_duet(model_dir: str, reqs, block_size: int) -> tuple[float, int]:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    engine = Engine(EngineConfig(model=model_dir, block_size=block_size, max_num_seqs=64,
                                 max_num_batched_tokens=2048, kv_cache_bytes=1 << 30,
                                 enable_prefix_caching=False))  # random prompts share nothing anyway
    engine.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    t0 = time.perf_counter()
    res = engine.generate([p for p, _ in reqs],
                          [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in reqs])
    elapsed = time.perf_counter() - t0
    n_out = sum(len(r["token_ids"]) for r in res)
    assert n_out == sum(o for _, o in reqs)
    return elapsed, n_out


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="HF checkpoint dir or GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tiny", action="store_true", help="a generated tiny random Llama instead")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--small", action="store_true", help="a quick run (short prompts and outputs)")
    ap.add_argument("--repeats", type=int, default=2, help="alternating timed runs of each; best is kept")
    args = ap.parse_args()
    model_dir = args.model
    if model_dir is None and not args.tiny:
        from engine.default_model import default_model_path

        model_dir = str(default_model_path())
    if args.tiny:
        from engine.tiny import make_tiny_model

        model_dir = str(make_tiny_model(tempfile.mkdtemp(prefix="duet-bench-"), arch="llama", hidden_size=256,
                                        num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=688,
                                        vocab_size=2048, max_position_embeddings=2048))
    from engine.config import ModelConfig

    vocab = ModelConfig.from_checkpoint(model_dir).vocab_size
    reqs = workload(args.num_requests, vocab, small=args.small)
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, torch threads "
          f"{torch.get_num_threads()}, {os.cpu_count()} cpus")
    print(f"model: {model_dir}")
    print(f"workload: {len(reqs)} requests, prompt tokens {sum(len(p) for p, _ in reqs)}, "
          f"output tokens {sum(o for _, o in reqs)}")
    hf_model = load_hf(model_dir)
    runs_duet, runs_hf = [], []
    for _ in range(args.repeats):
        runs_duet.append(bench_duet(model_dir, reqs, args.block_size))
        runs_hf.append(bench_hf(hf_model, reqs, args.hf_batch))
        print(f"  run: duet {runs_duet[-1][0]:.2f} s, transformers {runs_hf[-1][0]:.2f} s", flush=True)
    t_duet, n_duet = min(runs_duet)
    t_hf, n_hf = min(runs_hf)
    duet_tps, hf_tps = n_duet / t_duet, n_hf / t_hf
    print(f"duet engine:              {n_duet} tokens in {t_duet:.2f} s = {duet_tps:.1f} output tok/s")
    print(f"transformers (batch {args.hf_batch:>3}): {n_hf} tokens in {t_hf:.2f} s = {hf_tps:.1f} output tok/s")
    print(f"ratio: {duet_tps / hf_tps:.2f}")


if __name__ == "__main__":
    main()
