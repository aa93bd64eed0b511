"""Writing GGUF files for tests the way llama.cpp's convert_hf_to_gguf.py does, from a tiny HF checkpoint.

Tensor names, metadata keys and the Q/K row interleave (``permute``) are llama.cpp's (per architecture: its
converter's ``set_gguf_parameters``, Gemma's norms stored as 1 + w, Phi-3's LongRoPE factors as tensors); 2-D
weights are stored in the requested type (quantized with the ``gguf`` package where it can quantize; for the
K-quants, which it can only dequantize, random blocks with small scales stand in for quantized data), norms
stay F32.
``metadata`` / ``drop_metadata`` / ``extra_tensors`` make deliberately odd files for the error tests.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

_GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
              "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe",
              "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused ones
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}  # Gemma's
_GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm"}
_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
# K-quant block layouts: bytes per 256-value block, offset of the fp16 scale d, offset of the fp16 minimum
# scale dmin (None: the quants are signed), mean quant (dmin = d * mean centres the weights).
_K_QUANTS = {"Q4_K": (144, 0, 2, 7.5), "Q5_K": (176, 0, 2, 15.5), "Q6_K": (210, 208, None, 0.0)}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf.startswith(("blk.", "rope_")):  # already llama.cpp's (stacked experts, RoPE factors)
        return hf
    base, _, kind = hf.rpartition(".")
    if base == "model.embed_tokens":
        return f"token_embd.{kind}"
    if base == "model.norm":
        return f"output_norm.{kind}"
    if base == "lm_head":
        return f"output.{kind}"
    _, _, idx, rest = base.split(".", 3)
    layer = {**_LAYER, **_GEMMA_LAYER} if arch.startswith("gemma") else _LAYER
    return f"blk.{idx}.{layer[rest]}.{kind}"


def _store(name: str, w: np.ndarray, qtype: str, rng: np.random.Generator):
    """(array, raw ggml type) for one tensor."""
    if w.ndim == 1 or qtype == "F32":
        return w.astype(np.float32), gguf.GGMLQuantizationType.F32
    if qtype in _K_QUANTS:
        block_bytes, d_at, dmin_at, mean_q = _K_QUANTS[qtype]
        if w.shape[1] % 256:
            return w.astype(np.float32), gguf.GGMLQuantizationType.F32  # llama.cpp falls back likewise
        blocks = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // 256, block_bytes), dtype=np.uint8)
        d = rng.uniform(0.5, 1.0, size=blocks.shape[:2]) * 0.05 / w.shape[1] ** 0.5  # weights ~ the HF init
        for at, value in ((d_at, d), (dmin_at, d * mean_q)):
            if at is not None:
                blocks[..., at:at + 2] = value.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
        return blocks.reshape(w.shape[0], -1), getattr(gguf.GGMLQuantizationType, qtype)
    ggml_type = getattr(gguf.GGMLQuantizationType, qtype)
    return gguf.quantize(w.astype(np.float32), ggml_type), ggml_type


def write_gguf(hf_dir: str | Path, out: str | Path, qtype: str = "F32", *, pre: str = "gpt-2",
               tokenizer_model: str = "gpt2", metadata: dict | None = None, drop_metadata: tuple[str, ...] = (),
               extra_tensors: dict[str, np.ndarray] | None = None, seed: int = 0, spm: dict | None = None,
               qtype_of: dict[str, str] | None = None) -> Path:
    """``spm``: a SentencePiece vocabulary instead of the directory's tokenizer (``tokens``, ``scores``,
    ``token_type``, ``bos`` / ``eos`` / ``unk`` ids, ``chat_template``), written as llama.cpp writes one: no merges.
    ``qtype_of``: another type for the tensors whose llama.cpp name has that part (``{"attn_v": "Q6_K"}``: a
    Q4_K_M file's mix)."""
    hf_dir, out = Path(hf_dir), Path(out)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = _GGUF_ARCH[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    specials = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    kv = {
        **_arch_metadata(arch, cfg, head_dim), f"{arch}.vocab_size": len(tokens),
        "tokenizer.ggml.model": tokenizer_model, "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in specials else 1 for t in tokens], "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": bool(tok_cfg.get("add_bos_token", False)),
        "tokenizer.chat_template": tok_cfg["chat_template"],
    }
    if spm is not None:
        for key in ("tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
                    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            kv.pop(key, None)
        kv.update({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": spm["tokens"],
                   "tokenizer.ggml.scores": [float(x) for x in spm["scores"]], "tokenizer.ggml.token_type": spm["token_type"],
                   "tokenizer.ggml.bos_token_id": spm["bos"], "tokenizer.ggml.eos_token_id": spm["eos"],
                   "tokenizer.ggml.unknown_token_id": spm["unk"], "tokenizer.chat_template": spm["chat_template"],
                   f"{arch}.vocab_size": len(spm["tokens"])})
        tok_cfg = {}
    for role in ("bos", "eos", "unk", "pad"):
        if tok_cfg.get(f"{role}_token"):
            key = {"unk": "unknown", "pad": "padding"}.get(role, role)
            kv[f"tokenizer.ggml.{key}_token_id"] = vocab[tok_cfg[f"{role}_token"]]
    kv.update(metadata or {})
    for key in drop_metadata:
        kv.pop(key, None)

    writer = gguf.GGUFWriter(str(out), arch)
    for key, value in kv.items():
        _add_kv(writer, key, value)
    rng = np.random.default_rng(seed)
    weights = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    weights = {**_stack_experts(weights), **_rope_factor_tensors(arch, cfg)}
    for hf, w in weights.items():
        w = w.astype(np.float32)
        if arch.startswith("gemma") and hf == "lm_head.weight":
            continue  # llama.cpp's Gemma converters skip it (the embedding is the head)
        if arch.startswith("gemma") and hf.endswith("norm.weight"):
            w = w + np.float32(1.0)  # Gemma's RMSNorm scales by 1 + w: llama.cpp stores 1 + w
        if arch == "llama" and ".q_proj." in hf:
            w = permute(w, heads)
        elif arch == "llama" and ".k_proj." in hf:
            w = permute(w, kv_heads)
        if hf.endswith("mlp.shared_expert_gate.weight"):
            w = w.reshape(-1)  # llama.cpp stores this [1, hidden] gate as a vector
        name = gguf_name(hf, arch)
        own = [t for part, t in (qtype_of or {}).items() if f".{part}." in name]
        data, ggml_type = _store(hf, w, own[0] if own else qtype, rng)
        writer.add_tensor(name, data, raw_dtype=ggml_type)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data.astype(np.float32), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _rope(cfg: dict, layer_type: str = "full_attention") -> dict:
    """One layer type's RoPE parameters, from either generation of transformers' config.json."""
    params = cfg.get("rope_parameters") or {}
    if layer_type in params:
        params = params[layer_type] or {}
    elif set(params) <= {"full_attention", "sliding_attention"} and params:
        return {}
    merged = {**(cfg.get("rope_scaling") or {}), **params}
    if cfg.get("rope_theta") is not None:
        merged.setdefault("rope_theta", cfg["rope_theta"])
    merged.setdefault("rope_type", merged.pop("type", "default"))
    return merged


def _arch_metadata(arch: str, cfg: dict, head_dim: int) -> dict:
    """The ``<arch>.*`` keys llama.cpp's converter for ``arch`` writes."""
    rope, heads = _rope(cfg), cfg["num_attention_heads"]
    kv = {"context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
          "block_count": cfg["num_hidden_layers"], "feed_forward_length": cfg["intermediate_size"],
          "attention.head_count": heads, "attention.head_count_kv": cfg.get("num_key_value_heads") or heads,
          "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"]}
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters: no RoPE keys at all
        kv.update({"attention.key_length": head_dim, "attention.value_length": head_dim,
                   "attn_logit_softcapping": float(cfg["attn_logit_softcapping"]),
                   "final_logit_softcapping": float(cfg["final_logit_softcapping"]),
                   "attention.sliding_window": cfg["sliding_window"]})
        return {f"{arch}.{k}": v for k, v in kv.items()}
    kv["rope.freq_base"] = float(rope.get("rope_theta", 10000.0))
    if arch in ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe"):
        kv["rope.dimension_count"] = head_dim
    if arch == "phi3":  # Phi3MiniModel: int(partial_rotary_factor * hidden) // heads
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        kv["rope.dimension_count"] = int(partial * cfg["hidden_size"]) // heads
    if cfg.get("head_dim") and arch != "phi3":  # as llama.cpp's converter writes an explicit head size
        kv["attention.key_length"] = kv["attention.value_length"] = head_dim
    if arch in ("qwen3moe", "qwen2moe"):
        kv.update({"expert_count": cfg.get("num_local_experts") or cfg["num_experts"],
                   "expert_used_count": cfg["num_experts_per_tok"],
                   "expert_feed_forward_length": cfg["moe_intermediate_size"]})
    if arch == "qwen2moe":
        kv["expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    if arch == "phi3":  # Phi3MiniModel: the pre-training length always, the window (0: none), LongRoPE's scale
        original = rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        kv.update({"rope.scaling.original_context_length": original or cfg["max_position_embeddings"],
                   "attention.sliding_window": cfg.get("sliding_window") or 0})
        if rope.get("long_factor"):
            scale = cfg["max_position_embeddings"] / original
            kv["rope.scaling.attn_factor"] = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    if arch == "gemma3":  # the base converter's RoPE keys (global layers), then Gemma3Model's
        if rope.get("rope_type") == "linear":
            kv.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(rope["factor"])})
        if _rope(cfg, "sliding_attention").get("rope_theta") is not None:
            kv["rope.freq_base_swa"] = float(_rope(cfg, "sliding_attention")["rope_theta"])
        if cfg.get("final_logit_softcapping"):
            kv["final_logit_softcapping"] = float(cfg["final_logit_softcapping"])
        if cfg.get("sliding_window_pattern") != 1:
            kv["attention.sliding_window"] = cfg["sliding_window"]
    return {f"{arch}.{k}": v for k, v in kv.items()}


def _rope_factor_tensors(arch: str, cfg: dict) -> dict:
    """Phi-3's LongRoPE factor sets, as llama.cpp's converter writes them (tensors, not metadata)."""
    rope = _rope(cfg)
    if arch != "phi3" or not rope.get("long_factor"):
        return {}
    return {"rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
            "rope_factors_short.weight": np.array(rope["short_factor"], np.float32)}


def _stack_experts(weights: dict) -> dict:
    """Per-expert projections -> llama.cpp's one [E, rows, cols] tensor per layer and projection."""
    out, stacks = {}, {}
    for hf, w in weights.items():
        m = _EXPERTS.fullmatch(hf)
        if m:
            stacks.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = w
        else:
            out[hf] = w
    for (layer, part), per in sorted(stacks.items()):
        out[f"blk.{layer}.ffn_{part}_exps.weight"] = np.stack([per[e] for e in sorted(per)])
    return out


def _add_kv(writer: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        raise TypeError(f"{key}: {type(value)}")
