"""quantization_config (engine/models/config_quant.py): GPTQ, AWQ and compressed-tensors read into QuantFields, and
every setting duet does not implement refused by name — one case per kind of refusal."""
from __future__ import annotations

import pytest

from engine.errors import ModelLoadError
from engine.models.config_fp8 import Fp8Fields
from engine.models.config_quant import QuantFields
from tests.engine.models.test_config import parse

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True, "damp_percent": 0.01,
        "dataset": "c4", "true_sequential": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
       "modules_to_not_convert": ["lm_head"], "do_fuse": False}
WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128, "strategy": "group", "dynamic": False,
           "actorder": None, "observer": "minmax"}
CT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": WEIGHTS, "input_activations": None,
                                    "output_activations": None}}, "ignore": ["lm_head"], "kv_cache_scheme": None}


def ct(**weights) -> dict:
    return {**CT, "config_groups": {"group_0": {**CT["config_groups"]["group_0"], "weights": {**WEIGHTS, **weights}}}}


@pytest.mark.parametrize("quant, want", [
    (GPTQ, QuantFields("gptq", 4, 128, True, zero_offset=1)),
    ({**GPTQ, "bits": 8, "group_size": -1, "sym": False, "checkpoint_format": "gptq_v2"},
     QuantFields("gptq", 8, -1, False, zero_offset=0)),
    ({**GPTQ, "format": "gptq_v2"}, QuantFields("gptq", 4, 128, True, zero_offset=0)),  # GPTQModel's spelling
    (AWQ, QuantFields("awq", 4, 128, False)),
    ({**AWQ, "group_size": 64}, QuantFields("awq", 4, 64, False)),
    (CT, QuantFields("compressed-tensors", 4, 128, True)),
    (ct(num_bits=8, strategy="channel", group_size=None, symmetric=False, actorder="weight"),
     QuantFields("compressed-tensors", 8, -1, False)),
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     Fp8Fields("fp8", "block", "dynamic-group", (128, 128), "weight_scale_inv", group_size=128)),  # DeepSeek-V3
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
     Fp8Fields("fbgemm_fp8", "channel", "dynamic-token", scale_ub=1200.0)),
    ({**CT, "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                                           "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                              "dynamic": True}}}},
     Fp8Fields("compressed-tensors", "channel", "dynamic-token")),  # llm-compressor's FP8_DYNAMIC
])
def test_supported_configs_are_read(quant, want):
    assert parse(quantization_config=quant).quantization == want
    assert parse().quantization is None


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "fp8"}, r"\(fp8\): weight_block_size=None is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ("gptq", "quantization_config must be an object"),
    ({**GPTQ, "bits": 3}, r"\(gptq\): bits=3 is not supported \(4 or 8\)"),
    ({**GPTQ, "group_size": 16}, "group_size=16 is not supported .a multiple of 32, or -1"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format='marlin' is not supported"),
    ({**GPTQ, "checkpoint_format": "gptq", "format": "gptq_v2"}, "checkpoint_format='gptq' and format='gptq_v2'"),
    ({**GPTQ, "dynamic": {"-:.*down_proj": {}}}, r"is not supported \(per-module overrides are not implemented\)"),
    ({**GPTQ, "pack_dtype": "int16"}, "pack_dtype='int16' is not supported"),
    ({**AWQ, "version": "gemv"}, r"\(awq\): version='gemv' is not supported \(gemm\)"),
    ({**AWQ, "backend": "llm-awq"}, "backend='llm-awq' is not supported"),
    ({**AWQ, "zero_point": False}, "zero_point=False is not supported"),
    ({**AWQ, "bits": 8}, r"\(awq\): bits=8 is not supported \(4\)"),
    ({**AWQ, "group_size": -1}, r"\(awq\): group_size=-1 is not supported \(a multiple of 32\)"),
    ({**CT, "format": "float-quantized"}, "format='float-quantized' is not supported .pack-quantized"),
    ({**CT, "format": "naive-quantized"}, "format='naive-quantized'"),
    ({**CT, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme=.* is not supported"),
    ({**CT, "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config=.* is not supported"),
    ({**CT, "quantization_status": "frozen"}, "quantization_status='frozen'"),
    ({**CT, "config_groups": {**CT["config_groups"], "group_1": CT["config_groups"]["group_0"]}},
     r"config_groups must hold exactly one scheme, got 2 groups \(group_0, group_1\)"),
    ({**CT, "config_groups": {"group_0": {**CT["config_groups"]["group_0"], "targets": ["Linear", "Embedding"]}}},
     r"targets=\['Linear', 'Embedding'\]"),
    ({**CT, "config_groups": {"group_0": {**CT["config_groups"]["group_0"],
                                          "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}},
     r"input_activations=.* is not supported \(weight-only: W4A16 or W8A16\)"),  # W8A8
    (ct(type="float", num_bits=8), "format='pack-quantized' is not supported .float-quantized for float weights"),
    (ct(type="mx", num_bits=8), "weights.type='mx' is not supported .int, or float for FP8"),
    (ct(num_bits=2), r"bits=2 is not supported \(4 or 8\)"),
    (ct(strategy="tensor"), "weights.strategy='tensor'"),
    (ct(strategy="block", block_structure=[128, 128]), "weights.strategy='block'"),
    (ct(group_size=48), "group_size=48 is not supported"),
    (ct(dynamic=True), "weights.dynamic=True"),
])
def test_what_duet_does_not_implement_is_refused_by_name(quant, message):
    with pytest.raises(ModelLoadError, match=message):
        parse(quantization_config=quant)
