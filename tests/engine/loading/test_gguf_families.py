"""GGUF files of the families beyond Llama/Qwen (issue 26): ``phi3`` (fused qkv and gate/up, LongRoPE factors as
tensors), ``gemma2`` and ``gemma3`` (norms stored as 1 + w, soft-caps, sliding patterns, Gemma 3's local RoPE),
written from checkpoints transformers itself saved, the way llama.cpp's converter writes them
(tests/engine/loading/gguf_files.py).

Two references: transformers loading the same GGUF file (its own dequantization and tensor mapping) wherever its
GGUF loader reads what the file says, and transformers running the checkpoint the file was converted from for
what its GGUF loader drops (LongRoPE factors, Phi-3's window, Gemma's soft-caps, Gemma 3's RoPE scaling)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from engine.errors import ModelLoadError
from engine.loading.checkpoint import load_model_config
from tests.engine.loading.gguf_files import write_gguf
from tests.engine.loading.hf_saved import hf_reference, save_with_transformers
from tests.engine.loading.test_gguf import PROMPTS, engine_for, greedy, hf_gguf_greedy
from tests.engine.models.test_parity import hf_greedy

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
HALF = SHAPE["hidden_size"] // SHAPE["num_attention_heads"] // 2
# what transformers' GGUF loader reads of these files: its Gemma configs' defaults stand for the rest
# (query_pre_attn_scalar 256 = head_dim here, Gemma 2's caps 50 / 30, Gemma 3's 5 sliding : 1 global layers)
READ_BY_TRANSFORMERS = {
    "phi3": lambda: transformers.Phi3Config(**SHAPE),
    "gemma2": lambda: transformers.Gemma2Config(**{**SHAPE, "head_dim": 256}, sliding_window=16),
    "gemma3": lambda: transformers.Gemma3TextConfig(**{**SHAPE, "num_hidden_layers": 6, "head_dim": 256},
                                                    sliding_window=16),
}


def _phi3_longrope(original: int, partial: float = 1.0) -> transformers.Phi3Config:
    """LongRoPE with a window; ``partial`` < 1: Phi-4-mini's form (RoPE on part of each head, tied embeddings)."""
    half = int(2 * HALF * partial) // 2
    return transformers.Phi3Config(**{**SHAPE, "max_position_embeddings": 4 * original}, sliding_window=16,
                                   original_max_position_embeddings=original, tie_word_embeddings=partial < 1,
                                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                    "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                                    "long_factor": [2.0 + 0.5 * i for i in range(half)],
                                                    "original_max_position_embeddings": original,
                                                    "partial_rotary_factor": partial})


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-families")


@pytest.mark.slow
@pytest.mark.parametrize("family, qtype", [("phi3", "F32"), ("phi3", "Q8_0"), ("gemma2", "F32"), ("gemma2", "Q8_0"),
                                           ("gemma3", "F32")])
def test_gguf_equals_transformers_loading_the_same_file(tiny_model, family_dir, family, qtype):
    """Greedy tokens against transformers' GGUF loading of the same file, and (F32) the checkpoint it came from;
    the windows (16) are crossed by the longer prompts."""
    hf_dir = family_dir / f"{family}-hf"
    if not hf_dir.exists():
        save_with_transformers(hf_dir, READ_BY_TRANSFORMERS[family](), tiny_model("llama"))
    path = write_gguf(hf_dir, family_dir / f"{family}-{qtype}.gguf", qtype)
    ours = greedy(engine_for(path, dtype="float32"))
    assert ours == hf_gguf_greedy(path)
    if qtype == "F32":
        assert ours == hf_greedy(hf_dir, PROMPTS, 24)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["short-factors", "long-factors", "phi4-mini-partial-rotary"])
def test_phi3_gguf_longrope_and_window_equal_the_checkpoint(tiny_model, tmp_path, case):
    """LongRoPE as llama.cpp stores it (factor tensors, the pre-training length, attn_factor), the window on every
    layer, Phi-4-mini's partial rotary (rope.dimension_count 12 of 16) and tied embeddings: what transformers'
    GGUF loader drops, so against the checkpoint the file came from. The short factors: a context within the
    pre-training length, windows crossed; the long: a longer context, prompts beyond the pre-training length."""
    original = 512 if case == "short-factors" else 64
    partial = 0.75 if case.startswith("phi4") else 1.0
    hf_dir = save_with_transformers(tmp_path / "hf", _phi3_longrope(original, partial), tiny_model("llama"))
    path = write_gguf(hf_dir, tmp_path / "phi3-longrope.gguf", "F32")
    cfg = load_model_config(path)
    assert cfg.rope_type == "longrope" and cfg.sliding_window == 16
    assert cfg.rope_params_dict["original_max_position_embeddings"] == original
    assert (cfg.rotary_dim, cfg.tie_word_embeddings) == ((12, True) if partial < 1 else (16, False))
    prompts = PROMPTS if case == "short-factors" else [list(range(3, 103)), list(range(200, 280))]
    engine = engine_for(path, max_model_len=original if case == "short-factors" else 4 * original)
    assert engine.runner.model.rope.cos.abs().max() > 1.0  # the attention factor scales cos and sin
    assert greedy(engine, prompts) == hf_greedy(hf_dir, prompts, 24)


def _gemma3_scaled() -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(**{**SHAPE, "num_hidden_layers": 6, "head_dim": 32}, sliding_window=16,
                                         query_pre_attn_scalar=32, final_logit_softcapping=8.0, rope_parameters={
                                             "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                "rope_theta": 1e6},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 5e4}})


CHECKPOINT_ONLY = {  # what the files say that transformers' GGUF loader does not read
    "gemma2-caps": lambda: transformers.Gemma2Config(**{**SHAPE, "num_hidden_layers": 4, "head_dim": 32},
                                                     sliding_window=16, query_pre_attn_scalar=32,
                                                     attn_logit_softcapping=5.0, final_logit_softcapping=8.0),
    "gemma3-rope-cap": _gemma3_scaled,
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(CHECKPOINT_ONLY))
def test_gemma_gguf_metadata_equals_the_checkpoint(tiny_model, tmp_path, variant):
    """Soft-caps from the metadata (greedy cannot see the final cap: the logits too), the query scale llama.cpp
    implies (head_dim), Gemma 3's linear scaling on its global layers and its local base (rope.freq_base_swa)."""
    from tests.engine.models.test_kernel_backends import prompt_logits

    hf_dir = save_with_transformers(tmp_path / "hf", CHECKPOINT_ONLY[variant](), tiny_model("llama"))
    path = write_gguf(hf_dir, tmp_path / f"{variant}.gguf", "F32")
    engine = engine_for(path)
    assert engine.model_config.gemma.final_logit_softcapping == 8.0
    assert greedy(engine) == hf_greedy(hf_dir, PROMPTS, 24)
    hf = hf_reference(hf_dir)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[2]])).logits[0]
    assert ref.abs().max() < 8.0  # capped
    torch.testing.assert_close(prompt_logits(engine, PROMPTS[2]), ref, rtol=1e-4, atol=1e-4)


def test_gemma_gguf_config_follows_llama_cpp(tiny_model, tmp_path):
    """What a Gemma file leaves out is llama.cpp's: Gemma 2's caps 50 / 30 and window 4,096, the 27B models'
    query scale (hidden / heads, by their layer count), Gemma 3 without a window: every layer global."""
    hf2 = save_with_transformers(tmp_path / "g2", READ_BY_TRANSFORMERS["gemma2"](), tiny_model("llama"))
    bare = write_gguf(hf2, tmp_path / "g2-bare.gguf", drop_metadata=(
        "gemma2.attn_logit_softcapping", "gemma2.final_logit_softcapping", "gemma2.attention.sliding_window"))
    cfg = load_model_config(bare)
    assert (cfg.gemma.attn_logit_softcapping, cfg.gemma.final_logit_softcapping) == (50.0, 30.0)
    assert cfg.sliding_window == 4096 and cfg.layer_types[:2] == ("sliding_attention", "full_attention")
    assert cfg.gemma.query_pre_attn_scalar == 256 and cfg.tie_word_embeddings and not cfg.qk_norm
    big = write_gguf(hf2, tmp_path / "g2-27b.gguf", metadata={"gemma2.block_count": 46})
    assert load_model_config(big).gemma.query_pre_attn_scalar == 64 // 4
    hf3 = save_with_transformers(tmp_path / "g3", READ_BY_TRANSFORMERS["gemma3"](), tiny_model("llama"))
    cfg3 = load_model_config(write_gguf(hf3, tmp_path / "g3.gguf"))
    assert cfg3.layer_types == ("sliding_attention",) * 5 + ("full_attention",) and cfg3.qk_norm
    assert cfg3.gemma.attn_logit_softcapping is None and cfg3.rope_local == ("default", 10000.0, ())
    global_only = load_model_config(write_gguf(hf3, tmp_path / "g3-global.gguf",
                                                         metadata={"gemma3.attention.sliding_window": 0}))
    assert global_only.sliding_window is None and set(global_only.layer_types) == {"full_attention"}


@pytest.mark.parametrize("family, kw, message", [
    ("gemma3", dict(metadata={"gemma3.attn_logit_softcapping": 50.0}), "gemma3.attn_logit_softcapping=50.0"),
    ("gemma2", dict(metadata={"gemma2.attention.sliding_window": 0}), "sliding_window=0 is not a window"),
    ("gemma2", dict(metadata={"gemma2.final_logit_softcapping": -1.0}), "final_logit_softcapping=-1.0 is not a"),
    ("phi3", dict(metadata={"phi3.rope.dimension_count": 7}), "partial_rotary_factor=0.4375 gives rotary_dim 7"),
    ("phi3", dict(metadata={"phi3.rope.scaling.type": "longrope"}), "LongRoPE .* both rope_factors_short and"),
    ("phi3", dict(metadata={"phi3.expert_count": 16}), r"expert_count=16 \(mixture of experts\)"),
    ("phi3", dict(extra_tensors={"blk.0.post_ffw_norm.weight": np.ones(64)}), "post_ffw_norm.weight' has no place"),
])
def test_gguf_family_variants_duet_does_not_implement_are_refused_by_name(tiny_model, tmp_path, family, kw, message):
    hf_dir = save_with_transformers(tmp_path / family, READ_BY_TRANSFORMERS[family](), tiny_model("llama"))
    with pytest.raises(ModelLoadError, match=message):
        engine_for(write_gguf(hf_dir, tmp_path / f"{family}-odd.gguf", **kw))


def test_longrope_factor_tensors_only_in_phi3(tiny_model, tmp_path):
    factors = np.ones(8, np.float32)
    path = write_gguf(tiny_model("llama"), tmp_path / "llama-factors.gguf",
                      extra_tensors={"rope_factors_long.weight": factors, "rope_factors_short.weight": factors})
    with pytest.raises(ModelLoadError, match="LongRoPE .* supported in 'phi3' files"):
        load_model_config(path)
