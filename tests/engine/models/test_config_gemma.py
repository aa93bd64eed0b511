"""Gemma 2 / Gemma 3 fields of config.json (engine/models/config_gemma.py) against transformers' config classes: layer
types, the per-layer-type RoPE of Gemma 3 in both generations' spellings, the defaults and the refusals."""
from __future__ import annotations

import pytest
import transformers

from engine.errors import ModelLoadError
from engine.models.config import ModelConfig

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=7, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


def parse(config: transformers.PretrainedConfig, arch: str, **changes) -> ModelConfig:
    return ModelConfig.from_hf_dict({**config.to_dict(), "architectures": [arch], **changes})


@pytest.mark.parametrize("arch, config", [
    ("Gemma2ForCausalLM", transformers.Gemma2Config(**SHAPE, sliding_window=16)),
    ("Gemma3ForCausalLM", transformers.Gemma3TextConfig(**SHAPE, sliding_window=16)),
])
def test_layer_types_and_fields_are_transformers(arch, config):
    cfg = parse(config, arch)
    assert list(cfg.layer_types) == config.layer_types
    raw = {k: v for k, v in config.to_dict().items() if k != "layer_types"}  # as files without the list say it
    assert ModelConfig.from_hf_dict({**raw, "architectures": [arch]}).layer_types == cfg.layer_types
    assert cfg.gemma.query_pre_attn_scalar == config.query_pre_attn_scalar
    assert cfg.gemma.attn_logit_softcapping == config.attn_logit_softcapping
    assert cfg.gemma.final_logit_softcapping == config.final_logit_softcapping
    assert cfg.tie_word_embeddings and cfg.gemma.sandwich_norms and cfg.gemma.norm_plus_one
    assert cfg.qk_norm == (arch == "Gemma3ForCausalLM")


def test_gemma3_rope_per_layer_type_in_both_generations():
    new = transformers.Gemma3TextConfig(**SHAPE, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}).to_dict()
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window_pattern=6)  # as transformers 4 wrote it
    arch = {"architectures": ["Gemma3ForCausalLM"]}
    a, b = ModelConfig.from_hf_dict({**new, **arch}), ModelConfig.from_hf_dict({**old, **arch})
    assert a == b
    assert (a.rope_type, a.rope_theta, a.rope_params_dict) == ("linear", 1e6, {"factor": 8.0})
    assert a.rope_local == ("default", 1e4, ())
    assert a.local_rope_config().rope_theta == 1e4 and a.local_rope_config().rope_type == "default"
    with pytest.raises(ModelLoadError, match="RoPE's rope_theta twice"):
        ModelConfig.from_hf_dict({**new, **arch, "rope_local_base_freq": 5e4})


@pytest.mark.parametrize("changes, message", [
    ({"hidden_activation": "gelu"}, "'gelu' is not supported"),
    ({"attn_logit_softcapping": -1.0}, "'attn_logit_softcapping' must be a positive number"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
])
def test_gemma_fields_we_cannot_honour_are_refused_by_name(changes, message):
    with pytest.raises(ModelLoadError, match=message):
        parse(transformers.Gemma2Config(**SHAPE), "Gemma2ForCausalLM", **changes)


def test_soft_capping_outside_gemma_is_still_refused():
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping=50.0"):
        parse(transformers.LlamaConfig(**SHAPE), "LlamaForCausalLM", attn_logit_softcapping=50.0)
