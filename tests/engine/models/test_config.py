"""config.json parsing: the rule in engine/models/config.py's docstring, clause by clause, both ways.

transformers is the independent party: its own config classes convert an old-style config (rope_theta +
rope_scaling, torch_dtype) into today's form (rope_parameters, dtype), and its RoPE code computes the
frequencies we must reproduce.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.errors import ModelLoadError
from engine.models.config import ModelConfig
from engine.models.layers import rope_inv_freq

BASE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}
OLD_STYLE = {  # config.json as transformers 4.x wrote it
    "default-theta": {"rope_theta": 500000.0, "rope_scaling": None, "torch_dtype": "bfloat16"},
    "llama3": {"rope_theta": 500000.0, "rope_scaling": LLAMA3, "torch_dtype": "float32"},
    "llama3-no-original-max": {"rope_theta": 10000.0, "torch_dtype": "float16",
                               "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}},
    "linear-legacy-type-key": {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "no-rope-fields": {},
}


def parse(**changes) -> ModelConfig:
    return ModelConfig.from_hf_dict({**copy.deepcopy(BASE), **changes})


def transformers_v5_form(old: dict) -> dict:
    """The same checkpoint as transformers 5 writes it: its config class converts the old fields."""
    cfg = transformers.LlamaConfig(**copy.deepcopy({**BASE, **old})).to_dict()  # it mutates its input
    assert "rope_parameters" in cfg and "rope_scaling" not in cfg and "rope_theta" not in cfg
    return cfg


@pytest.mark.parametrize("name", list(OLD_STYLE))
def test_old_and_new_config_generations_give_one_model_config(name):
    old = {**BASE, **OLD_STYLE[name]}
    new = transformers_v5_form(OLD_STYLE[name])
    both = {**new, **OLD_STYLE[name]}  # rope_parameters + dtype beside rope_theta + rope_scaling + torch_dtype
    parsed = [ModelConfig.from_hf_dict(c) for c in (old, new, both)]
    assert parsed[0] == parsed[1] == parsed[2]
    assert parsed[0].rope_theta == float(OLD_STYLE[name].get("rope_theta", 10000.0))
    assert parsed[0].checkpoint_dtype == OLD_STYLE[name].get("torch_dtype", "float32")


@pytest.mark.parametrize("name", list(OLD_STYLE))
def test_rope_frequencies_equal_transformers(name):
    """The inverse frequencies we compute from the parsed config are transformers' for the same file."""
    hf_config = transformers.LlamaConfig(**copy.deepcopy({**BASE, **OLD_STYLE[name]}))
    rope_type = hf_config.rope_parameters["rope_type"]
    if rope_type == "default":
        ref = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)[0]
    else:
        ref = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")[0]
    ours = rope_inv_freq(ModelConfig.from_hf_dict(transformers_v5_form(OLD_STYLE[name])))
    assert torch.equal(ours, ref.float())


def test_llama3_original_max_defaults_to_max_position_embeddings():
    cfg = parse(rope_theta=10000.0, rope_scaling={k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"})
    assert cfg.rope_params_dict["original_max_position_embeddings"] == BASE["max_position_embeddings"]


@pytest.mark.parametrize("changes, field", [
    ({"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}, "rope_theta"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_parameters": {"rope_type": "default"}}, "rope_type"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0},
      "rope_parameters": {"rope_type": "linear", "factor": 4.0}}, "factor"),
    ({"dtype": "bfloat16", "torch_dtype": "float16"}, "dtype"),
])
def test_conflicting_generations_are_refused(changes, field):
    with pytest.raises(ModelLoadError, match=field):
        parse(**changes)


def test_nested_rope_parameters_per_layer_type():
    nested = {"full_attention": {"rope_type": "default", "rope_theta": 250000.0}}
    assert parse(rope_parameters=nested).rope_theta == 250000.0
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 8,
            "layer_types": ["full_attention", "sliding_attention"]}
    same = {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e6}}
    assert ModelConfig.from_hf_dict({**qwen, "rope_parameters": same}).rope_theta == 1e6
    differ = {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}
    with pytest.raises(ModelLoadError, match="rope_parameters differ between layer types"):
        ModelConfig.from_hf_dict({**qwen, "rope_parameters": differ})


@pytest.mark.parametrize("changes, message", [
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor=0.25"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope_type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     "short_factor must list head_dim / 2 = 8 factors"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                          "original_max_position_embeddings": 256}, "original_max_position_embeddings": 512},
     "original_max_position_embeddings=512 and 256"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 8.0}},
     r"\['factor'\] mean nothing for rope_type 'default'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}}, "needs low_freq_factor"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method 'bitsandbytes' is not supported"),
    ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config \(fp8\): weight_block_size=None is not"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"use_qk_norm": True}, "use_qk_norm=True"),
    ({"embedding_multiplier": 12.0}, "embedding_multiplier=12.0"),
    ({"num_local_experts": 8}, "num_local_experts=8"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, r"layer_types \['chunked_attention'\]"),
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8},
     "LlamaForCausalLM does not do"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 8,
      "layer_types": ["full_attention", "sliding_attention"]}, "MistralForCausalLM does not do"),
    ({"architectures": ["GemmaForCausalLM"]}, "unsupported architecture 'GemmaForCausalLM'"),
    ({"hidden_size": "64"}, "'hidden_size' must be an integer"),
    ({"num_hidden_layers": None}, "'num_hidden_layers' must be an integer"),
])
def test_math_changing_fields_we_do_not_implement_are_refused_by_name(changes, message):
    with pytest.raises(ModelLoadError, match=message):
        parse(**changes)


def test_fields_that_do_not_change_the_math_are_ignored():
    plain = parse()
    noisy = parse(use_cache=False, initializer_range=0.5, attention_dropout=0.1, pretraining_tp=4,
                  pad_token_id=7, bos_token_id=1, transformers_version="9.9.9", some_future_field={"x": [1, 2]},
                  attn_logit_softcapping=None, use_qk_norm=False, embedding_multiplier=1.0, num_local_experts=0,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "future_rope_knob": 3})
    assert noisy == plain


def test_architecture_defaults_are_transformers_defaults():
    mistral = {**BASE, "architectures": ["MistralForCausalLM"]}
    del mistral["max_position_embeddings"]
    parsed = ModelConfig.from_hf_dict(mistral)
    ref = transformers.MistralConfig(**{k: v for k, v in mistral.items() if k != "architectures"})
    assert parsed.sliding_window == ref.sliding_window == 4096
    assert parsed.max_position_embeddings == ref.max_position_embeddings
    assert ModelConfig.from_hf_dict({**mistral, "sliding_window": None}).sliding_window is None
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4, "use_sliding_window": True,
            "sliding_window": 16, "max_window_layers": 2}
    ref = transformers.Qwen2Config(**{k: v for k, v in qwen.items() if k != "architectures"})
    parsed = ModelConfig.from_hf_dict(qwen)
    assert list(parsed.layer_types) == ref.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    assert [parsed.layer_sliding_window(i) for i in range(4)] == [None, None, 16, 16]
    assert ModelConfig.from_hf_dict({**qwen, "use_sliding_window": False}).sliding_window is None
    assert parsed.qkv_bias and not parsed.o_proj_bias


def test_from_dir_reads_a_transformers_5_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(transformers_v5_form(OLD_STYLE["llama3"])))
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.rope_type, cfg.rope_theta, cfg.rope_params_dict["factor"]) == ("llama3", 500000.0, 8.0)
