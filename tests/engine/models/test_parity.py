"""Token-exact greedy parity with Hugging Face transformers (the reference nobody here wrote).

Prompts of mixed lengths (1 … 300 tokens) run concurrently through one engine with continuous batching;
each must equal ``transformers``' ``generate`` for that prompt alone, token for token, for 64 tokens.
"""
from __future__ import annotations

import random

import pytest
import torch
import transformers  # the reference (a test dependency: pip install .[test])

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from tests.engine.loading.hf_saved import hf_reference, save_with_transformers

PROMPT_LENS = (1, 3, 16, 17, 45, 100, 160, 300)
NUM_TOKENS = 64

VARIANTS = {
    "llama": dict(arch="llama"),
    "llama3-rope": dict(arch="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
    "llama-mqa-3shards": dict(arch="llama", num_kv_heads=1, num_shards=3),
    "qwen2": dict(arch="qwen2"),
    "mistral": dict(arch="mistral"),
    "mistral-sliding-window": dict(arch="mistral", sliding_window=48),
}


def random_prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def hf_greedy(model_dir, prompts, num_tokens=NUM_TOKENS) -> list[list[int]]:
    hf = hf_reference(model_dir)
    outs = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


def run_engine(model_dir, prompts, num_tokens=NUM_TOKENS, **cfg) -> tuple[list[list[int]], Engine]:
    cfg.setdefault("num_blocks", 512)
    engine = Engine(EngineConfig(model=str(model_dir), **cfg))
    res = engine.generate(prompts, SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True))
    engine.pool.check()
    assert engine.pool.num_used_blocks == 0, "blocks leaked after all requests finished"
    return [r["token_ids"] for r in res], engine


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_equals_transformers(tiny_model, variant):
    model_dir = tiny_model(**VARIANTS[variant])
    engine_vocab = 512
    prompts = random_prompts(engine_vocab)
    ours, engine = run_engine(model_dir, prompts, max_num_batched_tokens=256)
    assert engine.stats.num_steps < len(prompts) * NUM_TOKENS  # requests really were batched together
    ref = hf_greedy(model_dir, prompts)
    for n, a, b in zip(PROMPT_LENS, ours, ref):
        assert a == b, f"prompt of {n} tokens diverges at {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)}"


SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)
SAVED_BY_TRANSFORMERS = {  # config.json written by transformers 5 itself (rope_parameters, dtype, layer_types)
    "llama3-rope": lambda: transformers.LlamaConfig(**SHAPE, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-biases": lambda: transformers.LlamaConfig(**SHAPE, attention_bias=True, mlp_bias=True,
                                                     rope_parameters={"rope_type": "linear", "factor": 2.0}),
    "qwen2-window-on-later-layers": lambda: transformers.Qwen2Config(
        **SHAPE, use_sliding_window=True, sliding_window=24, max_window_layers=1, tie_word_embeddings=True),
    "mistral-window": lambda: transformers.MistralConfig(**{**SHAPE, "head_dim": 32}, sliding_window=40),
    # Qwen3: q/k norm per head; a head_dim that is not hidden / heads; the window on later layers only
    "qwen3-window-on-later-layers": lambda: transformers.Qwen3Config(
        **{**SHAPE, "head_dim": 32}, use_sliding_window=True, sliding_window=24, max_window_layers=1),
    "qwen3-biases-tied": lambda: transformers.Qwen3Config(**SHAPE, head_dim=16, attention_bias=True,
                                                          tie_word_embeddings=True),
    # Gemma 2: soft-capped attention and logits, sandwich norms, (1 + w) norms, GeGLU, scaled embeddings, the
    # window on every other layer, query_pre_attn_scalar != head_dim
    "gemma2": lambda: transformers.Gemma2Config(**{**SHAPE, "num_hidden_layers": 4, "head_dim": 32},
                                                sliding_window=24, query_pre_attn_scalar=20,
                                                attn_logit_softcapping=5.0, final_logit_softcapping=8.0),
    # Gemma 3 (text): q/k norms (1 + w), 5 sliding : 1 global layers, the global RoPE with its own base and
    # linear scaling, the local one its own base
    "gemma3": lambda: transformers.Gemma3TextConfig(**{**SHAPE, "num_hidden_layers": 6, "head_dim": 32},
                                                    sliding_window=24, query_pre_attn_scalar=20,
                                                    rope_parameters={"full_attention": {"rope_type": "linear",
                                                                                        "factor": 4.0,
                                                                                        "rope_theta": 1e6},
                                                                     "sliding_attention": {"rope_type": "default",
                                                                                           "rope_theta": 1e4}}),
    # mixture of experts: 8 experts, top 2 (Mixtral: always renormalised; sliding window on every layer)
    "mixtral-window": lambda: transformers.MixtralConfig(**SHAPE, num_local_experts=8, num_experts_per_tok=2,
                                                         sliding_window=40),
    # Qwen3-MoE: q/k norm; a dense first layer (mlp_only_layers) and top 3 of 6 renormalised
    "qwen3-moe-dense-first": lambda: transformers.Qwen3MoeConfig(
        **{**SHAPE, "head_dim": 32}, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
        norm_topk_prob=True, mlp_only_layers=[0]),
    # Qwen2-MoE: the gated shared expert; sparse every second layer; weights not renormalised
    "qwen2-moe-shared-expert": lambda: transformers.Qwen2MoeConfig(
        **SHAPE, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=96, decoder_sparse_step=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(SAVED_BY_TRANSFORMERS))
def test_greedy_equals_transformers_on_checkpoints_saved_by_transformers(tiny_model, tmp_path, variant):
    model_dir = save_with_transformers(tmp_path / variant, SAVED_BY_TRANSFORMERS[variant](), tiny_model("llama"))
    prompts = random_prompts(512, lens=(1, 17, 45, 100, 160))
    ours, _ = run_engine(model_dir, prompts, max_num_batched_tokens=128)
    ref = hf_greedy(model_dir, prompts)
    for p, a, b in zip(prompts, ours, ref):
        assert a == b, f"prompt of {len(p)} tokens diverges at {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)}"


def test_chat_template_prompt_equals_transformers(tiny_model):
    """A real text prompt through our tokenizer + chat template gives HF's tokens and HF's continuation."""
    model_dir = tiny_model("qwen2")
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    messages = [{"role": "user", "content": "Tell me about the river and the mountain garden."}]
    ref_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ref_ids, dict) or hasattr(ref_ids, "input_ids"):
        ref_ids = ref_ids["input_ids"]
    engine = Engine(EngineConfig(model=str(model_dir), num_blocks=64))
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(ref_ids)
    res = engine.generate([ids], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert res[0]["token_ids"] == hf_greedy(model_dir, [ids], 24)[0]
    assert res[0]["text"] == tok.decode(res[0]["token_ids"], skip_special_tokens=True)


def _phi3(original: int, window: int | None = None) -> transformers.Phi3Config:
    half = SHAPE["hidden_size"] // SHAPE["num_attention_heads"] // 2
    return transformers.Phi3Config(**{**SHAPE, "max_position_embeddings": 4 * original}, sliding_window=window,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                   original_max_position_embeddings=original,  # transformers: it wins over the one below
                                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                    "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                                    "long_factor": [2.0 + 0.5 * i for i in range(half)],
                                                    "original_max_position_embeddings": original})


@pytest.mark.slow
@pytest.mark.parametrize("case", ["short-factors-window", "long-factors"])
def test_phi3_longrope_equals_transformers(tiny_model, tmp_path, case):
    """Phi-3: fused qkv / gate_up in the checkpoint, LongRoPE with its attention factor (context 4x the
    pre-training length). The short factors: a served context within the pre-training length (and a sliding
    window); the long ones: a longer context, prompts longer than the pre-training length (where transformers
    uses the long factors from the first forward on: engine/models/layers.py ``longrope_long``)."""
    original = 512 if case.startswith("short") else 64
    model_dir = save_with_transformers(tmp_path / case, _phi3(original, 40 if case.startswith("short") else None),
                                       tiny_model("llama"))
    lens = (1, 17, 45, 100, 160) if case.startswith("short") else (65, 100, 160)
    prompts = random_prompts(512, lens=lens)
    ours, engine = run_engine(model_dir, prompts, max_num_batched_tokens=128,
                              max_model_len=original if case.startswith("short") else 4 * original)
    assert engine.runner.model.rope.cos.abs().max() > 1.0  # the attention factor scales cos and sin
    ref = hf_greedy(model_dir, prompts)
    for p, a, b in zip(prompts, ours, ref):
        assert a == b, f"prompt of {len(p)} tokens diverges at {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)}"


def test_gemma2_logits_equal_transformers(tiny_model, tmp_path):
    """Greedy cannot see the final soft-cap (tanh keeps the argmax): the logits themselves, against transformers'
    forward of the same prompt, through the engine's runner and KV cache."""
    from tests.engine.models.test_kernel_backends import prompt_logits

    model_dir = save_with_transformers(tmp_path / "gemma2", SAVED_BY_TRANSFORMERS["gemma2"](), tiny_model("llama"))
    prompt = random_prompts(512, lens=(60,))[0]
    engine = Engine(EngineConfig(model=str(model_dir), num_blocks=32))
    ours = prompt_logits(engine, prompt)
    hf = hf_reference(model_dir)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert ref.abs().max() < 8.0  # capped at final_logit_softcapping
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
