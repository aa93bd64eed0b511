"""GGUF files (llama.cpp's format) as duet checkpoints: model config, weights and tokenizer from one file.

    ckpt = GGUFCheckpoint("SmolLM2-135M-Instruct.Q4_1.gguf")
    ckpt.model_config()        # -> ModelConfig, from the file's metadata
    ckpt.tokenizer()           # -> Tokenizer (engine/gguf_tokenizer.py): vocabulary, merges, chat template
    ckpt.tensors()             # -> (HF tensor name, float32 numpy array), dequantized

No torch here (the router reads configs and tokenizers too); parsing and dequantization are the ``gguf``
package's (every tensor type it can dequantize: F32, F16, BF16, Q4_0 … Q8_0, the K-quants, the IQ types).
The loader turns the arrays into the serving dtype.

Being exact about what the file says:
- Architectures: ``llama`` (→ LlamaForCausalLM), ``qwen2`` (→ Qwen2ForCausalLM) and ``qwen3`` (→
  Qwen3ForCausalLM: per-head q/k norms ``attn_q_norm`` / ``attn_k_norm``; its head size from
  ``attention.key_length``), ``qwen3moe`` (→ Qwen3MoeForCausalLM: every block sparse, ``ffn_gate_inp`` the
  router, each of ``ffn_{gate,up,down}_exps`` every expert's projection in one 3-D tensor; top-k weights
  renormalised, as llama.cpp runs it) and ``qwen2moe`` (→ Qwen2MoeForCausalLM: the same plus the shared expert
  ``ffn_*_shexp`` and its gate; weights not renormalised). llama.cpp's converter interleaves the rows of Llama's Q and K projections (weights
  and biases) for its rotary kernel; we undo it exactly as transformers does (:func:`unpermute_rows`). Qwen
  files are not permuted.
- Every ``<arch>.*`` metadata key must be one we understand (:data:`_KNOWN_ARCH_KEYS`); any other is a
  hyperparameter of a variant we do not implement (sliding window, soft-capping, experts, ALiBi, ...) and
  the file is refused with a ``ModelLoadError`` naming it. ``general.*`` keys are descriptive and ignored.
- RoPE: ``rope.freq_base``; ``rope.dimension_count`` must be the whole head (no partial rotary);
  ``rope.scaling.type`` none or linear. Llama-3.1-style files carry their scaling as a ``rope_freqs``
  tensor of per-frequency divisors, applied as llama.cpp applies them (``ModelConfig.rope_freq_factors``).
- dtype "auto": float16 / bfloat16 for files stored in those types, float32 otherwise (a quantized weight
  dequantizes exactly into float32).
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import ModelConfig, checkpoint_name
from engine.config_moe import MoeFields
from engine.errors import ModelLoadError

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM"}
# every block sparse; whether the top-k weights are renormalised (llama.cpp's graphs for these architectures)
_MOE = {"qwen3moe": True, "qwen2moe": False}
_KNOWN_ARCH_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.finetuned",
    "expert_count", "expert_used_count",  # only as 0 outside _MOE (checked below)
    "expert_feed_forward_length", "expert_shared_feed_forward_length",  # _MOE only (shared: qwen2moe)
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
_ROPE_FREQS = "rope_freqs.weight"
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleave (``convert_hf_to_gguf.LlamaModel.permute``) on a weight or bias."""
    dim = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """One GGUF file, memory-mapped. Metadata is read once; tensors are dequantized one at a time."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # a truncated or foreign file: gguf raises ValueError / struct errors
            raise ModelLoadError(f"{self.path}: cannot read GGUF file: {e}") from e
        self.metadata: dict[str, Any] = {}
        for name, field in self._reader.fields.items():
            if name.startswith("GGUF."):
                continue
            try:
                self.metadata[name] = field.contents()
            except Exception as e:
                raise ModelLoadError(f"{self.path}: metadata {name!r} cannot be read: {e}") from e
        self.gguf_arch = self._get("general.architecture")
        if self.gguf_arch not in _ARCHITECTURES:
            raise ModelLoadError(f"{self.path}: GGUF architecture {self.gguf_arch!r} is not supported "
                                 f"(supported: {', '.join(_ARCHITECTURES)})")
        self.architecture = _ARCHITECTURES[self.gguf_arch]
        self.tensor_names = [t.name for t in self._reader.tensors]

    def _get(self, key: str, default: Any = ModelLoadError) -> Any:
        if key in self.metadata:
            return self.metadata[key]
        if default is ModelLoadError:
            raise ModelLoadError(f"{self.path}: GGUF metadata has no {key!r}")
        return default

    def _arch(self, key: str, default: Any = ModelLoadError) -> Any:
        return self._get(f"{self.gguf_arch}.{key}", default)

    # ------------------------------------------------------------------------------------------ config

    def model_config(self) -> ModelConfig:
        prefix = f"{self.gguf_arch}."
        unknown = sorted(k for k in self.metadata if k.startswith(prefix) and k[len(prefix):] not in _KNOWN_ARCH_KEYS)
        if unknown:
            shown = ", ".join(f"{k}={self.metadata[k]!r}" for k in unknown[:4])
            raise ModelLoadError(f"{self.path}: GGUF metadata {shown} changes the model in a way duet does not "
                                 "implement (or does not know)")
        moe = MoeFields()
        if self.gguf_arch in _MOE:
            experts, top_k = int(self._arch("expert_count")), int(self._arch("expert_used_count"))
            if not 1 <= top_k <= experts:
                raise ModelLoadError(f"{self.path}: expert_used_count {top_k} with expert_count {experts}")
            shared = int(self._arch("expert_shared_feed_forward_length")) if self.gguf_arch == "qwen2moe" else 0
            moe = MoeFields(experts, top_k, int(self._arch("expert_feed_forward_length")),
                            norm_topk_prob=_MOE[self.gguf_arch], shared_expert_intermediate_size=shared,
                            sparse_layers=tuple(range(int(self._arch("block_count")))))
        if self.gguf_arch != "qwen2moe" and self._arch("expert_shared_feed_forward_length", 0):
            raise ModelLoadError(f"{self.path}: {prefix}expert_shared_feed_forward_length: {self.gguf_arch!r} has "
                                 "no shared expert")
        if self.gguf_arch not in _MOE:
            for key in ("expert_count", "expert_used_count", "expert_feed_forward_length"):
                if self._arch(key, 0):
                    raise ModelLoadError(f"{self.path}: {prefix}{key}={self._arch(key)} (mixture of experts) is not "
                                         f"supported for GGUF architecture {self.gguf_arch!r}")
        hidden, num_heads = int(self._arch("embedding_length")), int(self._arch("attention.head_count"))
        num_kv_heads = self._arch("attention.head_count_kv", num_heads)
        if isinstance(num_kv_heads, list):  # per-layer counts
            if len(set(num_kv_heads)) != 1:
                raise ModelLoadError(f"{self.path}: per-layer KV head counts {num_kv_heads} are not supported")
            num_kv_heads = num_kv_heads[0]
        head_dim = int(self._arch("attention.key_length", hidden // num_heads))
        if int(self._arch("attention.value_length", head_dim)) != head_dim:
            raise ModelLoadError(f"{self.path}: key_length {head_dim} != value_length {self._arch('attention.value_length')}")
        rotary_dim = int(self._arch("rope.dimension_count", head_dim))
        if rotary_dim != head_dim:
            raise ModelLoadError(f"{self.path}: {prefix}rope.dimension_count={rotary_dim} < head dim {head_dim} "
                                 "(partial rotary) is not supported")
        rope_type, rope_params = "default", ()
        scaling = self._arch("rope.scaling.type", "none")
        if scaling == "linear":
            rope_type, rope_params = "linear", (("factor", float(self._arch("rope.scaling.factor"))),)
        elif scaling != "none":
            raise ModelLoadError(f"{self.path}: {prefix}rope.scaling.type={scaling!r} is not supported (none, linear)")
        vocab = self._arch("vocab_size", None) or len(self._get("tokenizer.ggml.tokens"))
        return ModelConfig(
            architecture=self.architecture,
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=int(self._arch("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=head_dim,
            intermediate_size=int(self._arch("feed_forward_length")),
            max_position_embeddings=int(self._arch("context_length")),
            rms_norm_eps=float(self._arch("attention.layer_norm_rms_epsilon")),
            rope_theta=float(self._arch("rope.freq_base", 10000.0)),
            rope_type=rope_type,
            rope_params=rope_params,
            rope_freq_factors=self._rope_freq_factors(),
            tie_word_embeddings="output.weight" not in self.tensor_names,
            qkv_bias="blk.0.attn_q.bias" in self.tensor_names,
            o_proj_bias="blk.0.attn_output.bias" in self.tensor_names,
            mlp_bias="blk.0.ffn_down.bias" in self.tensor_names,
            qk_norm=self.gguf_arch in ("qwen3", "qwen3moe"),
            moe=moe,
            checkpoint_dtype=self._stored_dtype(),
            model_id=checkpoint_name(self.path),
        )

    def _rope_freq_factors(self) -> tuple[float, ...]:
        """Llama 3.1-style files store their RoPE scaling as a ``rope_freqs`` tensor of per-frequency divisors."""
        import gguf

        for t in self._reader.tensors:
            if t.name == _ROPE_FREQS:
                return tuple(float(x) for x in gguf.dequantize(t.data, t.tensor_type).reshape(-1))
        return ()

    def _stored_dtype(self) -> str:
        import gguf

        types = {t.tensor_type for t in self._reader.tensors if t.name.endswith("weight") and len(t.shape) == 2}
        if types == {gguf.GGMLQuantizationType.F16}:
            return "float16"
        if types == {gguf.GGMLQuantizationType.BF16}:
            return "bfloat16"
        return "float32"

    # ------------------------------------------------------------------------------------------ tensors

    @property
    def num_bytes(self) -> int:
        return sum(int(t.n_bytes) for t in self._reader.tensors)

    def tensors(self) -> Iterator[tuple[str, np.ndarray, int]]:
        """(HF name, float32 array, bytes read from the file) per tensor, Q/K rows in HF order."""
        import gguf

        cfg = self.model_config()
        for t in self._reader.tensors:
            if t.name == _ROPE_FREQS:  # part of the config (rope_freq_factors), not a weight
                continue
            name = self.hf_name(t.name)
            try:
                array = gguf.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise ModelLoadError(f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, which the gguf "
                                     "package cannot dequantize") from None
            array = np.array(array, dtype=np.float32)  # a writable copy (F32 tensors are read-only memmap views)
            if t.name.endswith(".ffn_gate_inp_shexp.weight") and array.ndim == 1:
                array = array[None, :]  # the shared expert's gate: a [1, hidden] projection, stored as a vector
            if self.gguf_arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
                array = unpermute_rows(array, cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads)
            yield name, array, int(t.n_bytes)

    def hf_name(self, gguf_name: str) -> str:
        base, _, kind = gguf_name.rpartition(".")
        if kind not in ("weight", "bias"):
            raise ModelLoadError(f"{self.path}: unexpected tensor {gguf_name!r}")
        if base in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[base]}.{kind}"
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if m and m.group(2) in _LAYER_TENSORS:
            return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{kind}"
        raise ModelLoadError(f"{self.path}: tensor {gguf_name!r} has no place in {self.architecture}")

    # ------------------------------------------------------------------------------------------ tokenizer

    def tokenizer(self):
        from engine.gguf_tokenizer import tokenizer_from_gguf_metadata

        return tokenizer_from_gguf_metadata(self.metadata, source=str(self.path))


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """One parse per file and process (config, tokenizer and weights all read the same metadata); a file
    replaced on disk is parsed again."""
    p = Path(path).resolve()
    stat = p.stat()
    return _open_gguf(str(p), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)
