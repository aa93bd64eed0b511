"""The quantized KV cache's layout as tensors, and its quantize / dequantize references.

A quantized cache is one tensor ``kv[num_blocks, num_layers, 2, page]`` of 1-byte elements (``torch.int8``,
``torch.float8_e4m3fn``, ``torch.float8_e5m2``); each page (one layer's K or V of one block) holds the values
``[block_size, num_kv_heads, head_dim]`` and then their scales ``[block_size, num_kv_heads]`` in fp32
(engine/kv/cache_dtype.py; docs/ARCHITECTURE.md "Quantized KV cache"). ``layer_views`` cuts it into the strided
per-layer views the kernels take: values ``[num_blocks, block_size, num_kv_heads, head_dim]`` and scales
``[num_blocks, block_size, num_kv_heads]``, both views of the one tensor (nothing is copied, and a block's
bytes, scales included, stay one contiguous range). A dense cache's views carry no scales. ``store_blocks`` stores
whole blocks of a dense cache (a peer's, read over NIXL: mixed precision across pools) through a cache's own store
kernel; ``dequantize_blocks`` turns a quantized cache's whole blocks into a dense cache's (the other direction).

Scales are symmetric, one per token and KV head: ``scale = amax_d |x| / qmax`` (qmax 127 for int8, 448 for
e4m3, 57344 for e5m2); int8 stores ``round_half_even(x / scale)`` (at most ``scale / 2`` off per element), fp8
the cast of ``x / scale`` (round to nearest even). A row of zeros gets scale 0 and values 0. The C store
(kernels/cpu/attention_kv8.c) computes the same fp32 quotient and rounding, so both write the same bytes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
STORAGE = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


class LayerKV(NamedTuple):
    """One layer's cache as the kernels take it (strided views of the engine's one tensor)."""

    key: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value: torch.Tensor
    key_scales: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads] fp32; None: a dense cache
    value_scales: torch.Tensor | None = None

    @property
    def scales(self) -> dict[str, torch.Tensor]:
        """The scale keyword arguments of the kernels (none for a dense cache)."""
        if self.key_scales is None:
            return {}
        return {"key_scales": self.key_scales, "value_scales": self.value_scales}


def allocate(num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed quantized cache ``[num_blocks, num_layers, 2, page]`` of ``dtype`` (a key of QMAX)."""
    if dtype not in QMAX:
        raise TypeError(f"{dtype} is not a quantized KV dtype ({', '.join(map(str, QMAX))})")
    page = block_size * num_kv_heads * (head_dim + 4)
    return torch.zeros(num_blocks, num_layers, 2, page, dtype=dtype, device=device)


def layer_views(kv: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int) -> list[LayerKV]:
    """Every layer's views of a cache: a dense ``[N, L, 2, B, H, D]`` one (no scales) or a quantized
    ``[N, L, 2, page]`` one (values, then fp32 scales, per page)."""
    if kv.dim() == 6:
        return [LayerKV(kv[:, layer, 0], kv[:, layer, 1]) for layer in range(kv.shape[1])]
    num_blocks, num_layers, _, page = kv.shape
    values = block_size * num_kv_heads * head_dim
    if page != values + 4 * block_size * num_kv_heads:
        raise ValueError(f"a page of {page} bytes is not {block_size} x {num_kv_heads} x ({head_dim} values + a "
                         "4-byte scale)")
    vals = kv[..., :values].view(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    scales = kv[..., values:].view(torch.float32).view(num_blocks, num_layers, 2, block_size, num_kv_heads)
    return [LayerKV(vals[:, layer, 0], vals[:, layer, 1], scales[:, layer, 0], scales[:, layer, 1])
            for layer in range(num_layers)]


def store_blocks(store_kv: Callable, layers: Sequence[LayerKV], blocks: torch.Tensor, block_ids: Sequence[int],
                 dtype: torch.dtype) -> None:
    """Whole blocks of a dense cache ``blocks [n, num_layers, 2, block_size, num_kv_heads, head_dim]`` (a peer's, of
    the model dtype) into blocks ``block_ids`` of a cache whose per-layer views are ``layers``, through ``store_kv``,
    that cache's own store kernel: the bytes written are those the cache's engine stores for the same K/V rows (every
    row of a block, the unused tail of a last block too: its rows are overwritten before anything reads them).
    ``dtype``: the rows' dtype the store takes (the engine's compute dtype)."""
    n, num_layers, _, block_size, num_kv_heads, head_dim = blocks.shape
    if n != len(block_ids) or num_layers != len(layers):
        raise ValueError(f"{n} staged blocks of {num_layers} layers for {len(block_ids)} block ids of a cache of "
                         f"{len(layers)} layers")
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=blocks.device)
    slots = (ids[:, None] * block_size + torch.arange(block_size, device=blocks.device)).reshape(-1)
    rows = n * block_size
    for layer, kv in enumerate(layers):
        key = blocks[:, layer, 0].to(dtype).reshape(rows, num_kv_heads, head_dim).contiguous()
        value = blocks[:, layer, 1].to(dtype).reshape(rows, num_kv_heads, head_dim).contiguous()
        store_kv(key, value, kv.key, kv.value, slots, **kv.scales)


def dequantize_blocks(blocks: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks of a quantized cache ``[n, num_layers, 2, page]`` (a peer's, read over NIXL: mixed precision
    across pools) as a dense cache's blocks ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` of ``dtype``:
    each value times its scale in fp32 (what attention over the quantized cache reads), then cast to ``dtype``."""
    out = torch.empty(blocks.shape[0], blocks.shape[1], 2, block_size, num_kv_heads, head_dim, dtype=dtype,
                      device=blocks.device)
    for layer, kv in enumerate(layer_views(blocks, block_size, num_kv_heads, head_dim)):
        out[:, layer, 0] = dequantize_ref(kv.key, kv.key_scales)
        out[:, layer, 1] = dequantize_ref(kv.value, kv.value_scales)
    return out


def quantize_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., head_dim]`` (any float dtype) -> (values of ``dtype`` [..., head_dim], fp32 scales [...])."""
    qmax = QMAX[dtype]
    xf = x.float()
    scales = xf.abs().amax(dim=-1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    q = (xf / safe).clamp(-qmax, qmax)
    if dtype == torch.int8:
        q = torch.round(q)  # half to even, as nearbyintf in the C store
    return q.to(dtype), scales


def dequantize_ref(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``values [..., head_dim] * scales [...]``."""
    return values.float() * scales.unsqueeze(-1)
