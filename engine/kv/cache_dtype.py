"""What a KV block's bytes hold: the KV cache dtype (``EngineConfig.kv_cache_dtype``) and the sizes it implies.

``auto`` keeps the model dtype and the dense layout ``kv[num_blocks, num_layers, 2, B, Hkv, D]``. ``int8``,
``fp8_e4m3`` and ``fp8_e5m2`` (vLLM's names) store 1-byte values and one fp32 scale per token and KV head, the
scales after each (layer, K|V) page of a block: ``kv[num_blocks, num_layers, 2, page]`` with ``page = values
[B, Hkv, D] ‖ scales [B, Hkv]`` (docs/ARCHITECTURE.md, "Quantized KV cache"). A block is one contiguous range
either way, so whatever moves blocks by bytes needs no change.

Pure arithmetic, no torch: the sizing rule, the scheduler side and the router read it.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import KV_CACHE_DTYPES
from engine.errors import ConfigError

SCALE_BYTES = 4  # one fp32 scale per (token, KV head); kvtransfer's KVCompat names this layout PAGE_SCALES

# config name -> (torch dtype name of the stored values, the largest magnitude a value takes: amax / qmax = scale)
_QUANTIZED = {"int8": ("int8", 127.0), "fp8_e4m3": ("float8_e4m3fn", 448.0), "fp8_e5m2": ("float8_e5m2", 57344.0)}
_DENSE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVCacheDtype:
    """One engine's KV cache element format, ``auto`` resolved."""

    name: str  # the config's kv_cache_dtype ("int8", ...), or the model dtype's name for auto ("float32", ...)
    storage: str  # torch dtype name of the stored values ("int8", "float8_e4m3fn", "float32", ...)
    value_bytes: int
    qmax: float  # 0: not quantized (values are the model's own)

    @property
    def quantized(self) -> bool:
        return self.qmax > 0

    def page_bytes(self, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """One layer's K (or V) of one block: its values, then (quantized) their scales."""
        scales = SCALE_BYTES if self.quantized else 0
        return block_size * num_kv_heads * (head_dim * self.value_bytes + scales)

    def bytes_per_block(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        return num_layers * 2 * self.page_bytes(block_size, num_kv_heads, head_dim)

    def describe(self) -> str:
        """What the log line and errors say about it."""
        if not self.quantized:
            return self.name
        return f"{self.name} + an fp32 scale per token and KV head"


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> KVCacheDtype:
    """``kv_cache_dtype`` (one of KV_CACHE_DTYPES) for a model computing in ``model_dtype`` ("float32", ...)."""
    if kv_cache_dtype == "auto":
        if model_dtype not in _DENSE_BYTES:
            raise ConfigError(f"a KV cache in the model dtype {model_dtype!r} is not supported "
                              f"(one of {', '.join(_DENSE_BYTES)})")
        return KVCacheDtype(model_dtype, model_dtype, _DENSE_BYTES[model_dtype], 0.0)
    if kv_cache_dtype not in _QUANTIZED:
        raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    storage, qmax = _QUANTIZED[kv_cache_dtype]
    return KVCacheDtype(kv_cache_dtype, storage, 1, qmax)
