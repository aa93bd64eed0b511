"""duet's side of the engine rows, in process through its own engine API (as bench/engine/decode.py), on the
GGUF file as it is (weights kept packed), one engine per ``quantized_activations`` mode, its decode recordings
captured at start as a decode worker's (engine/decode_graphs.py):

- batch-1 decode: one random 1-token prompt, then 128 decode steps timed (``bench.engine.decode.run_decode``,
  batch 1): what ``llama-bench -p 0 -n 128`` times (128 tokens from an empty context); duet's steps include
  scheduling and sampling, llama-bench times ``llama_decode`` only.
- prefill: one random 512-token prompt asking for one token, timed from ``add_request`` to the step that ends
  its prefill (one step: ``max_num_batched_tokens`` >= 512): what ``llama-bench -p 512 -n 0`` times.

Prefix caching is off and each timing gets fresh random token ids, so no run reuses another's KV.
``resident_weight_bytes``: what the engine keeps of the weights (packed blocks of every packed parameter, once
for a table shared with a tied head, plus every dense parameter and dense packed GEMM weight), against the
file's tensor bytes for must-show 2.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

DECODE_TOKENS = 128
PREFILL_TOKENS = 512


def make_engine(model: Path, activations: str, threads: int):
    """An engine on ``model`` with packed weights and ``activations`` (fp32 | int8), on ``threads`` threads."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.loading.checkpoint import load_model_config
    from engine.loading.weights import resolve_dtype

    torch.set_num_threads(threads)
    mcfg = load_model_config(str(model))
    dtype = resolve_dtype("auto", mcfg, "cpu")
    kv_token_bytes = mcfg.num_layers * 2 * mcfg.num_kv_heads * mcfg.head_dim * torch.finfo(dtype).bits // 8
    tokens = 2 * (PREFILL_TOKENS + DECODE_TOKENS + 64)
    engine = Engine(EngineConfig(model=str(model), device="cpu", quantized_weights="auto",
                                 quantized_activations=activations, max_num_seqs=4, max_num_batched_tokens=1024,
                                 kv_cache_bytes=tokens * kv_token_bytes, enable_prefix_caching=False))
    engine.capture_decode_graphs()  # as a decode worker does at start-up (a CPU: recordings of the C calls)
    return engine


def decode_tok_s(engine, seed: int) -> float:
    """Batch-1 decode tokens per second over DECODE_TOKENS steps after a 1-token prompt (``seed`` unused: the
    prompt is run_decode's own, one random token; without prefix caching nothing carries over between runs)."""
    from bench.engine.decode import run_decode

    r = run_decode(engine, 1, 1, DECODE_TOKENS, engine.model_config.vocab_size, [])
    return r["tokens"] / r["seconds"]


def prefill_tok_s(engine, seed: int) -> float:
    """Prompt tokens per second of one PREFILL_TOKENS-token prefill (random ids)."""
    from engine.request import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, engine.model_config.vocab_size, (PREFILL_TOKENS,), generator=g).tolist()
    t0 = time.perf_counter()
    req = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=1, temperature=0))
    steps, done = 0, False
    while not done:  # until the step that emits its one token: the one that ends the prefill
        if steps == 8:
            raise RuntimeError(f"the {PREFILL_TOKENS}-token prompt emitted no token in {steps} steps")
        done = any(out.request_id == req.request_id for out in engine.step())
        steps += 1
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    if steps != 1:
        raise RuntimeError(f"the {PREFILL_TOKENS}-token prefill took {steps} steps, not one")
    return PREFILL_TOKENS / elapsed


@dataclass(frozen=True)
class ResidentWeights:
    packed_bytes: int  # blocks of the parameters kept packed (a tied head's table counted once)
    dense_bytes: int  # parameters and dense packed GEMM weights
    packed_formats: dict[str, int]  # block type -> parameters kept packed in it

    @property
    def total_bytes(self) -> int:
        return self.packed_bytes + self.dense_bytes


def resident_weight_bytes(model) -> ResidentWeights:
    """What ``model`` (a CausalLM) keeps of its weights."""
    from engine.models.layers import Linear

    packed: dict[int, object] = {}
    for m in model.modules():
        q = getattr(m, "quant", None)
        if q is not None:
            packed[id(q)] = q
    if getattr(model, "embed_quant", None) is not None:
        packed[id(model.embed_quant)] = model.embed_quant
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    dense += sum(m.packed.numel() * m.packed.element_size() for m in model.modules()
                 if isinstance(m, Linear) and m.packed is not None)
    formats: dict[str, int] = {}
    for q in packed.values():
        formats[q.fmt] = formats.get(q.fmt, 0) + 1
    return ResidentWeights(sum(q.num_bytes for q in packed.values()), dense, formats)
