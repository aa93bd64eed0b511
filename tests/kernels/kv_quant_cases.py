"""Builders for the quantized-KV tests: the same K/V in an fp32 cache and in a quantized one, the per-element error
a stored value may have, and how far attention over the quantized cache may then be from attention over the fp32 one.

Per element (kernels/kv_quant.py): int8 stores round(x / s), so |x - x̂| <= s / 2; fp8 rounds x / s to the nearest
fp8, so |x - x̂| <= rel · |x| + sub · s (rel: half an ulp, 2^-4 for e4m3 and 2^-3 for e5m2; sub: half the subnormal
spacing, 2^-10 / 2^-17).

Attention: a query row's score against key t moves by δ_t = softmax_scale · q · (k̂_t - k_t); with Δ = max_t |δ_t|
each softmax weight moves by a factor within e^{±2Δ}, so every output element obeys
``|Σ p v - Σ p̂ v̂| <= (e^{2Δ} - 1) · max|v| + max|v - v̂|``. Δ is computed from the reference dequantization of the
stored keys (itself checked against the per-element bound), so a kernel that reads a wrong scale, row or head
fails it; 1e-5 is added for fp32 sums in another order.

``fresh_case``: a prefill whose new tokens' K/V are also given as computed (fresh K/V), as strided views of one fused
q|k|v buffer beside q.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kernels import kv_quant
from kernels.prefill_attention import gather_kv
from kernels.store_kv import store_kv_ref
from tests.kernels.paged import block_tables

# per-element error of a stored value x with scale s: rel * |x| + sub * s (int8: 0 * |x| + 0.5 * s)
ERROR = {torch.int8: (0.0, 0.5), torch.float8_e4m3fn: (2.0 ** -4, 2.0 ** -10),
         torch.float8_e5m2: (2.0 ** -3, 2.0 ** -17)}


def random_kv(num_tokens: int, kv_heads: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    """N(0, 1) rows scaled per (token, head) by 10^U(-1, 1): the scales differ by 100x across rows."""
    x = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    return x * 10 ** (2 * torch.rand(num_tokens, kv_heads, 1, generator=gen) - 1)


def caches(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, slots: torch.Tensor,
           k: torch.Tensor, v: torch.Tensor) -> tuple[kv_quant.LayerKV, kv_quant.LayerKV, torch.Tensor]:
    """(fp32 layer views, quantized layer views, the quantized cache tensor), layer 1 of 2, ``k``/``v`` stored at
    ``slots`` in both (the quantized one through store_kv_ref)."""
    dense = torch.zeros(num_blocks, 2, 2, block_size, kv_heads, head_dim)
    quant = kv_quant.allocate(num_blocks, 2, block_size, kv_heads, head_dim, dtype, "cpu")
    d = kv_quant.layer_views(dense, block_size, kv_heads, head_dim)[1]
    q = kv_quant.layer_views(quant, block_size, kv_heads, head_dim)[1]
    store_kv_ref(k, v, d.key, d.value, slots)
    store_kv_ref(k, v, q.key, q.value, slots, key_scales=q.key_scales, value_scales=q.value_scales)
    return d, q, quant


def paged_case(dtype: torch.dtype, head_dim: int, kv_heads: int, block_size: int, seq_lens: list[int], seed: int):
    """(generator, block tables, fp32 layer views, quantized layer views): sequences of ``seq_lens`` tokens in
    scattered blocks (tests/kernels/paged.py), their K/V (``random_kv``) stored in both caches."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = len(seq_lens) * (max(seq_lens) // block_size + 2)
    tables = block_tables(seq_lens, block_size, num_blocks, gen).cpu()
    slots = torch.tensor([int(tables[s, p // block_size]) * block_size + p % block_size
                          for s, n in enumerate(seq_lens) for p in range(n)])
    k, v = random_kv(len(slots), kv_heads, head_dim, gen), random_kv(len(slots), kv_heads, head_dim, gen)
    dense, quant, _ = caches(num_blocks, block_size, kv_heads, head_dim, dtype, slots, k, v)
    return gen, tables, dense, quant


def element_bound(x: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The most each element of ``x [..., head_dim]`` may be off once stored as ``dtype`` with per-row ``scales``."""
    rel, sub = ERROR[dtype]
    return rel * x.abs() + sub * scales.unsqueeze(-1)


def attention_bound(q_row: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor, v: torch.Tensor,
                    v_hat: torch.Tensor, scale: float) -> float:
    """The bound of the module docstring for one query row [D] against the visible rows [T, D]: k, v as computed
    (fp32), k_hat, v_hat as stored (dequantized)."""
    delta = scale * float((k_hat - k).matmul(q_row).abs().max())
    return (math.exp(2 * delta) - 1) * float(v.abs().max()) + float((v - v_hat).abs().max()) + 1e-5


def rows(layer: kv_quant.LayerKV, table: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first ``n`` K and V rows [n, kv_heads, head_dim] in fp32 (dequantized if ``layer`` has scales)."""
    return (gather_kv(layer.key, table, n, layer.key_scales).float(),
            gather_kv(layer.value, table, n, layer.value_scales).float())


def check_within_bound(out: torch.Tensor, q: torch.Tensor, exact: torch.Tensor, dense: kv_quant.LayerKV,
                       quant: kv_quant.LayerKV, tables: torch.Tensor, seq_lens: list[int], cu: list[int],
                       scale: float, window: int | None) -> float:
    """Every output row of attention over ``quant`` within ``attention_bound`` of ``exact`` (the same attention over
    ``dense``); query token i of sequence s sits at position seq_lens[s] - (cu[s+1] - cu[s]) + i. Returns the largest
    error seen over its bound (<= 1)."""
    group = q.shape[1] // dense.key.shape[2]
    worst = 0.0
    for s, n in enumerate(seq_lens):
        k, v = rows(dense, tables[s], n)
        k_hat, v_hat = rows(quant, tables[s], n)
        for i in range(cu[s], cu[s + 1]):
            pos = n - (cu[s + 1] - cu[s]) + (i - cu[s])
            lo = max(0, pos + 1 - window) if window else 0
            for h in range(q.shape[1]):
                kv = h // group
                bound = attention_bound(q[i, h].float(), k[lo:pos + 1, kv], k_hat[lo:pos + 1, kv],
                                        v[lo:pos + 1, kv], v_hat[lo:pos + 1, kv], scale)
                err = float((out[i, h].float() - exact[i, h].float()).abs().max())
                assert err <= bound, f"sequence {s} token {i} head {h}: error {err} over the bound {bound}"
                worst = max(worst, err / bound)
    return worst


class FreshCase(NamedTuple):
    """Prefill over a cache whose new tokens are also given as computed (fresh K/V, kernels/prefill_attention.py)."""

    q: torch.Tensor  # [num_q_tokens, q_heads, head_dim]: a strided view of one fused q|k|v buffer
    fresh_key: torch.Tensor  # [num_q_tokens, kv_heads, head_dim]: the new tokens' K (the same buffer)
    fresh_value: torch.Tensor
    cu: torch.Tensor  # [num_seqs + 1] int32
    lens: torch.Tensor  # [num_seqs] int32
    tables: torch.Tensor
    dense: kv_quant.LayerKV  # every token's K/V as computed
    quant: kv_quant.LayerKV  # every token's K/V stored (quantized), the new ones too (the store runs first)

    def kernel_args(self, layer: kv_quant.LayerKV) -> tuple:
        return (self.q, layer.key, layer.value, self.tables, self.cu, self.lens)


def fresh_case(dtype: torch.dtype, head_dim: int, q_heads: int, kv_heads: int, block_size: int,
               shapes: list[tuple[int, int]], seed: int) -> FreshCase:
    """Sequences of (new tokens, context incl. them) in both caches (``paged_case``), and the new tokens' K/V rows
    beside q in one fused buffer, as the model's q|k|v projection gives them."""
    q_lens, seq_lens = [a for a, _ in shapes], [b for _, b in shapes]
    gen, tables, dense, quant = paged_case(dtype, head_dim, kv_heads, block_size, seq_lens, seed)
    new_k, new_v = (torch.cat([r[n - ql:] for r, ql, n in zip(rs, q_lens, seq_lens)]) for rs in zip(
        *(rows(dense, tables[s], n) for s, n in enumerate(seq_lens))))
    num_tokens, width = sum(q_lens), (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen)
    q = qkv[:, :q_heads * head_dim].reshape(num_tokens, q_heads, head_dim)
    fresh_key = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].reshape(num_tokens, kv_heads, head_dim)
    fresh_value = qkv[:, (q_heads + kv_heads) * head_dim:].reshape(num_tokens, kv_heads, head_dim)
    fresh_key.copy_(new_k)
    fresh_value.copy_(new_v)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return FreshCase(q, fresh_key, fresh_value, cu, torch.tensor(seq_lens, dtype=torch.int32), tables, dense, quant)
