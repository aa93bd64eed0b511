"""A GGUF file's metadata as a ``ModelConfig``: the llama.cpp architectures duet runs, and what each one's keys
and tensors mean, read the way llama.cpp (the format's owner) reads them. engine/loading/gguf.py reads the file, hands
the metadata here (:func:`gguf_model_config`) and maps tensor names with :func:`layer_tensors`.

Architectures (llama.cpp's name → the transformers class that runs the same math):
- ``llama``, ``qwen2``, ``qwen3`` (per-head q/k norms ``attn_q_norm`` / ``attn_k_norm``; the head size from
  ``attention.key_length``): dense models.
- ``qwen3moe``, ``qwen2moe``: every block sparse, ``ffn_gate_inp`` the router, each of ``ffn_{gate,up,down}_exps``
  every expert's projection in one 3-D tensor; top-k renormalised for qwen3moe only (llama.cpp's graphs);
  qwen2moe adds the shared expert ``ffn_*_shexp`` and its gate.
- ``phi3``: q/k/v fused in ``attn_qkv``, gate and up in ``ffn_up`` (gate first, as Phi-3's ``gate_up_proj``).
  LongRoPE as llama.cpp's converter stores it: the factor sets as the tensors ``rope_factors_short`` /
  ``rope_factors_long``, the pre-training length ``rope.scaling.original_context_length`` (which set a
  request runs: engine/request.py ``admit_rope_factors``), the cos/sin scale ``rope.scaling.attn_factor``
  (absent: 1, as in llama.cpp). ``rope.dimension_count`` below the head size is Phi-4-mini's partial rotary
  (RoPE on the first dims of each head, ``ModelConfig.partial_rotary_factor``; llama.cpp's n_rot).
  ``attention.sliding_window`` (0: none) applies to every layer, as the
  checkpoint's own transformers model applies it — llama.cpp currently disables Phi-3's window and
  transformers' GGUF loader drops it, so on prompts longer than the window those two differ from the model
  the file was converted from; we do not.
- ``gemma2``, ``gemma3`` (text): Gemma's departures (engine/models/config_gemma.py). The norms are stored as 1 + w
  (engine/loading/gguf.py hands the loader w, as transformers' GGUF loader does). Soft-caps from
  ``attn_logit_softcapping`` / ``final_logit_softcapping`` (Gemma 2 without them: llama.cpp's 50 and 30;
  Gemma 3 has no attention cap, and a final cap of 0 means none); the window ``attention.sliding_window``
  (Gemma 2 without it: 4,096) on the even layers (Gemma 2) or 5 layers of every 6 (Gemma 3; none when 0 or
  absent); Gemma 3's sliding layers on their own unscaled RoPE of base ``rope.freq_base_swa`` (else 10,000),
  ``rope.scaling.*`` scaling the global layers only. A GGUF has no ``query_pre_attn_scalar``: llama.cpp
  scales the scores by head_dim ** -0.5, by (hidden / heads) ** -0.5 for the 27B models (46 / 62 layers),
  and so do we (transformers' GGUF loader takes its config default, 256, for every size).

Every ``<arch>.*`` key must be one that architecture's rules read (:data:`_KNOWN_KEYS` plus
:data:`_ARCH_KEYS`); any other is a hyperparameter of a variant we do not implement (a window where the
architecture has none, soft-capping, ALiBi, ...) and the file is refused naming it. RoPE: ``rope.freq_base``;
``rope.dimension_count`` the whole head (less: phi3 only); ``rope.scaling.type`` none or linear (longrope:
phi3). Llama-3.1-style files carry their scaling as a ``rope_freqs`` tensor of per-frequency divisors, applied
as llama.cpp applies them (``ModelConfig.rope_freq_factors``).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from engine.errors import ModelLoadError
from engine.models.config import ModelConfig
from engine.models.config_gemma import GemmaFields
from engine.models.config_moe import MoeFields

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# every block sparse; whether the top-k weights are renormalised (llama.cpp's graphs for these architectures)
_MOE = {"qwen3moe": True, "qwen2moe": False}
_QK_NORM = ("qwen3", "qwen3moe", "gemma3")
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's test for the size that scales by hidden / heads
_KNOWN_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.finetuned",
    "expert_count", "expert_used_count",  # only as 0 outside _MOE (checked below)
    "expert_feed_forward_length", "expert_shared_feed_forward_length",  # _MOE only (shared: qwen2moe)
}
_ARCH_KEYS = {
    "phi3": {"attention.sliding_window", "rope.scaling.attn_factor"},
    "gemma2": {"attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping"},
    "gemma3": {"attention.sliding_window", "final_logit_softcapping", "rope.freq_base_swa"},
}
# GGUF tensor name (after blk.N.) -> HF name (after model.layers.N.)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # every expert in one 3-D tensor ([E, I, H] / [E, H, I]) and the router
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_inp": "mlp.gate",
    # Qwen2-MoE's shared expert and its gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER_TENSORS = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                       "gemma2": _GEMMA_NORMS, "gemma3": _GEMMA_NORMS}
ROPE_FREQS, ROPE_SHORT, ROPE_LONG = "rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight"
CONFIG_TENSORS = (ROPE_FREQS, ROPE_SHORT, ROPE_LONG)  # vectors of the config (RoPE), not weights


def layer_tensors(gguf_arch: str) -> dict[str, str]:
    """GGUF layer tensor name -> HF name, for one architecture."""
    return {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(gguf_arch, {})}


def gguf_model_config(meta: Mapping[str, Any], tensor_names: Collection[str],
                      vectors: Mapping[str, tuple[float, ...]], *, source: str, checkpoint_dtype: str,
                      model_id: str) -> ModelConfig:
    """``vectors``: the file's :data:`CONFIG_TENSORS`, dequantized."""
    return _Reader(meta, set(tensor_names), vectors, source).model_config(checkpoint_dtype, model_id)


class _Reader:
    def __init__(self, meta: Mapping[str, Any], tensor_names: set[str], vectors: Mapping[str, tuple[float, ...]],
                 source: str) -> None:
        self.meta, self.tensor_names, self.vectors, self.source = meta, tensor_names, vectors, source
        self.arch = meta["general.architecture"]
        self.prefix = f"{self.arch}."

    def get(self, key: str, default: Any = ModelLoadError) -> Any:
        if key in self.meta:
            return self.meta[key]
        if default is ModelLoadError:
            raise ModelLoadError(f"{self.source}: GGUF metadata has no {key!r}")
        return default

    def key(self, name: str, default: Any = ModelLoadError) -> Any:
        return self.get(self.prefix + name, default)

    def refuse(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: {message}")

    def model_config(self, checkpoint_dtype: str, model_id: str) -> ModelConfig:
        known = _KNOWN_KEYS | _ARCH_KEYS.get(self.arch, set())
        unknown = sorted(k for k in self.meta if k.startswith(self.prefix) and k[len(self.prefix):] not in known)
        if unknown:
            shown = ", ".join(f"{k}={self.meta[k]!r}" for k in unknown[:4])
            raise self.refuse(f"GGUF metadata {shown} changes the model in a way duet does not implement (or does "
                              "not know)")
        hidden, num_heads = int(self.key("embedding_length")), int(self.key("attention.head_count"))
        num_kv_heads = self.key("attention.head_count_kv", num_heads)
        if isinstance(num_kv_heads, list):  # per-layer counts
            if len(set(num_kv_heads)) != 1:
                raise self.refuse(f"per-layer KV head counts {num_kv_heads} are not supported")
            num_kv_heads = num_kv_heads[0]
        head_dim = int(self.key("attention.key_length", hidden // num_heads))
        if int(self.key("attention.value_length", head_dim)) != head_dim:
            raise self.refuse(f"key_length {head_dim} != value_length {self.key('attention.value_length')}")
        num_layers, max_pos = int(self.key("block_count")), int(self.key("context_length"))
        rope = self._rope(head_dim, max_pos)
        layer_types, window = self._attention_layout(num_layers)
        vocab = self.key("vocab_size", None) or len(self.get("tokenizer.ggml.tokens"))
        has = self.tensor_names.__contains__
        return ModelConfig(
            architecture=ARCHITECTURES[self.arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=head_dim,
            intermediate_size=int(self.key("feed_forward_length")),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(self.key("attention.layer_norm_rms_epsilon")),
            rope_type=rope[0],
            rope_theta=rope[1],
            rope_params=rope[2],
            rope_freq_factors=self.vectors.get(ROPE_FREQS, ()),
            partial_rotary_factor=self._partial_rotary_factor(head_dim),
            tie_word_embeddings=not has("output.weight"),
            qkv_bias=has("blk.0.attn_q.bias") or has("blk.0.attn_qkv.bias"),
            o_proj_bias=has("blk.0.attn_output.bias"),
            mlp_bias=has("blk.0.ffn_down.bias"),
            qk_norm=self.arch in _QK_NORM,
            moe=self._moe(num_layers),
            gemma=self._gemma(hidden, num_heads, head_dim, num_layers),
            rope_local=self._rope_local(rope),
            sliding_window=window,
            layer_types=layer_types,
            checkpoint_dtype=checkpoint_dtype,
            model_id=model_id,
        )

    def _moe(self, num_layers: int) -> MoeFields:
        if self.arch != "qwen2moe" and self.key("expert_shared_feed_forward_length", 0):
            raise self.refuse(f"{self.prefix}expert_shared_feed_forward_length: {self.arch!r} has no shared expert")
        if self.arch not in _MOE:
            for key in ("expert_count", "expert_used_count", "expert_feed_forward_length"):
                if self.key(key, 0):
                    raise self.refuse(f"{self.prefix}{key}={self.key(key)} (mixture of experts) is not supported "
                                      f"for GGUF architecture {self.arch!r}")
            return MoeFields()
        experts, top_k = int(self.key("expert_count")), int(self.key("expert_used_count"))
        if not 1 <= top_k <= experts:
            raise self.refuse(f"expert_used_count {top_k} with expert_count {experts}")
        shared = int(self.key("expert_shared_feed_forward_length")) if self.arch == "qwen2moe" else 0
        return MoeFields(experts, top_k, int(self.key("expert_feed_forward_length")), norm_topk_prob=_MOE[self.arch],
                         shared_expert_intermediate_size=shared, sparse_layers=tuple(range(num_layers)))

    def _partial_rotary_factor(self, head_dim: int) -> float:
        """Phi-4-mini's RoPE on the first ``rope.dimension_count`` dims of each head (llama.cpp's n_rot)."""
        rotary_dim = int(self.key("rope.dimension_count", head_dim))
        if rotary_dim == head_dim:
            return 1.0
        factor = rotary_dim / head_dim
        if self.arch != "phi3" or int(head_dim * factor) != rotary_dim:
            raise self.refuse(f"{self.prefix}rope.dimension_count={rotary_dim} < head dim {head_dim} (partial rotary) "
                              "is supported in 'phi3' files only")
        return factor

    def _rope(self, head_dim: int, max_pos: int) -> tuple[str, float, tuple]:
        """(type, theta, parameters) of every layer (Gemma 3: of its global layers)."""
        theta = float(self.key("rope.freq_base", 10000.0))
        scaling = self.key("rope.scaling.type", "none")
        factors = [name for name in (ROPE_SHORT, ROPE_LONG) if name in self.vectors]
        if factors or scaling == "longrope":
            if self.arch != "phi3" or len(factors) != 2 or scaling not in ("none", "longrope"):
                raise self.refuse(f"LongRoPE (rope.scaling.type={scaling!r}, tensors {factors}) is supported in "
                                  "'phi3' files with both rope_factors_short and rope_factors_long")
            original = int(self.key("rope.scaling.original_context_length", max_pos))
            params = {"short_factor": self.vectors[ROPE_SHORT], "long_factor": self.vectors[ROPE_LONG],
                      "original_max_position_embeddings": original,
                      "attention_factor": float(self.key("rope.scaling.attn_factor", 1.0))}
            return "longrope", theta, tuple(sorted(params.items()))
        if scaling == "linear":
            return "linear", theta, (("factor", float(self.key("rope.scaling.factor"))),)
        if scaling != "none":
            raise self.refuse(f"{self.prefix}rope.scaling.type={scaling!r} is not supported (none, linear)")
        return "default", theta, ()

    def _rope_local(self, rope: tuple[str, float, tuple]) -> tuple:
        """Gemma 3's sliding layers: their own base, unscaled (() when that is the global RoPE)."""
        if self.arch != "gemma3":
            return ()
        local = ("default", float(self.key("rope.freq_base_swa", 10000.0)), ())
        return () if local == rope else local

    def _attention_layout(self, num_layers: int) -> tuple[tuple[str, ...], int | None]:
        """(layer types, window): Gemma's patterns as llama.cpp lays them out, Phi-3's window on every layer."""
        default = {"gemma2": 4096, "gemma3": 0, "phi3": 0}.get(self.arch)
        if default is None:
            return (), None
        window = self.key("attention.sliding_window", default)
        smallest = 1 if self.arch == "gemma2" else 0  # 0: no window (Gemma 2 always slides: llama.cpp would mask all)
        if isinstance(window, bool) or not isinstance(window, int) or window < smallest:
            raise self.refuse(f"{self.prefix}attention.sliding_window={window!r} is not a window")
        if not window:
            return ("full_attention",) * num_layers, None
        pattern = {"gemma2": 2, "gemma3": 6}.get(self.arch)  # every pattern-th layer attends to everything
        return tuple("sliding_attention" if pattern is None or (i + 1) % pattern else "full_attention"
                     for i in range(num_layers)), window

    def _gemma(self, hidden: int, num_heads: int, head_dim: int, num_layers: int) -> GemmaFields:
        if self.arch not in _GEMMA_27B_LAYERS:
            return GemmaFields()
        scalar = hidden // num_heads if num_layers == _GEMMA_27B_LAYERS[self.arch] else head_dim
        return GemmaFields(embed_scale=True, norm_plus_one=True, sandwich_norms=True, gelu_tanh=True,
                           query_pre_attn_scalar=float(scalar),
                           attn_logit_softcapping=self._cap("attn_logit_softcapping", 50.0),
                           final_logit_softcapping=self._cap("final_logit_softcapping", 30.0))

    def _cap(self, name: str, gemma2_default: float) -> float | None:
        value = self.key(name, gemma2_default if self.arch == "gemma2" else None)
        if value is None or value == 0:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise self.refuse(f"{self.prefix}{name}={value!r} is not a soft-cap")
        return float(value)
