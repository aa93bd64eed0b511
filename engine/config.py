"""The engine's config tree: ``EngineConfig`` (how one engine runs) and ``SpeculativeConfig`` (its
``speculative_config``), as vLLM keeps ``vllm/config/speculative.py`` in its config package. Frozen, validated on
construction; derived runtime values live on the objects that own them. What the checkpoint says is
``ModelConfig`` (engine/models/config.py).

``SpeculativeConfig``: the ``--speculative-config`` JSON, as vLLM users write it.

Keys (vLLM's ``vllm/config/speculative.py`` names, defaults and checks unless said otherwise):

- ``method``: ``ngram``, ``suffix`` or ``draft_model``. Absent: ``ngram`` when ``model`` is ``"ngram"``,
  ``draft_model`` when another ``model`` is given (vLLM also sniffs EAGLE / MTP / Medusa from the draft
  checkpoint; duet has none of those, so any other method is refused by name).
- ``num_speculative_tokens`` (>= 1): required for ``ngram`` and ``draft_model`` (vLLM would take a draft
  checkpoint's ``n_predict``; duet reads no draft checkpoint); for ``suffix`` it defaults to
  ``suffix_decoding_max_tree_depth`` and is the most drafts per step (vLLM's rule).
- ``model``: the draft checkpoint, required by ``draft_model``; ``ngram`` / ``suffix`` take none or their own
  name (what vLLM fills in).
- ``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram, >= 1): both absent -> 5 and 5 (vLLM's defaults,
  "arbitrarily chosen" in its source); one given -> the other equals it (vLLM's code; its field doc says
  min defaults to 1); min <= max.
- ``suffix_decoding_max_tree_depth`` (24, >= 1), ``suffix_decoding_max_cached_requests`` (10000, >= 0; 0
  turns the worker cache of finished outputs off), ``suffix_decoding_max_spec_factor`` (1.0, >= 0),
  ``suffix_decoding_min_token_prob`` (0.1, in [0, 1]).
- ``suffix_decoding_max_cached_nodes`` (duet's own, 262144, >= 1): the node bound of that cache, i.e. its
  memory bound (~0.4 KB a node in Python, so ~100 MB); vLLM's C++ cache is bounded by requests only.

Stricter than vLLM, by design: an unknown key (vLLM's other keys included, e.g. ``draft_tensor_parallel_size``)
and a key of another method (``prompt_lookup_max`` with ``suffix``) are a ``ConfigError`` naming the key, where
vLLM would ignore the second kind; a bool is not a number.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, fields
from typing import Any

from engine.errors import ConfigError

METHODS = ("ngram", "suffix", "draft_model")
SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_cached_nodes", "suffix_decoding_max_spec_factor",
               "suffix_decoding_min_token_prob")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, when neither bound is given
DEFAULT_MAX_TREE_DEPTH = 24
DEFAULT_MAX_CACHED_REQUESTS = 10000
DEFAULT_MAX_CACHED_NODES = 1 << 18
DEFAULT_MAX_SPEC_FACTOR = 1.0
DEFAULT_MIN_TOKEN_PROB = 0.1


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None  # set (both) for ngram, None otherwise
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH
    suffix_decoding_max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS
    suffix_decoding_max_cached_nodes: int = DEFAULT_MAX_CACHED_NODES
    suffix_decoding_max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR
    suffix_decoding_min_token_prob: float = DEFAULT_MIN_TOKEN_PROB

    def __post_init__(self) -> None:
        _check_method(self.method)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.model is not None and not (isinstance(self.model, str) and self.model):
            raise ConfigError(f"speculative config: model must be a non-empty string, got {self.model!r}")
        if self.method == "draft_model" and self.model is None:
            raise ConfigError("speculative config: method draft_model needs a model (the draft checkpoint)")
        if self.method in ("ngram", "suffix") and self.model not in (None, self.method):
            raise ConfigError(f"speculative config: method {self.method} takes no model, got {self.model!r}")
        if self.method == "ngram":
            _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
            _check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ConfigError(f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                                  f"prompt_lookup_max ({self.prompt_lookup_max})")
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            key = "prompt_lookup_min" if self.prompt_lookup_min is not None else "prompt_lookup_max"
            raise ConfigError(f"speculative config: {key} applies to method ngram only, not {self.method!r}")
        _check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1)
        _check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0)
        _check_int("suffix_decoding_max_cached_nodes", self.suffix_decoding_max_cached_nodes, 1)
        _check_float("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor, 0.0, math.inf)
        _check_float("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob, 0.0, 1.0)

    @property
    def needs_draft_model(self) -> bool:
        """Whether proposing needs a second model (``method`` draft_model: engine/speculative/draft.py)."""
        return self.method == "draft_model"

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"speculative config is not valid JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> SpeculativeConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"speculative config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(f"speculative config: unknown key {key!r} (duet knows {', '.join(sorted(known))})")
        d = dict(data)
        method = d.get("method")
        if method is None:
            model = d.get("model")
            if model is None:
                raise ConfigError("speculative config needs a method (ngram, suffix or draft_model) or a model")
            method = d["method"] = "ngram" if model == "ngram" else "draft_model"
        _check_method(method)
        if method != "suffix":
            for key in SUFFIX_KEYS:
                if key in d:
                    raise ConfigError(f"speculative config: {key} applies to method suffix only, not {method!r}")
        for key in ("prompt_lookup_min", "prompt_lookup_max", SUFFIX_KEYS[0]):
            if d.get(key) is not None:  # checked before it stands in for another key, so the error names it
                _check_int(key, d[key], 1)
        if method == "ngram":
            lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            d["prompt_lookup_min"] = hi if lo is None else lo
            d["prompt_lookup_max"] = lo if hi is None else hi
        if method == "suffix" and d.get("num_speculative_tokens") is None:
            d["num_speculative_tokens"] = d.get("suffix_decoding_max_tree_depth", DEFAULT_MAX_TREE_DEPTH)
        if d.get("num_speculative_tokens") is None:
            raise ConfigError(f"speculative config: method {method} needs num_speculative_tokens")
        return cls(**d)


def _check_method(method: Any) -> None:
    if not isinstance(method, str) or method not in METHODS:
        raise ConfigError(f"speculative config: method must be one of {', '.join(METHODS)}, got {method!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"speculative config: {name} must be an integer >= {minimum}, got {value!r}")


def _check_float(name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        bounds = f">= {lo}" if hi == math.inf else f"in [{lo}, {hi}]"
        raise ConfigError(f"speculative config: {name} must be a finite number {bounds}, got {value!r}")


DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")  # engine/kv/cache_dtype.py says what each stores
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")  # EngineConfig.lora_dtype
QUANTIZATIONS = (None, "w8a16", "int8", "int4")  # EngineConfig.quantization


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs. The device KV cache is ``num_blocks`` blocks, else ``kv_cache_bytes``, else sized
    from the memory free after the weights load (engine/kv/sizing.py states the rule)."""

    model: str  # Hugging Face checkpoint directory or .gguf file
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None  # None: auto (engine/kv/sizing.py)
    # auto sizing only: the share of memory the cache takes (None: 0.9 of a GPU's total less what is in use;
    # 0.25 of the RAM available on a CPU) and, on a CPU, how many engines split that RAM (None: 1; `duet serve`
    # sets it to the workers its pools may hold on the Ray it starts)
    kv_cache_memory_fraction: float | None = None
    colocated_engines: int | None = None
    # lower KV tiers (engine/kv/tiers.py; docs/operating.md "Sizing the KV tiers"): 0 turns a tier off
    kv_host_bytes: int = 0  # host memory for cached blocks (pinned on CUDA hosts); >= the device tier's bytes
    kv_disk_bytes: int = 0  # files under kv_disk_dir; >= the host tier's bytes
    kv_disk_dir: str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill splits prompts at it)
    # decode role: a handoff is admitted only if the blocks left free still let every sequence already here grow
    # by this many tokens (or to its max_tokens, if sooner): a full decode worker stops admitting instead of
    # preempting a running sequence and recomputing its long prompt (engine/engine_handoff.py). 0: no reserve.
    kv_handoff_reserve_tokens: int = 256
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    dtype: str = "auto"
    device: str = "cpu"
    kernels: str = "auto"  # auto | torch | cpu | triton (engine/models/kernel_backend.py)
    # None | "w8a16" | "int8" | "int4": a float checkpoint's weights quantized at load (int8 / int4: GGUF Q8_0 /
    # Q4_1 blocks for the packed kernels, engine/loading/quantize.py; w8a16: per-channel int8, kernels/gemm.py)
    quantization: str | None = None
    # a quantized checkpoint's weights (GGUF blocks, GPTQ / AWQ / compressed-tensors, or quantization int8 / int4):
    # "auto" keeps those the kernel backend takes packed (engine/loading/quantized.py); "dense" dequantizes every
    # one at load (the reference for the packed path)
    quantized_weights: str = "auto"
    # what the CPU kernels multiply packed weights with: "fp32" activations (token-exact with the dense model on
    # the dequantized weights) or "int8" per 32-block (llama.cpp's scheme: faster, not token-exact; the cpu backend)
    quantized_activations: str = "fp32"
    # what the KV cache stores (vLLM's names): "auto" (the model dtype), or "int8" / "fp8_e4m3" / "fp8_e5m2": 1-byte
    # values with an fp32 scale per token and KV head inside each block (engine/kv/cache_dtype.py; int8 on the cpu
    # torch and Triton kernels, fp8_e4m3 / fp8_e5m2 alike; e4m3 on Triton needs compute capability >= 8.9)
    kv_cache_dtype: str = "auto"
    # ranks the model is split over (engine/models/tensor_parallel.py); a worker of N ranks is N processes
    # (prefill_worker/tp_ranks.py), each with its own host / disk tier of its KV heads
    tensor_parallel_size: int = 1
    # CUDA only: decode-only steps of up to this many sequences replay CUDA graphs (engine/model_runner.py);
    # 0 runs every step eagerly. Ignored on a CPU.
    cuda_graph_max_batch: int = 256
    # CPU, kernels cpu, every projection packed (a quantized checkpoint): decode-only steps of up to this many
    # sequences replay a recording of their C kernel calls (engine/decode_graphs.py); 0 runs them eagerly.
    cpu_graph_max_batch: int = 16
    # speculative decoding (engine/speculative/): a SpeculativeConfig, or its JSON object (a dict or text) as vLLM's
    # --speculative-config takes it; None: off
    speculative_config: Any = None
    # LoRA adapters (engine/lora/manager.py): name → PEFT adapter directory (a dict, kept as sorted pairs), loaded at
    # start; ``max_loras`` device slots (adapters in one batch; 0: one per lora_modules entry), LRU-evicted when idle;
    # ``max_cpu_loras`` adapters loaded at most (host memory; 0: max(max_loras, len(lora_modules)), vLLM's default);
    # ``pinned_loras``: names of lora_modules that keep their slot for good; rank <= ``max_lora_rank``
    lora_modules: Any = None
    max_loras: int = 0
    max_cpu_loras: int = 0
    pinned_loras: Any = None
    max_lora_rank: int = 16
    # the slots' storage of the adapters' weights: "auto" the model's dtype; "bfloat16" / "float16" halve the bytes the
    # LoRA kernels read per step (an fp32 adapter rounded once at load; a bf16 / fp16 file is kept exactly)
    lora_dtype: str = "auto"
    hash_seed: int = 0
    hash_namespace: str = ""
    seed: int = 0  # seeds requests that bring no seed of their own
    worker_id: str = "local"

    def __post_init__(self) -> None:
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            spec = SpeculativeConfig.from_json(spec) if isinstance(spec, str) else SpeculativeConfig.from_dict(spec)
            object.__setattr__(self, "speculative_config", spec)
        self._check_lora()
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
        if self.cpu_graph_max_batch < 0:
            raise ConfigError(f"cpu_graph_max_batch must be >= 0 (0: no recordings), got {self.cpu_graph_max_batch}")
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
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(map(repr, QUANTIZATIONS))}, "
                              f"got {self.quantization!r}")
        if self.quantized_weights not in ("auto", "dense"):
            raise ConfigError(f"quantized_weights must be 'auto' or 'dense', got {self.quantized_weights!r}")
        if self.quantized_activations not in ("fp32", "int8"):
            raise ConfigError(f"quantized_activations must be 'fp32' or 'int8', got {self.quantized_activations!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not self.enable_chunked_prefill and self.max_model_len and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")

    def _check_lora(self) -> None:
        modules = self.lora_modules
        if modules is not None:
            if isinstance(modules, dict):
                modules = tuple(sorted(modules.items()))
            if not modules or not all(isinstance(n, str) and n and isinstance(p, str) and p for n, p in modules):
                raise ConfigError(f"lora_modules must map adapter names to directories, got {self.lora_modules!r}")
            object.__setattr__(self, "lora_modules", tuple(modules))
        for name in ("max_loras", "max_cpu_loras", "max_lora_rank"):
            value = getattr(self, name)
            if type(value) is not int or value < (1 if name == "max_lora_rank" else 0):
                raise ConfigError(f"{name} must be an integer >= {1 if name == 'max_lora_rank' else 0}, got {value!r}")
        names = [n for n, _ in modules or ()]
        if self.max_cpu_loras and self.max_cpu_loras < max(self.max_loras, len(names)):
            raise ConfigError(f"max_cpu_loras {self.max_cpu_loras} must be >= max_loras {self.max_loras} and >= the "
                              f"{len(names)} lora_modules (every loaded adapter is held in host memory)")
        pinned = self.pinned_loras
        if pinned is not None:
            if isinstance(pinned, str) or not all(isinstance(n, str) for n in pinned):
                raise ConfigError(f"pinned_loras must be a list of adapter names, got {pinned!r}")
            unknown = sorted(set(pinned) - set(names))
            if unknown:
                raise ConfigError(f"pinned_loras {unknown} are not lora_modules ({names})")
            object.__setattr__(self, "pinned_loras", tuple(sorted(set(pinned))))
            slots = self.lora_slots
            if len(self.pinned_loras) > slots or (len(self.pinned_loras) == slots < len(names)):
                raise ConfigError(f"{len(self.pinned_loras)} pinned_loras leave no slot of max_loras {slots} for the "
                                  "other adapters")
        if self.lora_dtype not in LORA_DTYPES:
            raise ConfigError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}")

    @property
    def lora_slots(self) -> int:
        """Device slots for LoRA adapters (0: no LoRA): ``max_loras``, or one per lora_modules entry."""
        return self.max_loras or len(self.lora_modules or ())

    @property
    def lora_cpu_slots(self) -> int:
        """Adapters that may be loaded at once (host memory): ``max_cpu_loras``, or vLLM's default."""
        return self.max_cpu_loras or max(self.lora_slots, len(self.lora_modules or ()))

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)
