"""make bench-decode: decode speed of the engine on the real model, and the fraction of the machine's memory
bandwidth it reaches.

Decode is bound by memory: every step reads every weight once and each sequence's K/V, for one new token per
sequence. So the figure of merit is bytes read per second against what the memory can deliver, measured in the
same run: the best of a few large device-to-device copies (``copy_`` of a 512 MB tensor on CUDA, 256 MB on a CPU;
a copy reads and writes every byte, so its bandwidth counts both).

Per batch size (``--batches``, default 1 8 32 64 sequences, each with a ``--context``-token prompt, default 512), the
engine prefills, then runs ``--steps`` decode-only steps; reported: decode tokens per second, ms per step and the
bandwidth fraction = (weight bytes + the K/V bytes each step's attention reads) / step time / copy bandwidth.
Weight bytes are every projection's stored weight (dense, packed or int8 + scales) and the LM head; the
embedding rows a step looks up and activations are left out, so the fraction is a lower bound.

Baseline, timed in the same run on the same engine settings: on CUDA, the same engine without CUDA graphs
(``cuda_graph_max_batch=0``: every decode kernel launched from Python); on a CPU (no graphs), the torch
reference kernels (``kernels=torch``, quantized weights dequantized at load). A GGUF model on a CPU also runs two more sides: its quantized weights
dequantized at load (``quantized_weights=dense``: fp32, what duet did before issue 48) and packed with int8
activations (``quantized_activations=int8``, llama.cpp's scheme); the packed side's speed over the dense one is
printed. Last line: ``ratio: <duet / baseline decode tok/s>`` at the largest batch.

``--kv-cache-dtype int8`` (issue 49) runs two sides instead, in one run: duet with the model-dtype KV cache and duet
with that KV dtype (1-byte values + scales, engine/kv/cache_dtype.py); the last line is then
``ratio: <quantized KV / model-dtype KV decode tok/s>`` at the largest batch.

    python -m bench.engine.decode [--device cuda] [--dtype bfloat16] [--model PATH] [--tiny] [--kv-cache-dtype int8]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from engine.loading.checkpoint import load_model_config


def copy_bandwidth(device: str, nbytes: int, reps: int = 5) -> float:
    """Bytes per second of the best ``dst.copy_(src)`` (each byte read once and written once)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps + 1):  # the first one warms up (page faults, clocks)
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def weight_bytes(model) -> int:
    """Bytes of every projection's stored weight and the LM head: what each decode step reads in full."""
    from engine.models.layers import Linear

    total = 0
    for m in model.modules():
        if isinstance(m, Linear) and m.quant is not None:  # a GGUF weight kept in its blocks (a tied head too)
            total += m.quant.num_bytes
        elif isinstance(m, Linear):
            for t in (m.packed, m.qweight, m.scales, m.weight, m.bias):
                if t is not None and (t is not m.weight or m.packed is None):  # a tied head keeps its table
                    total += t.numel() * t.element_size()
    return total


def kv_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8  # model-dtype KV


def run_decode(engine, batch: int, context: int, steps: int, vocab: int, compiled: list[str]) -> dict:
    """Prefill ``batch`` prompts of ``context`` tokens, then time ``steps`` decode-only steps; ``compiled`` collects
    Triton's compiles (kernels._triton_utils.compiles_recorded), to tell which happened while timed."""
    from engine.request import SamplingParams

    g = torch.Generator().manual_seed(batch)
    # Long enough that no sequence ends inside the timed steps (the first prompts decode while the last ones still
    # prefill): a batch that shrank there would time smaller batches, and on CUDA the capture of their graphs
    # (seen on an H200: a 0.4-1.2 s Triton compile inside "batch 32"). What is left is aborted after timing.
    # A prompt as long as the step budget takes two steps (decode tokens share the budget): up to 2 per prompt.
    max_tokens = steps + 2 + engine.config.max_num_seqs * (context // engine.config.max_num_batched_tokens + 1)
    request_ids = []
    for _i in range(batch):
        prompt = torch.randint(3, vocab, (context,), generator=g).tolist()
        request_ids.append(engine.add_request(prompt_token_ids=prompt, params=SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True)).request_id)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    engine.step()  # the first decode-only step of this batch size
    if len(engine.scheduler.running) != batch or engine.scheduler.waiting:
        raise SystemExit(f"only {len(engine.scheduler.running)} of {batch} sequences fit in the KV cache")
    device = engine.config.device
    _sync(device)
    t0 = time.perf_counter()
    step_ends = []
    compiles_before = len(compiled)
    for _ in range(steps):
        engine.step()  # returns after the step's tokens reached the host: a step's time is wall time
        step_ends.append(time.perf_counter())
    _sync(device)
    elapsed = time.perf_counter() - t0
    if len(engine.scheduler.running) != batch:
        raise SystemExit(f"the batch changed to {len(engine.scheduler.running)} sequences while timed")
    step_ms = sorted(1e3 * (b - a) for a, b in zip([t0, *step_ends], step_ends))
    for request_id in request_ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": batch, "seconds": elapsed, "tokens": batch * steps,
            "step_ms_median": step_ms[len(step_ms) // 2], "step_ms_max": step_ms[-1],
            "compiles_in_timed_steps": compiled[compiles_before:],
            "mean_context": context + 2 + (steps - 1) / 2}  # the prompt, the tokens before, half of the timed


def measure(engine, batches, context, steps, bandwidth, compiled: list[str]) -> list[dict]:
    cfg, runner = engine.model_config, engine.runner
    w_bytes = weight_bytes(runner.model)
    kv_tok = runner.bytes_per_block / engine.config.block_size  # values (+ scales, a quantized KV cache)
    rows = []
    for b in batches:
        r = run_decode(engine, b, context, steps, cfg.vocab_size, compiled)
        step_s = r["seconds"] / steps
        bytes_per_step = w_bytes + b * r["mean_context"] * kv_tok
        rows.append({**r, "tok_s": r["tokens"] / r["seconds"], "ms_per_step": 1e3 * step_s,
                     "bandwidth_fraction": bytes_per_step / step_s / bandwidth})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="HF checkpoint dir or GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tiny", action="store_true", help="a generated tiny random Llama instead")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--kv-cache-dtype", choices=["int8", "fp8_e4m3", "fp8_e5m2"],
                    help="time duet with this KV cache dtype against duet with the model-dtype one (those two only)")
    args = ap.parse_args()

    from engine.config import EngineConfig
    from engine.engine import Engine
    from kernels._triton_utils import compiles_recorded

    if args.tiny:
        import tempfile

        from engine.loading.tiny import make_tiny_model
        model = str(make_tiny_model(tempfile.mkdtemp(prefix="duet-bench-decode-"), arch="llama"))
    else:
        from engine.loading.default_model import default_model_path
        model = args.model or str(default_model_path())
    on_cuda = args.device.startswith("cuda")
    bandwidth = copy_bandwidth(args.device, (512 if on_cuda else 256) << 20)
    from engine.loading.weights import resolve_dtype

    mcfg = load_model_config(model)
    tokens = max(args.batches) * (args.context + args.steps + 2 * 16)  # + a partial block per sequence
    kv_bytes = int(1.1 * tokens * kv_bytes_per_token(mcfg, resolve_dtype(args.dtype, mcfg, args.device)))
    base = dict(model=model, device=args.device, dtype=args.dtype, max_num_seqs=max(args.batches),
                max_num_batched_tokens=max(2048, args.context), kv_cache_bytes=kv_bytes, enable_prefix_caching=False)
    sides = {"duet": EngineConfig(**base)}
    gguf_on_cpu = not on_cuda and str(model).endswith(".gguf") and not args.kv_cache_dtype
    if args.kv_cache_dtype:
        sides[f"duet, {args.kv_cache_dtype} KV"] = EngineConfig(**base, kv_cache_dtype=args.kv_cache_dtype)
    if gguf_on_cpu:  # issue 48: packed weights against the same weights dequantized, same run
        sides["duet, int8 activations"] = EngineConfig(**base, quantized_activations="int8")
        sides["duet, weights dequantized (fp32)"] = EngineConfig(**base, quantized_weights="dense")
    baseline = "eager (no CUDA graphs)" if on_cuda else "torch reference kernels"
    if not args.kv_cache_dtype:
        sides[baseline] = (EngineConfig(**base, cuda_graph_max_batch=0) if on_cuda else  # the references on dense
                           EngineConfig(**base, kernels="torch", quantized_weights="dense"))  # weights, before 48
    dev_name = torch.cuda.get_device_name() if on_cuda else platform.processor() or platform.machine()
    print(f"model {model}; device {args.device} ({dev_name}); copy bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"context {args.context}; {args.steps} timed steps per batch size")
    results = {}
    for name, ecfg in sides.items():
        engine = Engine(ecfg)
        t0 = time.perf_counter()
        captured = engine.capture_decode_graphs()  # as a decode worker does at start-up
        if captured:
            print(f"{name}: {captured} decode graphs captured up front in {time.perf_counter() - t0:.2f} s")
        with compiles_recorded() as compiled:
            rows = measure(engine, args.batches, args.context, args.steps, bandwidth, compiled)
        results[name] = rows
        graphs = engine.runner.decode_graphs
        extra = f"; graphs captured {sorted(graphs.graphs)}, replays {graphs.replays}" if graphs else ""
        print(f"{name}: backend {engine.runner.backend}, dtype {engine.runner.dtype}, "
              f"weights {weight_bytes(engine.runner.model) / 1e6:.1f} MB{extra}")
        for r in rows:
            print(f"  batch {r['batch']:>4}: {r['tok_s']:9.1f} tok/s  {r['ms_per_step']:8.2f} ms/step  "
                  f"{100 * r['bandwidth_fraction']:5.1f} % of copy bandwidth  (step median {r['step_ms_median']:.2f}, "
                  f"max {r['step_ms_max']:.2f} ms)" + (f"; Triton compiles while timed: {r['compiles_in_timed_steps']}"
                                                      if r["compiles_in_timed_steps"] else ""))
        del engine
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev_name, "copy_bandwidth": bandwidth, "results": results}, f, indent=1)
    if gguf_on_cpu:
        for name in ("duet", "duet, int8 activations"):
            speed = [f"batch {a['batch']} {a['tok_s'] / b['tok_s']:.2f}x"
                     for a, b in zip(results[name], results["duet, weights dequantized (fp32)"])]
            print(f"{name} / weights dequantized: {', '.join(speed)}")
    if args.kv_cache_dtype:
        ours, theirs = results[f"duet, {args.kv_cache_dtype} KV"][-1], results["duet"][-1]
        print(f"ratio: {ours['tok_s'] / theirs['tok_s']:.2f} ({args.kv_cache_dtype} KV / model-dtype KV, decode tok/s "
              f"at batch {ours['batch']}, context {args.context})")
        return
    ours, theirs = results["duet"][-1], results[baseline][-1]
    print(f"ratio: {ours['tok_s'] / theirs['tok_s']:.2f} (duet / {baseline}, decode tok/s at batch {ours['batch']})")


if __name__ == "__main__":
    main()
