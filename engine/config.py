"""Configuration: small frozen dataclasses, validated on construction, passed down explicitly.

``ModelConfig`` is what the checkpoint says (parsed once from its config.json); ``EngineConfig`` is how
we run it. Derived runtime values (number of KV blocks actually allocated, the resolved dtype) live on
the objects that own them (the model runner), never written back here.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ConfigError, ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # the HF dict, frozen as sorted items
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    checkpoint_dtype: str = "float32"
    model_id: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {self.num_heads} not a multiple of num_key_value_heads {self.num_kv_heads}")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @property
    def rope_type(self) -> str:
        d = self.rope_scaling_dict
        return d.get("rope_type", d.get("type", "default")) if d else "default"

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], model_id: str = "") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelLoadError("config.json has no 'architectures' entry")
        arch = archs[0]
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            num_layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing required field {e.args[0]!r}") from None
        head_dim = cfg.get("head_dim") or hidden // num_heads
        sliding = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen2 ships a sliding_window value but only applies it when asked
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise ModelLoadError(f"rope_scaling must be an object, got {rope_scaling!r}")
        default_tie = arch == "Qwen2ForCausalLM" and cfg.get("tie_word_embeddings") is None
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            intermediate_size=inter,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) or default_tie,
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            model_id=model_id,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no config.json (is this a Hugging Face checkpoint directory?)")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: invalid JSON: {e}") from None
        return cls.from_hf_dict(cfg, model_id=Path(model_dir).resolve().name)


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs. ``num_blocks=None`` sizes the KV cache from ``kv_cache_bytes``."""

    model: str  # checkpoint directory
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 256 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill splits prompts at it)
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    dtype: str = "auto"
    device: str = "cpu"
    kernels: str = "auto"  # auto | torch | triton
    quantization: str | None = None  # None | "w8a16"
    hash_seed: int = 0
    hash_namespace: str = ""
    seed: int = 0  # seeds requests that bring no seed of their own
    worker_id: str = "local"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kernels not in ("auto", "torch", "triton"):
            raise ConfigError(f"kernels must be auto, torch or triton, got {self.kernels!r}")
        if self.quantization not in (None, "w8a16"):
            raise ConfigError(f"quantization must be None or 'w8a16', got {self.quantization!r}")
        if not self.enable_chunked_prefill and self.max_model_len and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
