"""``EngineConfig``: how one engine runs (split from engine/config.py, which holds ``ModelConfig``, what the
checkpoint says, and re-exports this). Frozen, validated on construction; derived runtime values live on the
objects that own them."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError
from engine.spec.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs. The device KV cache is ``num_blocks`` blocks, else ``kv_cache_bytes``, else sized
    from the memory free after the weights load (engine/kv_sizing.py states the rule)."""

    model: str  # Hugging Face checkpoint directory or .gguf file
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None  # None: auto (engine/kv_sizing.py)
    # auto sizing only: the share of memory the cache takes (None: 0.9 of a GPU's total less what is in use;
    # 0.25 of the RAM available on a CPU) and, on a CPU, how many engines split that RAM (None: 1; `duet serve`
    # sets it to the workers its pools may hold on the Ray it starts)
    kv_cache_memory_fraction: float | None = None
    colocated_engines: int | None = None
    # lower KV tiers (engine/kv_tiers.py; docs/operating.md "Sizing the KV tiers"): 0 turns a tier off
    kv_host_bytes: int = 0  # host memory for cached blocks (pinned on CUDA hosts); >= the device tier's bytes
    kv_disk_bytes: int = 0  # files under kv_disk_dir; >= the host tier's bytes
    kv_disk_dir: str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill splits prompts at it)
    # decode role: a handoff is admitted only if the blocks left free still let every sequence already here grow
    # by this many tokens (or to its max_tokens, if sooner): a full decode worker stops admitting instead of
    # preempting a running sequence and recomputing its long prompt (engine/remote_kv.py). 0: no reserve.
    kv_handoff_reserve_tokens: int = 256
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    dtype: str = "auto"
    device: str = "cpu"
    kernels: str = "auto"  # auto | torch | cpu | triton (engine/ops.py)
    quantization: str | None = None  # None | "w8a16"
    # ranks the model is split over (engine/parallel.py); a worker of N ranks is N processes
    # (prefill_worker/tp_ranks.py), each with its own host / disk tier of its KV heads
    tensor_parallel_size: int = 1
    # CUDA only: decode-only steps of up to this many sequences replay CUDA graphs (engine/model_runner.py);
    # 0 runs every step eagerly. Ignored on a CPU.
    cuda_graph_max_batch: int = 256
    # speculative decoding (engine/spec): a SpeculativeConfig, or its JSON object (a dict or text) as vLLM's
    # --speculative-config takes it; None: off
    speculative_config: Any = None
    hash_seed: int = 0
    hash_namespace: str = ""
    seed: int = 0  # seeds requests that bring no seed of their own
    worker_id: str = "local"

    def __post_init__(self) -> None:
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            spec = SpeculativeConfig.from_json(spec) if isinstance(spec, str) else SpeculativeConfig.from_dict(spec)
            object.__setattr__(self, "speculative_config", spec)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if isinstance(self.kv_handoff_reserve_tokens, bool) or not isinstance(self.kv_handoff_reserve_tokens, int) \
                or self.kv_handoff_reserve_tokens < 0:
            raise ConfigError(f"kv_handoff_reserve_tokens must be an integer >= 0, got {self.kv_handoff_reserve_tokens!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kernels not in ("auto", "torch", "cpu", "triton"):
            raise ConfigError(f"kernels must be auto, torch, cpu or triton, got {self.kernels!r}")
        if self.cuda_graph_max_batch < 0:
            raise ConfigError(f"cuda_graph_max_batch must be >= 0 (0: no CUDA graphs), got {self.cuda_graph_max_batch}")
        if self.kv_cache_bytes is not None and (type(self.kv_cache_bytes) is not int or self.kv_cache_bytes < 1):
            raise ConfigError(f"kv_cache_bytes must be a positive integer or null (auto), got {self.kv_cache_bytes!r}")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and (type(fraction) not in (int, float) or not 0 < fraction <= 1):
            raise ConfigError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction!r}")
        if self.colocated_engines is not None and (type(self.colocated_engines) is not int or self.colocated_engines < 1):
            raise ConfigError(f"colocated_engines must be an integer >= 1, got {self.colocated_engines!r}")
        if self.kv_host_bytes < 0 or self.kv_disk_bytes < 0:
            raise ConfigError("kv_host_bytes and kv_disk_bytes must be >= 0 (0: no such tier)")
        if self.kv_disk_bytes and not self.kv_disk_dir:
            raise ConfigError("kv_disk_bytes needs kv_disk_dir (the directory the disk tier writes its files to)")
        if type(self.tensor_parallel_size) is not int or self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.kv_disk_bytes and not self.kv_host_bytes:
            raise ConfigError("the disk tier is filled from the host tier: kv_disk_bytes needs kv_host_bytes")
        if self.kv_disk_bytes and self.kv_disk_bytes < self.kv_host_bytes:
            raise ConfigError(f"kv_disk_bytes {self.kv_disk_bytes} is smaller than kv_host_bytes {self.kv_host_bytes}: "
                              "the disk tier should hold at least what the host tier does")
        if self.quantization not in (None, "w8a16"):
            raise ConfigError(f"quantization must be None or 'w8a16', got {self.quantization!r}")
        if not self.enable_chunked_prefill and self.max_model_len and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
