"""Writing GGUF files for tests the way llama.cpp's convert_hf_to_gguf.py does, from a tiny HF checkpoint.

Tensor names, metadata keys and the Q/K row interleave (``permute``) are llama.cpp's; 2-D weights are stored
in the requested type (quantized with the ``gguf`` package where it can quantize; for the K-quants, which
it can only dequantize, random blocks with small scales stand in for quantized data), norms stay F32.
``metadata`` / ``drop_metadata`` / ``extra_tensors`` make deliberately odd files for the error tests.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

_GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
              "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
# K-quant block layouts: bytes per 256-value block, offset of the fp16 scale d, offset of the fp16 minimum
# scale dmin (None: the quants are signed), mean quant (dmin = d * mean centres the weights).
_K_QUANTS = {"Q4_K": (144, 0, 2, 7.5), "Q5_K": (176, 0, 2, 15.5), "Q6_K": (210, 208, None, 0.0)}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf.startswith("blk."):  # already llama.cpp's (stacked experts)
        return hf
    base, _, kind = hf.rpartition(".")
    if base == "model.embed_tokens":
        return f"token_embd.{kind}"
    if base == "model.norm":
        return f"output_norm.{kind}"
    if base == "lm_head":
        return f"output.{kind}"
    _, _, idx, rest = base.split(".", 3)
    return f"blk.{idx}.{_LAYER[rest]}.{kind}"


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
               extra_tensors: dict[str, np.ndarray] | None = None, seed: int = 0, spm: dict | None = None) -> Path:
    """``spm``: a SentencePiece vocabulary instead of the directory's tokenizer (``tokens``, ``scores``,
    ``token_type``, ``bos`` / ``eos`` / ``unk`` ids, ``chat_template``), written as llama.cpp writes one: no merges."""
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
    rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)

    kv = {
        f"{arch}.context_length": cfg["max_position_embeddings"], f"{arch}.embedding_length": cfg["hidden_size"],
        f"{arch}.block_count": cfg["num_hidden_layers"], f"{arch}.feed_forward_length": cfg["intermediate_size"],
        f"{arch}.attention.head_count": heads, f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.rope.freq_base": float(rope_theta), f"{arch}.attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
        f"{arch}.rope.dimension_count": head_dim, f"{arch}.vocab_size": len(tokens),
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
    if arch in ("qwen3moe", "qwen2moe"):
        kv.update({f"{arch}.expert_count": cfg.get("num_local_experts") or cfg["num_experts"],
                   f"{arch}.expert_used_count": cfg["num_experts_per_tok"],
                   f"{arch}.expert_feed_forward_length": cfg["moe_intermediate_size"]})
    if arch == "qwen2moe":
        kv[f"{arch}.expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    if cfg.get("head_dim"):  # as llama.cpp's converter writes an explicit head size
        kv[f"{arch}.attention.key_length"] = kv[f"{arch}.attention.value_length"] = head_dim
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
    weights = _stack_experts(weights)
    for hf, w in weights.items():
        w = w.astype(np.float32)
        if arch == "llama" and ".q_proj." in hf:
            w = permute(w, heads)
        elif arch == "llama" and ".k_proj." in hf:
            w = permute(w, kv_heads)
        if hf.endswith("mlp.shared_expert_gate.weight"):
            w = w.reshape(-1)  # llama.cpp stores this [1, hidden] gate as a vector
        data, ggml_type = _store(hf, w, qtype, rng)
        writer.add_tensor(gguf_name(hf), data, raw_dtype=ggml_type)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data.astype(np.float32), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


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
