"""LoRA kernel test cases shared by the C (test_cpu_lora.py) and Triton (test_lora.py) tests: adapter slots written
by engine/lora/pool.py's own writer (``LoraWeights.write``: a fused projection's B block-diagonal over its shards,
zero rows past an adapter's rank), and the reference results of engine/lora/ops.py."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.lora.adapter import LoraShard
from engine.lora.ops import LoraBatch, lora_add_
from engine.lora.pool import LoraWeights

# (tokens, in features, shard sizes, max rank, adapters' ranks per slot, token slots: a pattern repeated)
CASES = [
    (11, 37, (20, 9, 9), 5, (5, 3, 5), (-1, 0, 0, 2, -1, 1, 1, 1, 2, -1, 0)),  # q/k/v-like, K and N tails
    (16, 64, (48,), 16, (16, 16, 16, 16), (0, 1, 2, 3)),                       # decode: one token per adapter in turn
    (70, 40, (33, 33), 8, (8, 2), (1, 1, -1, 0, 1)),                           # gate/up-like, > 32 tokens a slot
    (5, 24, (17,), 20, (20, 20), (-1,)),                                       # every token on the base
    (9, 130, (70,), 24, (24,), (0,)),                                          # more A rows than one item (16)
]


def make_case(tokens, k, shards, max_rank, ranks, pattern, dtype=torch.float32, weight_dtype=None, seed=0):
    """(out, x, LoraWeights, scaling [slots] fp32, token_slots [T] int64): slot i holds a random adapter of rank
    ``ranks[i]`` on every shard; x and out in ``dtype``, the weights stored in ``weight_dtype`` (default: dtype)."""
    g = torch.Generator().manual_seed(seed)
    pool = SimpleNamespace(max_loras=len(ranks), max_lora_rank=max_rank)
    w = LoraWeights(pool, k, list(shards), torch.float32, "cpu")
    for slot, r in enumerate(ranks):
        parts = {i if len(shards) > 1 else None: LoraShard(a=torch.randn(r, k, generator=g) / k ** 0.5,
                                                           b=torch.randn(size, r, generator=g))
                 for i, size in enumerate(shards)}
        w.write(slot, parts)
    w.a, w.bt = w.a.to(weight_dtype or dtype), w.bt.to(weight_dtype or dtype)
    scaling = torch.rand(len(ranks), generator=g) + 0.5
    token_slots = torch.tensor([pattern[i % len(pattern)] for i in range(tokens)], dtype=torch.int64)
    x = torch.randn(tokens, k, generator=g).to(dtype)
    out = torch.randn(tokens, sum(shards), generator=g).to(dtype)
    return out, x, w, scaling, token_slots


def reference(out, x, w, scaling, token_slots, masked: bool = False):
    """engine/lora/ops.py's torch forms in fp32 (grouped, or masked over every slot where the engine masks: steps
    of at most MASKED_MAX_TOKENS tokens)."""
    slots = token_slots.tolist()
    batch = LoraBatch.from_token_slots(slots, "cpu", scaling if masked else None)
    if batch.empty:
        return out.float().clone()
    mask = batch.column_mask(w.a.shape[1]) if batch.token_scale is not None else None
    return lora_add_(out.float().clone(), x.float(), w.a.float(), w.bt.float(), scaling, batch, mask)
