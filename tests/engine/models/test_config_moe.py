"""Mixture-of-experts fields of config.json (engine/models/config_moe.py) against transformers' own modeling code: which
layers are sparse, the expert sizes, both spellings of the expert count, the defaults, and the refusals."""
from __future__ import annotations

import pytest
import torch
import transformers

from engine.errors import ModelLoadError
from engine.models.config import ModelConfig

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def ours(config: transformers.PretrainedConfig, **changes) -> ModelConfig:
    return ModelConfig.from_hf_dict({**config.to_dict(), "architectures": config.architectures or [
        {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[
            config.model_type]], **changes})


def sparse_layers_of_transformers(config) -> tuple[int, ...]:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return tuple(i for i, layer in enumerate(model.model.layers)
                 if hasattr(getattr(layer, "mlp", None) or layer.block_sparse_moe, "experts"))


@pytest.mark.parametrize("config", [
    transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2),
    transformers.Qwen2MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                shared_expert_intermediate_size=48, decoder_sparse_step=2, mlp_only_layers=[3]),
    transformers.Qwen3MoeConfig(**SHAPE, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0, 5]),
], ids=["mixtral", "qwen2-moe", "qwen3-moe"])
def test_sparse_layers_and_sizes_are_transformers(config):
    cfg = ours(config)
    assert cfg.moe.sparse_layers == sparse_layers_of_transformers(config)
    assert cfg.moe.num_experts == (getattr(config, "num_local_experts", None) or config.num_experts)
    assert cfg.moe.num_experts_per_tok == config.num_experts_per_tok
    mixtral = config.model_type == "mixtral"
    assert cfg.moe.moe_intermediate_size == (config.intermediate_size if mixtral else config.moe_intermediate_size)
    assert cfg.moe.norm_topk_prob == (True if mixtral else config.norm_topk_prob)
    assert cfg.moe.shared_expert_intermediate_size == (48 if config.model_type == "qwen2_moe" else 0)
    assert cfg.qk_norm == (config.model_type == "qwen3_moe")


def test_both_spellings_of_the_expert_count():
    base = transformers.Qwen3MoeConfig(**SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    new = base.to_dict()  # transformers 5 writes num_local_experts
    old = {k: v for k, v in new.items() if k != "num_local_experts"} | {"num_experts": 8}  # as 4.x wrote it
    arch = {"architectures": ["Qwen3MoeForCausalLM"]}
    assert "num_local_experts" in new
    assert ModelConfig.from_hf_dict({**new, **arch}) == ModelConfig.from_hf_dict({**old, **arch})
    with pytest.raises(ModelLoadError, match="number of experts twice"):
        ModelConfig.from_hf_dict({**new, **arch, "num_experts": 4})


def test_defaults_of_mixtral_are_transformers():
    ref = transformers.MixtralConfig(**SHAPE, num_local_experts=4)
    raw = {k: v for k, v in ref.to_dict().items() if k not in ("rope_parameters", "rms_norm_eps")}
    cfg = ModelConfig.from_hf_dict({**raw, "architectures": ["MixtralForCausalLM"]})
    assert cfg.rope_theta == ref.rope_parameters["rope_theta"] == 1e6
    assert cfg.rms_norm_eps == ref.rms_norm_eps == 1e-5


@pytest.mark.parametrize("changes, message", [
    ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 > the 8 experts"),
    ({"num_experts": None, "num_local_experts": None}, "names no experts"),
    ({"moe_intermediate_size": 0}, "'moe_intermediate_size' must be a positive integer"),
    ({"mlp_only_layers": "0"}, "mlp_only_layers must be a list"),
    ({"shared_expert_intermediate_size": 32}, "has no shared expert"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
])
def test_moe_fields_we_cannot_honour_are_refused_by_name(changes, message):
    base = transformers.Qwen3MoeConfig(**SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_dict({**base.to_dict(), "architectures": ["Qwen3MoeForCausalLM"], **changes})


def test_experts_on_a_dense_architecture_are_still_refused():
    dense = transformers.Qwen3Config(**SHAPE).to_dict()
    with pytest.raises(ModelLoadError, match="num_experts=8"):
        ModelConfig.from_hf_dict({**dense, "architectures": ["Qwen3ForCausalLM"], "num_experts": 8})
