"""Partial rotary (Phi-4-mini: ``partial_rotary_factor`` 0.75, LongRoPE factors of rotary_dim / 2, tied
embeddings): config.json as either transformers generation writes it, the RoPE against transformers' own Phi-3
code, and the engine on a checkpoint transformers saved, through each kernel backend, against transformers'
greedy tokens and logits (prompts within and beyond the pre-training length).

transformers' rule, both generations: rotary_dim = int(head_dim * partial_rotary_factor), the factor read from the
top level (< 5, and 5 writes it there too) or from ``rope_parameters`` (5); inverse frequencies over rotary_dim;
``apply_rotary_pos_emb`` rotates the first rotary_dim dims of each q/k head and passes the rest through.
"""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.models.config import ModelConfig
from engine.models.layers import RotaryEmbedding, rope_attention_factor, rope_inv_freq
from tests.engine.loading.hf_saved import save_with_transformers
from tests.engine.models.test_kernel_backends import prompt_logits
from tests.engine.models.test_parity import hf_greedy, random_prompts, run_engine

ORIGINAL = 64  # the pre-training length; the context is 4x that
SHORT = [1.0 + 0.1 * i for i in range(6)]  # head_dim 16 x 0.75 = rotary_dim 12: 6 factors
LONG = [2.0 + 0.5 * i for i in range(6)]
# Phi-4-mini's config.json, scaled down (transformers 4.x's form: top-level factor, rope_scaling with "type")
V4 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 512, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 4 * ORIGINAL, "original_max_position_embeddings": ORIGINAL, "rms_norm_eps": 1e-5,
      "hidden_act": "silu", "tie_word_embeddings": True, "partial_rotary_factor": 0.75, "rope_theta": 10000.0,
      "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}, "torch_dtype": "float32",
      "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def hf_config(**changes) -> transformers.Phi3Config:
    """transformers 5's own reading of the 4.x file (it moves the factor into rope_parameters)."""
    return transformers.Phi3Config(**{k: v for k, v in {**copy.deepcopy(V4), **changes}.items()
                                      if k not in ("model_type", "torch_dtype")})


def v5_file(tmp_path, **changes) -> dict:
    """config.json as transformers 5 writes it (rope_parameters holding the factor, and the top-level copy)."""
    hf_config(**changes).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def parse(**changes) -> ModelConfig:
    return ModelConfig.from_hf_dict({**copy.deepcopy(V4), **changes})


def test_both_generations_read_the_same_partial_rotary(tmp_path):
    new = v5_file(tmp_path)
    assert new["rope_parameters"]["partial_rotary_factor"] == 0.75 and "rope_scaling" not in new
    a, b = parse(), ModelConfig.from_hf_dict(new)
    only_nested = {k: v for k, v in new.items() if k != "partial_rotary_factor"}  # the factor in rope_parameters only
    assert a == b == ModelConfig.from_hf_dict(only_nested)
    assert (a.partial_rotary_factor, a.rotary_dim, a.head_dim, a.rope_type) == (0.75, 12, 16, "longrope")
    assert a.rope_params_dict["short_factor"] == tuple(SHORT) and a.tie_word_embeddings


def test_factor_one_is_todays_whole_head_path():
    whole = {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}
    plain = parse(**whole, partial_rotary_factor=None)
    assert plain == parse(**whole, partial_rotary_factor=1.0) == parse(**whole, partial_rotary_factor=1)
    assert plain.rotary_dim == plain.head_dim == 16
    rope = RotaryEmbedding(plain, 128)
    assert rope.rotary_dim == 16 and rope.cos.shape == (ORIGINAL + 128, 16)  # both factor sets


@pytest.mark.parametrize("changes, message", [
    # factors listed for the whole head: refused in both spellings (transformers refuses them too)
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
     r"short_factor must list rotary_dim \(int\(head_dim 16 x partial_rotary_factor 0.75\)\) / 2 = 6 factors, got 8"),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "longrope", "short_factor": SHORT,
                                                "long_factor": [2.0] * 8, "partial_rotary_factor": 0.75}},
     "long_factor must list rotary_dim .* = 6 factors, got 8"),
    ({"rope_parameters": {"partial_rotary_factor": 0.5}}, "partial_rotary_factor twice with different values"),
    ({"partial_rotary_factor": 0.7}, "gives rotary_dim 11 of head_dim 16: it must be in"),  # odd
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor=1.5 gives rotary_dim 24"),
    ({"partial_rotary_factor": 0.0}, "partial_rotary_factor=0.0 gives rotary_dim 0"),
    ({"partial_rotary_factor": "0.75"}, "partial_rotary_factor must be a number"),
])
def test_inconsistent_partial_rotary_is_refused(changes, message):
    with pytest.raises(ModelLoadError, match=message):
        parse(**changes)


def test_transformers_refuses_the_whole_head_factors_too():
    with pytest.raises(Exception, match="short_factor field must have length 6"):  # a ValueError inside hf_hub's
        hf_config(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                                  "Gemma2ForCausalLM"])
def test_other_families_keep_refusing_partial_rotary(arch):
    """Their transformers modeling code ignores the factor (default RoPE) or breaks on it (scaled RoPE types)."""
    cfg = {**copy.deepcopy(V4), "architectures": [arch], "rope_scaling": None}
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor=0.75 .* \(Phi3ForCausalLM only\)"):
        ModelConfig.from_hf_dict(cfg)


@pytest.mark.parametrize("positions", [ORIGINAL, 4 * ORIGINAL])  # transformers' short factors, then its long ones
def test_rope_equals_transformers_phi3(positions):
    """Inverse frequencies, attention factor, and q/k rotated (the first 12 dims) and passed through (the last 4)
    as transformers' Phi-3 computes them; ours from the factor set's rows of one table holding both sets."""
    cfg, hf = parse(), hf_config()
    factor_set = "short" if positions <= ORIGINAL else "long"
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=positions)
    torch.testing.assert_close(rope_inv_freq(cfg, factor_set), want_freq, rtol=0, atol=0)
    assert rope_attention_factor(cfg) == pytest.approx(want_scale, rel=1e-12)
    ours, theirs = RotaryEmbedding(cfg, 4 * ORIGINAL), Phi3RotaryEmbedding(hf)
    assert ours.cos.shape[0] == ORIGINAL + 4 * ORIGINAL and ours.row_offset(factor_set) == (positions > ORIGINAL) * ORIGINAL
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, positions, 16, generator=gen), torch.randn(1, 2, positions, 16, generator=gen)
    pos = torch.arange(positions)
    cos, sin = theirs(q, pos[None])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    rows = torch.tensor(ours.rows(factor_set, 0, positions))
    got_q, got_k = ours(rows, q[0].transpose(0, 1), k[0].transpose(0, 1))
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert torch.equal(got_q[..., 12:], q[0].transpose(0, 1)[..., 12:])


def test_default_rope_with_partial_rotary_equals_transformers():
    cfg, hf = parse(rope_scaling=None), hf_config(rope_scaling=None)
    assert cfg.rope_type == "default" and cfg.rotary_dim == 12
    want, _ = Phi3RotaryEmbedding.compute_default_rope_parameters(hf)
    torch.testing.assert_close(rope_inv_freq(cfg), want, rtol=0, atol=0)


@pytest.fixture
def phi4_mini(tiny_model, tmp_path):
    """A tiny Phi-4-mini-shaped checkpoint (partial rotary 0.75, LongRoPE, tied embeddings) saved by transformers."""
    return save_with_transformers(tmp_path / "phi4-mini", hf_config(num_hidden_layers=3), tiny_model("llama"))


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("case", ["short-factors", "long-factors"])
def test_engine_greedy_and_logits_equal_transformers(phi4_mini, kernels, case):
    """Short: a served context within the pre-training length; long: the 4x context, prompts crossing the
    pre-training length (where transformers uses the long factors from the first forward on)."""
    long = case == "long-factors"
    lens, max_len = ((ORIGINAL + 1, 100, 160), 4 * ORIGINAL) if long else ((1, 17, 40), ORIGINAL)
    prompts = random_prompts(512, lens=lens)
    ours, engine = run_engine(phi4_mini, prompts, num_tokens=24 if long else 20, max_num_batched_tokens=128,
                              max_model_len=max_len, kernels=kernels)
    assert engine.runner.ops.name == kernels and engine.runner.fallbacks == []  # the kernels rotate part of a head
    rope = engine.runner.model.rope
    assert rope.rotary_dim == 12 and rope.cos.shape[1] == 12 and rope.cos.abs().max() > 1.0  # attention factor
    ref = hf_greedy(phi4_mini, prompts, num_tokens=24 if long else 20)
    for p, a, b in zip(prompts, ours, ref):
        assert a == b, f"prompt of {len(p)} tokens diverges at {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)}"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(phi4_mini), dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([prompts[-1]])).logits[0]
    torch.testing.assert_close(prompt_logits(engine, prompts[-1]), want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU-only machines)")
def test_triton_kernels_equal_transformers(phi4_mini):
    """The Triton rotary with rotary_dim < head_dim through the engine (the interpreter here): transformers'
    tokens and logits on a prompt beyond the pre-training length."""
    from engine.config import EngineConfig
    from engine.request import SamplingParams
    from tests.engine.models.test_kernel_backends import DEVICE

    prompts = random_prompts(512, lens=(ORIGINAL + 6,))
    engine = Engine(EngineConfig(model=str(phi4_mini), num_blocks=32, device=DEVICE, dtype="float32",
                                 kernels="triton"))
    assert engine.runner.ops.name == "triton" and engine.runner.model.rope.rotary_dim == 12
    got = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [r["token_ids"] for r in got] == hf_greedy(phi4_mini, prompts, num_tokens=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(phi4_mini), dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([prompts[0]])).logits[0]
    torch.testing.assert_close(prompt_logits(engine, prompts[0]), want, rtol=1e-4, atol=1e-4)
