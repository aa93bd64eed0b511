"""Building blocks of the Llama family, written to match Hugging Face's arithmetic step for step (so fp32
greedy outputs are token-exact): RMSNorm in fp32, rotate-half RoPE with fp32 frequencies, SwiGLU.
Linear layers call the kernel backend (``KernelOps.linear`` / ``w8a16_linear``) — the GEMM seam. A backend with
fused per-token ops (``KernelOps.rms_norm`` / ``rotary_`` / ``silu_mul``: the CPU path's C kernels) runs those
instead of the torch code here, with the same arithmetic."""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.models.kernel_backend import KernelOps

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """``norm(x)``, or with the residual stream ``norm(x, residual)`` → ``(norm(residual + x), residual + x)``
    (the fused backend updates ``residual`` in place)."""

    def __init__(self, hidden_size: int, eps: float, ops: KernelOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.fused = ops.rms_norm if ops is not None else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused is not None:
            out = self.fused(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


@dataclass(frozen=True)
class QuantParts:
    """A fused projection whose pieces are quantized in different formats (a llama.cpp Q4_K_M file: q and k Q4_K, v
    Q6_K), kept packed as runs of rows: ``parts`` (first row, the backend's packed weight) in row order. One
    ``quant_linear`` per part, each writing its columns of one output (``out=``: no copy, and a CPU recording of the
    step sees only the kernels' calls)."""
    parts: tuple[tuple[int, object], ...]
    rows: int
    cols: int

    @property
    def fmt(self) -> str:
        return "+".join(dict.fromkeys(p.fmt for _, p in self.parts))

    @property
    def num_bytes(self) -> int:
        return sum(_packed_bytes(p) for _, p in self.parts)

    def linear(self, quant_linear: Callable, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.rows, dtype=x.dtype, device=x.device)
        for r0, p in self.parts:
            quant_linear(x, p, None if bias is None else bias[r0:r0 + p.rows], out=out[:, r0:r0 + p.rows])
        return out


def _packed_bytes(p) -> int:
    """A packed weight's bytes (the C kernels' ``num_bytes``; the torch references hold the file's ``data``)."""
    return p.num_bytes if hasattr(p, "num_bytes") else p.data.numel() * p.data.element_size()


class Linear(nn.Module):
    """``y = x @ W.T + b`` through the backend; ``quantize_int8`` swaps W for int8 + scales (w8a16), ``pack``
    for the backend's packed layout (the CPU path: oneDNN); ``quant``: a checkpoint's quantized weight kept packed
    (``KernelOps.quant_linear``; engine/loading/quantized.py), W then absent."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: KernelOps) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.ops = ops
        self.qweight: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.quant = None  # the backend's packed form of a quantized checkpoint weight (KernelOps.pack_quant)
        self.shards: list[int] | None = None  # row blocks of a fused projection (q/k/v, gate/up), for the loader
        # tensor parallelism (engine/models/tensor_parallel.py): (dim, this rank's Split of each shard) of the
        # checkpoint's weight — dim 0 column-parallel (bias split alike), 1 row-parallel (bias whole); and,
        # row-parallel, the group whose all-reduce sums the partial outputs before the bias is added
        self.tp_split: tuple[int, list] | None = None
        self.reduce = None
        self.lora = None  # LoRA adapters' slots (engine/lora/pool.py LoraWeights): their deltas added to the output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.reduce is None else None
        if isinstance(self.quant, QuantParts):
            out = self.quant.linear(self.ops.quant_linear, x, bias)
        elif self.quant is not None:
            out = self.ops.quant_linear(x, self.quant, bias)
        elif self.packed is not None:
            out = self.ops.linear_packed(x, self.packed, bias)
        elif self.qweight is not None:
            out = self.ops.w8a16_linear(x, self.qweight, self.scales, bias)
        else:
            out = self.ops.linear(x, self.weight, bias)
        if self.lora is not None:
            out = self.lora.add_(x, out)
        if self.reduce is None:
            return out
        out = self.reduce.all_reduce_(out)
        return out if self.bias is None else out + self.bias

    def quantize_int8(self, group_size: int | None = None) -> None:
        from kernels.gemm import quantize_weight_int8

        self.qweight, self.scales = quantize_weight_int8(self.weight.data, group_size)
        self.weight = None  # the float weight is gone: its memory is what quantization saves

    def pack(self, keep_dense: bool = False) -> None:
        """Reorder the weight once into the backend's packed layout; the dense one is dropped unless it is
        shared (a tied LM head is the embedding table). A weight kept quantized is packed already."""
        if self.quant is not None:
            return
        self.packed = self.ops.pack_linear(self.weight.data)
        if not keep_dense:
            self.weight = None


def rope_attention_factor(cfg: ModelConfig) -> float:
    """LongRoPE's scale of cos and sin (1 for every other type): given, or sqrt(1 + ln f / ln L0) for the
    context's growth f = max_position_embeddings / L0 (transformers' default)."""
    if cfg.rope_type != "longrope":
        return 1.0
    rs = cfg.rope_params_dict
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    original = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or cfg.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_inv_freq(cfg: ModelConfig, factor_set: str = "short") -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] (rotary_dim: head_dim, or its part under ``partial_rotary_factor``),
    incl. ``linear``, ``llama3`` and ``longrope`` scaling as HF computes them (LongRoPE: with ``factor_set``'s
    factors, "short" or "long"), and GGUF's per-frequency ``rope_freqs`` divisors."""
    dim = cfg.rotary_dim
    rs = cfg.rope_params_dict
    if cfg.rope_type == "longrope":
        if factor_set not in ("short", "long"):
            raise ValueError(f"LongRoPE factor set must be short or long, got {factor_set!r}")
        ext = torch.tensor(rs[f"{factor_set}_factor"], dtype=torch.float32)
        return 1.0 / (ext * cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / rs["factor"]
    elif cfg.rope_type == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_ctx = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    if cfg.rope_freq_factors:  # llama.cpp's form of the same scaling: theta / factor per frequency
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables [rows, rotary_dim] and rotate-half RoPE on the first ``rotary_dim`` dims of each head; with
    ``partial_rotary_factor`` < 1 (Phi-4-mini) the other dims pass through unchanged, as transformers' Phi-3
    ``apply_rotary_pos_emb`` does. The fused kernels (``KernelOps.rotary_``) take the same tables.

    A token's row is its position plus its request's ``row_offset``. Every RoPE type has one table of
    ``max_positions`` rows at offset 0, except LongRoPE served past its pre-training length L0: rows
    [0, L0) hold the short factors' table and rows [L0, L0 + max_positions) the long factors', so a batch
    mixing requests of both sets (engine/request.py ``admit_rope_factors``) rotates each token with its own
    request's set in one kernel call, on every backend, without a kernel knowing of factor sets."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.rotary_dim = cfg.rotary_dim
        self.longrope_original_len = original = cfg.longrope_original_len
        # the long set's first row (None: one table, a LongRoPE request's set is then always the short one)
        self.long_offset = original if original is not None and max_positions > original else None
        emb = _rope_angles(cfg, "short", max_positions if self.long_offset is None else original)
        if self.long_offset is not None:
            emb = torch.cat((emb, _rope_angles(cfg, "long", max_positions)))
        scale = rope_attention_factor(cfg)
        if original is not None:
            log.info("LongRoPE: short factors up to the pre-training length %d%s, cos/sin x %.4f", original,
                     "" if self.long_offset is None else f", long ones past it (context {max_positions})", scale)
        if self.rotary_dim != cfg.head_dim:
            log.info("partial rotary: RoPE on the first %d of each head's %d dims (partial_rotary_factor %s)",
                     self.rotary_dim, cfg.head_dim, cfg.partial_rotary_factor)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)  # [rows, rotary_dim]
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def row_offset(self, rope_factors: str | None) -> int:
        """The first table row of a request with LongRoPE factor set ``rope_factors`` ("short": 0). Without
        LongRoPE the set means nothing here (a draft model without it under a LongRoPE target): 0."""
        if self.longrope_original_len is None:
            return 0
        if rope_factors != "long":
            if rope_factors is None and self.long_offset is not None:
                raise ValueError("a request without a LongRoPE factor set on a LongRoPE model (engine/request.py "
                                 "admit_rope_factors chooses it at admission)")
            return 0
        if self.long_offset is None:
            raise ValueError("a long-factor request on a LongRoPE table built within the pre-training length "
                             "(its prompt + max_tokens cannot exceed the served context)")
        return self.long_offset

    def rows(self, rope_factors: str | None, start: int, end: int) -> range:
        """The table rows of positions [start, end) of a request with factor set ``rope_factors``."""
        offset = self.row_offset(rope_factors)
        return range(start + offset, end + offset)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, Hkv, D]
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        if self.rotary_dim == q.shape[-1]:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        return _rotate_part(q, cos, sin), _rotate_part(k, cos, sin)


def _rope_angles(cfg: ModelConfig, factor_set: str, num_positions: int) -> torch.Tensor:
    """[num_positions, rotary_dim]: position x inverse frequency, twice (rotate-half's layout)."""
    freqs = torch.arange(num_positions, dtype=torch.float32)[:, None] * rope_inv_freq(cfg, factor_set)[None, :]
    return torch.cat((freqs, freqs), dim=-1)


def _rotate_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of each head of ``x``, the rest passed through."""
    rot, rest = x[..., :cos.shape[-1]], x[..., cos.shape[-1]:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
