"""Tiny random-weight checkpoints in exactly Hugging Face's on-disk format.

Every test, benchmark and ``make run`` without a real model uses a directory written here, and the parity
tests load the same directory into ``transformers``; so the files must be byte-for-byte what an HF
checkpoint looks like (``config.json``, ``model*.safetensors`` [+ index], ``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json``, ``special_tokens_map.json``) and nothing here may
import ``transformers``.

Design choices:
- Weights come from numpy's PCG64 stream (stable across numpy versions) drawn in a fixed order and cast to
  the requested dtype, so the same arguments give byte-identical safetensors files.
- Init scales keep greedy decoding well conditioned: hidden states stay O(1) through the residual stream
  and the logits have a standard deviation of a few units, so the top-1/top-2 gap is typically ~1, many
  orders of magnitude above fp32 rounding noise, and near-ties that would make token-exact parity with
  transformers flaky are rare. The layers' contribution outweighs the token embedding in the residual,
  so even with tied embeddings the model does not simply echo its input token.
- The tokenizer is a byte-level BPE trained in-process on a fixed built-in corpus (independent of ``seed``)
  that contains multi-byte UTF-8 (accents, CJK, emoji), so streaming detokenization meets tokens that
  split a character. Llama/Mistral add BOS through the tokenizer.json post-processor (and say
  ``add_bos_token: true``); Qwen2 has no BOS, like the real one.
- Per-arch quirks mirror the real families: Qwen2 has q/k/v biases and ties embeddings by default and its
  generation_config lists two EOS ids; the Llama chat template ends turns with ``<|eot_id|>`` which is the
  generation EOS while the tokenizer's EOS is ``</s>`` (so the EOS set is a real union).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Per-arch tokenizer facts: special tokens in id order, which of them play which role, the chat template.
_LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
_TOKENIZER_SPECS = {
    "llama": {
        "specials": ["<unk>", "<s>", "</s>", "<pad>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "bos": "<s>", "eos": "</s>", "unk": "<unk>", "pad": "<pad>",
        "generation_eos": ["<|eot_id|>"], "template": _LLAMA_TEMPLATE,
    },
    "mistral": {
        "specials": ["<unk>", "<s>", "</s>"],
        "bos": "<s>", "eos": "</s>", "unk": "<unk>", "pad": None,
        "generation_eos": ["</s>"], "template": _MISTRAL_TEMPLATE,
    },
    "qwen2": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None, "eos": "<|im_end|>", "unk": None, "pad": "<|endoftext|>",
        "generation_eos": ["<|im_end|>", "<|endoftext|>"], "template": _CHATML_TEMPLATE,
    },
}

_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this are be it an which or had "
    "not but have one were their all there been has when who will more no if out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like our "
    "over man me even most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three model token cache block prefill decode "
    "router worker request stream latency memory kernel tensor batch queue serve river mountain garden music"
).split()
_UNICODE_LINES = (
    "héllo wörld, ça va? naïve café résumé façade jalapeño Ångström",
    "世界 你好 世界和平 我们 学习 语言 模型 东京 大阪",
    "🙂 🙃 😀 🚀 🌍 👍 ❤️ 🎉 ✨ 🔥",
    "Привет мир, как дела? Ελληνικά κείμενο. עברית. العربية.",
    "Tokyo 東京 → Ōsaka; math: ∑ ∞ ≤ ≥ ± × ÷ π ≈ √",
)


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    dtype: str = "float32",
    num_shards: int = 1,
    sliding_window: int | None = None,
    rope_scaling: dict | None = None,
    tie_word_embeddings: bool | None = None,
) -> Path:
    """Write a random-weight ``arch`` checkpoint with its tokenizer into ``out_dir``; returns the path."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHITECTURES)}")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")
    spec = _TOKENIZER_SPECS[arch]
    min_vocab = 256 + len(spec["specials"]) + 16
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be >= {min_vocab} (256 bytes + special tokens + some merges)")
    if tie_word_embeddings is None:
        tie_word_embeddings = arch == "qwen2"
    head_dim = hidden_size // num_heads
    weights = _random_weights(
        arch, seed=seed, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
    )
    weights = {name: w.to(_DTYPES[dtype]).contiguous() for name, w in weights.items()}
    if not 1 <= num_shards <= len(weights):
        raise ValueError(f"num_shards must be in [1, {len(weights)}], got {num_shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(arch, vocab_size)
    token_ids = {t: tokenizer.token_to_id(t) for t in spec["specials"]}
    _write_tokenizer_files(out, arch, tokenizer)

    config = _config_dict(
        arch, token_ids, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, dtype=dtype, sliding_window=sliding_window,
        rope_scaling=rope_scaling, tie_word_embeddings=tie_word_embeddings,
    )
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(config))

    _write_safetensors(out, weights, num_shards)
    return out


# ---------------------------------------------------------------------------------------------- weights


def _random_weights(
    arch: str, *, seed: int, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
    num_kv_heads: int, head_dim: int, intermediate_size: int, tie_word_embeddings: bool,
) -> dict[str, torch.Tensor]:
    """HF-named fp32 tensors in HF's state-dict order, drawn in that order from one seeded stream."""
    arch_index = sorted(ARCHITECTURES).index(arch)  # llama and mistral of the same shape still differ
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, arch_index])))

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.from_numpy((mean + std * rng.standard_normal(shape)).astype(np.float32))

    h, q_dim, kv_dim = hidden_size, num_heads * head_dim, num_kv_heads * head_dim
    # Untied: embedding rows (std 0.4) are small next to what each layer adds, and lm_head (std 0.5) gives
    # logits of std ~4. Tied (the same matrix reads and writes the residual): rows at std 0.02 so the input
    # token barely shows in the output, and a final-norm gain of 12.5 brings the logits back to std ~2.
    # Measured: with tied rows at std 0.4 the model locks into repeating one token within a few steps.
    embed_std, final_norm_gain = (0.02, 12.5) if tie_word_embeddings else (0.4, 1.0)
    w = {"model.embed_tokens.weight": normal((vocab_size, h), embed_std)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal((q_dim, h), 1.5 / h**0.5)  # sharp-ish attention
        w[p + "self_attn.k_proj.weight"] = normal((kv_dim, h), 1.5 / h**0.5)
        w[p + "self_attn.v_proj.weight"] = normal((kv_dim, h), 1.0 / h**0.5)
        w[p + "self_attn.o_proj.weight"] = normal((h, q_dim), 1.0 / q_dim**0.5)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = normal((q_dim,), 0.2)
            w[p + "self_attn.k_proj.bias"] = normal((kv_dim,), 0.2)
            w[p + "self_attn.v_proj.bias"] = normal((kv_dim,), 0.2)
        w[p + "mlp.gate_proj.weight"] = normal((intermediate_size, h), 1.0 / h**0.5)
        w[p + "mlp.up_proj.weight"] = normal((intermediate_size, h), 1.0 / h**0.5)
        w[p + "mlp.down_proj.weight"] = normal((h, intermediate_size), 2.0 / intermediate_size**0.5)
        w[p + "input_layernorm.weight"] = normal((h,), 0.1, mean=1.0)
        w[p + "post_attention_layernorm.weight"] = normal((h,), 0.1, mean=1.0)
    w["model.norm.weight"] = final_norm_gain * normal((h,), 0.1, mean=1.0)
    if not tie_word_embeddings:
        w["lm_head.weight"] = normal((vocab_size, h), 0.5)
    return w


def _write_safetensors(out: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    """One ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` + index exactly as HF shards."""
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()
    if num_shards == 1:
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(weights)
    sizes = [weights[n].numel() * weights[n].element_size() for n in names]
    total_bytes = sum(sizes)
    # Contiguous groups of roughly total/num_shards bytes in state-dict order, none empty.
    groups: list[list[str]] = [[] for _ in range(num_shards)]
    shard, cum_bytes = 0, 0
    for idx, (name, size) in enumerate(zip(names, sizes)):
        must_advance = len(names) - idx == num_shards - 1 - shard  # each later shard needs a tensor
        want_advance = int(cum_bytes * num_shards / total_bytes) > shard
        if groups[shard] and (must_advance or want_advance):
            shard += 1
        groups[shard].append(name)
        cum_bytes += size
    weight_map = {}
    for s, group in enumerate(groups):
        filename = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: weights[n] for n in group}, str(out / filename), metadata={"format": "pt"})
        weight_map.update({n: filename for n in group})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)


# ---------------------------------------------------------------------------------------------- configs


def _config_dict(
    arch: str, token_ids: dict[str, int], *, vocab_size: int, hidden_size: int, num_layers: int,
    num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int, max_position_embeddings: int,
    dtype: str, sliding_window: int | None, rope_scaling: dict | None, tie_word_embeddings: bool,
) -> dict:
    spec = _TOKENIZER_SPECS[arch]
    eos_ids = [token_ids[t] for t in spec["generation_eos"]]
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6 if arch == "qwen2" else 1e-5,
        "rope_theta": 1000000.0 if arch == "qwen2" else 10000.0,
        "rope_scaling": rope_scaling,
        "attention_dropout": 0.0,
        # Qwen2's config names <|endoftext|> as BOS although its tokenizer never adds one, like the real one.
        "bos_token_id": token_ids[spec["bos"] or "<|endoftext|>"],
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch == "mistral":
        config["sliding_window"] = sliding_window
    else:  # qwen2: every layer slides when a window is given (max_window_layers=0), none otherwise
        config.update(
            sliding_window=sliding_window,
            use_sliding_window=sliding_window is not None,
            max_window_layers=0 if sliding_window is not None else num_layers,
        )
    return config


def _generation_config(config: dict) -> dict:
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}


# ---------------------------------------------------------------------------------------------- tokenizer


def tiny_corpus() -> list[str]:
    """A fixed few-KB corpus: English-ish sentences, numbers, code, punctuation and multi-byte text."""
    rng = random.Random(20240611)
    lines = []
    for i in range(160):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2025)))
        sentence = " ".join(words).capitalize() + rng.choice([".", ".", "!", "?", ",", ";"])
        if i % 7 == 0:
            sentence += f" {rng.choice(_UNICODE_LINES)}"
        if i % 11 == 0:
            sentence += f"\n    def f_{i}(x): return x * {rng.randint(2, 9)}  # ok\n"
        lines.append(sentence)
    return lines + list(_UNICODE_LINES) * 3


def train_tokenizer(arch: str, vocab_size: int) -> Tokenizer:
    """The arch's byte-level BPE, trained on :func:`tiny_corpus`, with its post-processor attached."""
    spec = _TOKENIZER_SPECS[arch]
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    if arch == "qwen2":  # Qwen2's own pipeline; transformers rebuilds exactly this for model_type qwen2
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:  # GPT-2's byte-level regex
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in spec["specials"]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if spec["bos"] is None:
        tok.post_processor = byte_level
    else:
        bos = spec["bos"]
        template = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    return tok


def _write_tokenizer_files(out: Path, arch: str, tokenizer: Tokenizer) -> None:
    spec = _TOKENIZER_SPECS[arch]
    tokenizer.save(str(out / "tokenizer.json"))
    roles = {f"{role}_token": spec[role] for role in ("bos", "eos", "unk", "pad")}
    added_tokens_decoder = {
        str(tokenizer.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
        for t in spec["specials"]
    }
    tokenizer_config = {
        "add_bos_token": spec["bos"] is not None,
        "add_eos_token": False,
        "added_tokens_decoder": added_tokens_decoder,
        **roles,
        "chat_template": spec["template"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", {k: v for k, v in roles.items() if v is not None})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
