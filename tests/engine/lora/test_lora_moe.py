"""LoRA on a mixture-of-experts model (engine/lora/pool.py): adapters on the attention projections (PEFT's usual
targets on a MoE model) give transformers + peft's greedy tokens in a batch mixing them with the base; an adapter with
weights for a sparse layer's MLP is refused by name (the experts take no LoRA here), and peft's own adapters on the
fused experts (target ``gate_up_proj``) by the loader, naming the target."""
from __future__ import annotations

import pytest
import safetensors.torch
import torch
import transformers

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import LoraAdapterError
from engine.request import SamplingParams
from tests.engine.loading.hf_saved import save_with_transformers
from tests.engine.lora.peft_saved import peft_reference, save_peft_adapter

pytestmark = pytest.mark.slow
NUM_TOKENS = 10


@pytest.fixture(scope="module")
def moe(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-moe")
    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
    return save_with_transformers(tmp / "qwen3-moe", config, tiny_model("llama")), tmp


def test_adapters_on_attention_projections_equal_peft(moe):
    model, tmp = moe
    adapters = {"attn": save_peft_adapter(model, tmp / "attn", seed=1, std=0.3,
                                          target_modules=("q_proj", "k_proj", "v_proj", "o_proj")),
                "qv": save_peft_adapter(model, tmp / "qv", seed=2, r=8, std=0.3, target_modules=("q_proj", "v_proj"))}
    engine = Engine(EngineConfig(model=str(model), num_blocks=128, lora_modules={k: str(v) for k, v in
                                                                                   adapters.items()}))
    prompts = [list(range(5, 30)), list(range(40, 47)), list(range(100, 140))]
    names = [None, "attn", "qv"]
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, lora=name)).request_id
        for p, name in zip(prompts, names)]
    got = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    for p, name, rid in zip(prompts, names, ids):
        ref = peft_reference(model, adapters.get(name))
        out = ref.generate(torch.tensor([p]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        assert got[rid] == out[0, len(p):].tolist(), name
    assert len({tuple(v) for v in got.values()}) == 3  # each adapter changes the output


def test_weights_for_experts_are_refused_by_name(moe):
    model, tmp = moe
    adapter = save_peft_adapter(model, tmp / "expertish", seed=3, target_modules=("q_proj",))
    path = adapter / "adapter_model.safetensors"
    weights = safetensors.torch.load_file(path)
    prefix = "base_model.model.model.layers.2.mlp.gate_proj"  # a dense MLP's LoRA, in a sparse layer
    weights[f"{prefix}.lora_A.weight"], weights[f"{prefix}.lora_B.weight"] = torch.zeros(4, 64), torch.zeros(96, 4)
    safetensors.torch.save_file(weights, path)
    engine = Engine(EngineConfig(model=str(model), num_blocks=64, max_loras=1))
    with pytest.raises(LoraAdapterError, match="mlp.gate_up_proj of layer 2, a mixture-of-experts layer"):
        engine.load_lora("expertish", str(adapter))
    assert engine.runner.lora.names() == []
    fused = save_peft_adapter(model, tmp / "experts", seed=4, target_modules=("q_proj", "gate_up_proj"))
    with pytest.raises(LoraAdapterError, match=r"target_modules \['gate_up_proj'\] are not supported"):
        engine.load_lora("experts", str(fused))
