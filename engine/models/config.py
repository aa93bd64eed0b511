"""Configuration: small frozen dataclasses, validated on construction, passed down explicitly.

``ModelConfig`` is what the checkpoint says (parsed once, from config.json or a GGUF file's metadata:
engine/loading/checkpoint.py picks the format); ``EngineConfig`` (engine/config.py) is how we run it. Derived runtime
values (number of KV blocks actually allocated, the resolved dtype) live on the objects that own them (the model
runner), never written back here.

Reading config.json — the rule (``ModelConfig.from_hf_dict``; each clause is tested both ways):

1. A field that changes the model's arithmetic is either implemented or refused with a ``ModelLoadError``
   that names the field and its value. Refused today: an activation other than SiLU, partial rotary
   embeddings outside Phi-3 (engine/models/config_rope.py), RoPE types other than default / linear / llama3 / longrope,
   per-layer-type RoPE that differs
   between layers, layer types other than full and sliding attention, ``quantization_config`` methods and
   settings outside engine/models/config_quant.py's (GPTQ, AWQ, compressed-tensors pack-quantized), and the fields of other families that a config must not carry with a non-neutral value (logit
   soft-capping, QK norm outside Qwen3, µP multipliers, experts outside the MoE architectures of
   engine/models/config_moe.py, bidirectional attention, ...).
2. Fields that moved between transformers generations are read in every spelling: ``rope_parameters``
   (transformers >= 5; flat, or nested per layer type) and ``rope_theta`` + ``rope_scaling`` (< 5);
   ``dtype`` and ``torch_dtype``. One ``ModelConfig`` comes out, whichever form the file used. When a file
   carries both spellings they must agree: a conflict is a ``ModelLoadError`` (we cannot know which one
   the authors meant, and guessing is how a server returns wrong tokens with HTTP 200).
3. Fields that do not change the math (special-token ids, ``use_cache``, ``initializer_range``,
   ``attention_dropout``, ``pretraining_tp``, ``transformers_version``, ...) and fields we do not know
   are ignored.
4. What the file leaves out takes transformers' default for that architecture.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.models.config_gemma import (
    GELU_TANH,
    GEMMA_ARCHITECTURES,
    GemmaFields,
    gemma3_rope_sources,
    gemma_layer_types,
    read_gemma,
)
from engine.models.config_moe import MOE_ARCHITECTURES, MoeFields, read_moe
from engine.models.config_quant import QuantFields, read_quantization
from engine.models.config_rope import ROPE_TYPES, read_rope

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", *MOE_ARCHITECTURES, *GEMMA_ARCHITECTURES)
# Architectures whose sliding window is Qwen2's: on when ``use_sliding_window``, for layers from ``max_window_layers`` on.
_QWEN_LAYOUT = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MISTRAL_LAYOUT = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")  # the window, if any, on every layer
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
LAYER_TYPES = ("full_attention", "sliding_attention")

# transformers' defaults per architecture, for fields a config.json may leave out.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "num_key_value_heads": None},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096,
                         "max_window_layers": 28},
    "MistralForCausalLM": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "sliding_window": 4096},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128,
                         "sliding_window": 4096, "max_window_layers": 28},
    "MixtralForCausalLM": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5},
    "Qwen2MoeForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 16},
    "Qwen3MoeForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 4},
    "Phi3ForCausalLM": {"max_position_embeddings": 4096, "num_key_value_heads": None, "rms_norm_eps": 1e-5},
    "Gemma2ForCausalLM": {"max_position_embeddings": 8192, "num_key_value_heads": 4, "head_dim": 256,
                          "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096, "query_pre_attn_scalar": 256,
                          "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "tie_word_embeddings": True},
    "Gemma3ForCausalLM": {"max_position_embeddings": 131072, "num_key_value_heads": 4, "head_dim": 256,
                          "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096, "query_pre_attn_scalar": 256,
                          "tie_word_embeddings": True},
}
_GEMMA_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")  # read_gemma2's
_ROPE_THETA_DEFAULT = {"MixtralForCausalLM": 1e6, "Gemma3ForCausalLM": 1e6}  # transformers' default when the file gives none (else 10,000)

# Fields of other model families that change the math; a Llama / Qwen2 / Mistral config may only carry them
# with the neutral value. (transformers' Llama would ignore them: the checkpoint is then not what it claims.)
_FOREIGN_MATH_FIELDS: dict[str, tuple[Any, ...]] = {
    "attn_logit_softcapping": (None,), "final_logit_softcapping": (None,), "query_pre_attn_scalar": (None,),
    "use_qk_norm": (None, False), "qk_layernorm": (None, False), "qk_norm": (None, False),
    "embedding_multiplier": (None, 1), "residual_multiplier": (None, 1), "attention_multiplier": (None,),
    "logits_scaling": (None, 1), "logit_scale": (None, 1), "scale_emb": (None, 1),
    "num_experts": (None, 0), "num_local_experts": (None, 0), "use_bidirectional_attention": (None, False),
    "clip_qkv": (None,), "attention_chunk_size": (None,), "no_rope_layers": (None,),
}
_SILU = ("silu", "swish")
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
    rope_type: str = "default"
    rope_params: tuple[tuple[str, Any], ...] = ()  # the type's parameters (factor, ...), frozen as sorted items
    rope_freq_factors: tuple[float, ...] = ()  # GGUF ``rope_freqs``: per-frequency divisors (Llama 3.1 scaling)
    partial_rotary_factor: float = 1.0  # RoPE on the first ``rotary_dim`` dims of each head (Phi-4-mini: 0.75)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's dims on q and k, after the projection, before RoPE
    moe: MoeFields = MoeFields()  # experts (engine/models/config_moe.py); num_experts 0: a dense model
    gemma: GemmaFields = GemmaFields()  # Gemma's departures (engine/models/config_gemma.py); all off elsewhere
    rope_local: tuple = ()  # Gemma 3: (rope_type, rope_theta, rope_params) of the sliding layers; () = as the others
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: full_attention | sliding_attention; () = all alike
    checkpoint_dtype: str = "float32"
    quantization: QuantFields | None = None  # quantization_config (engine/models/config_quant.py); None: float
    model_id: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ModelLoadError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {self.num_heads} not a multiple of num_key_value_heads {self.num_kv_heads}")
        if self.rope_type not in ROPE_TYPES:
            raise ModelLoadError(f"unsupported rope_type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        missing = [k for k in ROPE_TYPES[self.rope_type][0] if k not in self.rope_params_dict]
        if missing:
            raise ModelLoadError(f"rope_type {self.rope_type!r} needs {', '.join(missing)}")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ModelLoadError(f"partial_rotary_factor={self.partial_rotary_factor!r} gives rotary_dim "
                                 f"{self.rotary_dim} of head_dim {self.head_dim}: it must be in (0, 1] and give an "
                                 "even rotary_dim >= 2")
        for key in ("short_factor", "long_factor"):
            given = self.rope_params_dict.get(key)
            if given is not None and (not isinstance(given, tuple) or len(given) != self.rotary_dim // 2):
                got = f"{len(given)}" if isinstance(given, tuple) else repr(given)
                raise ModelLoadError(f"rope {key} must list {self._rotary_dim_origin()} / 2 = {self.rotary_dim // 2} "
                                     f"factors, got {got}")
        if self.rope_freq_factors and len(self.rope_freq_factors) != self.head_dim // 2:  # GGUF: whole-head RoPE
            raise ModelLoadError(f"rope_freqs has {len(self.rope_freq_factors)} factors, head_dim {self.head_dim} needs "
                                 f"{self.head_dim // 2}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ModelLoadError(f"sliding_window must be a positive integer or null, got {self.sliding_window!r}")
        if not self.layer_types:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            object.__setattr__(self, "layer_types", (kind,) * self.num_layers)
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ModelLoadError(f"layer_types must hold {self.num_layers} entries of {LAYER_TYPES}")

    @property
    def rope_params_dict(self) -> dict[str, Any]:
        return dict(self.rope_params)

    @property
    def longrope_original_len(self) -> int | None:
        """LongRoPE's pre-training length, past which a request takes the long factors (engine/request.py
        ``admit_rope_factors``); None for every other RoPE type."""
        if self.rope_type != "longrope":
            return None
        return int(self.rope_params_dict["original_max_position_embeddings"])

    @property
    def rotary_dim(self) -> int:
        """The dims of each q/k head RoPE rotates (the first ones; the rest pass through): transformers' rule."""
        return int(self.head_dim * self.partial_rotary_factor)

    def _rotary_dim_origin(self) -> str:
        if self.partial_rotary_factor == 1.0:
            return "head_dim"
        return f"rotary_dim (int(head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor}))"

    def local_rope_config(self) -> ModelConfig:
        """This config with the sliding layers' RoPE (Gemma 3's ``rope_local``) as its RoPE."""
        rope_type, theta, params = self.rope_local
        return dataclasses.replace(self, rope_type=rope_type, rope_theta=theta, rope_params=params, rope_local=())

    def layer_sliding_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (None: it attends to the whole sequence)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], model_id: str = "") -> ModelConfig:
        """Parse a config.json by the rule in the module docstring."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelLoadError("config.json has no 'architectures' entry")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        cfg = {**_ARCH_DEFAULTS[arch], **cfg}
        _refuse_unimplemented(cfg, arch)
        hidden, num_heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
        num_layers, max_pos = _int(cfg, "num_hidden_layers"), _int(cfg, "max_position_embeddings")
        vocab, inter = _int(cfg, "vocab_size"), _int(cfg, "intermediate_size")
        layer_types, window = _attention_layout(cfg, arch, num_layers)
        rope_local = ()
        if arch == "Gemma3ForCausalLM":  # the sliding layers have a RoPE of their own
            glob, local = gemma3_rope_sources(cfg)
            rope_type, rope_theta, rope_params, partial = read_rope(glob, ("full_attention",), max_pos, 1e6)
            rope_local = read_rope(local, ("sliding_attention",), max_pos, 1e4)[:3]
            rope_local = () if rope_local == (rope_type, rope_theta, rope_params) else rope_local
        else:
            phi3 = arch == "Phi3ForCausalLM"
            rope_type, rope_theta, rope_params, partial = read_rope(cfg, layer_types, max_pos,
                                                                     _ROPE_THETA_DEFAULT.get(arch, 1e4),
                                                                     legacy_longrope=phi3, partial_rotary=phi3)
        llama_bias = arch in ("LlamaForCausalLM", *_QK_NORM) and bool(cfg.get("attention_bias", False))
        qwen_bias = arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True)))
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=_int(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") else num_heads,
            head_dim=_int(cfg, "head_dim") if cfg.get("head_dim") else hidden // num_heads,
            intermediate_size=inter,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_params=rope_params,
            partial_rotary_factor=partial,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qwen_bias or llama_bias,
            o_proj_bias=llama_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in _QK_NORM,
            moe=read_moe(cfg, arch, num_layers) if arch in MOE_ARCHITECTURES else MoeFields(),
            gemma=read_gemma(cfg) if arch in GEMMA_ARCHITECTURES else GemmaFields(),
            rope_local=rope_local,
            sliding_window=window,
            layer_types=layer_types,
            checkpoint_dtype=_read_dtype(cfg),
            quantization=read_quantization(cfg),
            model_id=model_id,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no config.json (is this a Hugging Face checkpoint directory?)")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: invalid JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{path}: the top level must be an object")
        return cls.from_hf_dict(cfg, model_id=Path(model_dir).resolve().name)


def _int(cfg: dict[str, Any], key: str) -> int:
    if key not in cfg:
        raise ModelLoadError(f"config.json is missing required field {key!r}")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ModelLoadError(f"config.json field {key!r} must be an integer, got {value!r}")
    return int(value)


def _refuse_unimplemented(cfg: dict[str, Any], arch: str) -> None:
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in _SILU and not (arch in GEMMA_ARCHITECTURES and act in GELU_TANH):  # Gemma's: config_gemma.py
        raise ModelLoadError(f"hidden_act {act!r} is not supported (duet implements SiLU-gated MLPs only)")
    for name, neutral in _FOREIGN_MATH_FIELDS.items():
        if arch in MOE_ARCHITECTURES and name in ("num_experts", "num_local_experts"):
            continue  # read by engine/models/config_moe.py
        if arch in GEMMA_ARCHITECTURES and name in _GEMMA_FIELDS:
            continue
        if name in cfg and cfg[name] not in neutral:
            raise ModelLoadError(f"{name}={cfg[name]!r} changes the model's math and duet does not implement it")


def _attention_layout(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """(layer types, sliding window) the way transformers' modeling code for ``arch`` applies them."""
    given = cfg.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or len(given) != num_layers:
            raise ModelLoadError(f"layer_types must be a list of {num_layers} entries, got {given!r}")
        unknown = sorted({t for t in given if t not in LAYER_TYPES})
        if unknown:
            raise ModelLoadError(f"layer_types {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})")
    if arch in _QWEN_LAYOUT:
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        if given is None:  # Qwen2Config / Qwen3Config: layers from max_window_layers on slide
            first = _int(cfg, "max_window_layers")
            given = ["sliding_attention" if window is not None and i >= first else "full_attention"
                     for i in range(num_layers)]
    elif arch in GEMMA_ARCHITECTURES:
        window = cfg.get("sliding_window")
        given = given if given is not None else gemma_layer_types(cfg, arch, num_layers)
    elif arch in _MISTRAL_LAYOUT:
        window = cfg.get("sliding_window")
        uniform = "sliding_attention" if window else "full_attention"  # Mistral applies its window to every layer
        if given is not None and any(t != uniform for t in given):
            raise ModelLoadError(f"layer_types mixes attention kinds, which {arch} does not do "
                                 f"(sliding_window={window!r}); this is a different model family")
        given = [uniform] * num_layers
    elif arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        # transformers' generations disagree on which layers of these slide (and whether the mask follows):
        # no released checkpoint uses it, so a file asking for it is refused rather than guessed at
        if cfg.get("use_sliding_window") or (given is not None and any(t != "full_attention" for t in given)):
            raise ModelLoadError(f"use_sliding_window / sliding layer_types in a {arch} config are not supported")
        window, given = None, ["full_attention"] * num_layers
    else:  # Llama has no sliding window (transformers' Llama ignores a sliding_window field)
        window = None
        if given is not None and any(t != "full_attention" for t in given):
            raise ModelLoadError("layer_types asks for sliding attention, which LlamaForCausalLM does not do")
        given = ["full_attention"] * num_layers
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"sliding_window must be a positive integer or null, got {window!r}")
    if window is None:
        given = ["full_attention"] * num_layers
    return tuple(given), window


def _read_dtype(cfg: dict[str, Any]) -> str:
    new, old = cfg.get("dtype"), cfg.get("torch_dtype")
    if new is not None and old is not None and new != old:
        raise ModelLoadError(f"config.json gives dtype={new!r} and torch_dtype={old!r}")
    value = new if new is not None else old
    if value is not None and not isinstance(value, str):
        raise ModelLoadError(f"dtype must be a string, got {value!r}")
    return str(value or "float32")

