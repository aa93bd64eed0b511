"""Reading PEFT adapter directories written by peft itself, and refusing by name what duet does not implement."""
from __future__ import annotations

import json
import math
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine.lora.adapter import PROJECTIONS, LoraAdapterError, load_adapter
from engine.models.llama import CausalLM
from tests.engine.lora.peft_saved import save_peft_adapter


@pytest.fixture(scope="module")
def adapter_dir(tiny_model, tmp_path_factory):
    return save_peft_adapter(tiny_model("llama"), tmp_path_factory.mktemp("ad"), seed=1, r=4, lora_alpha=8,
                             target_modules=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))


def test_projections_agree_with_the_checkpoint_loader():
    for hf, (linear, shard) in PROJECTIONS.items():
        fused = CausalLM.stacked_params.get(f".{hf}.")
        assert fused == ((f".{linear.split('.')[1]}.", shard) if shard is not None else None), hf


def test_reads_peft_adapter(adapter_dir):
    ad = load_adapter("a", adapter_dir, num_layers=2)
    assert (ad.rank, ad.scaling) == (4, 2.0)
    assert ad.linears() == [(i, lin) for i in range(2) for lin in
                            ("mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj", "self_attn.qkv_proj")]
    assert set(ad.weights[(0, "self_attn.qkv_proj")]) == {0, 2}  # q and v; k not targeted
    assert set(ad.weights[(1, "mlp.gate_up_proj")]) == {0}
    raw = load_file(str(adapter_dir / "adapter_model.safetensors"))
    v = ad.weights[(1, "self_attn.qkv_proj")][2]
    assert v.a.equal(raw["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"])
    assert v.b.equal(raw["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"])
    assert tuple(v.a.shape) == (4, 64) and tuple(v.b.shape) == (32, 4)  # 2 kv heads x 16


def test_rslora_scaling(tiny_model, tmp_path):
    d = save_peft_adapter(tiny_model("llama"), tmp_path, seed=2, r=16, lora_alpha=8, use_rslora=True)
    assert load_adapter("r", d).scaling == pytest.approx(8 / math.sqrt(16))


def _edited(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, named", [
    (dict(use_dora=True), "use_dora"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
    (dict(alpha_pattern={"q_proj": 8}), "alpha_pattern"),
    (dict(fan_in_fan_out=True), "fan_in_fan_out"),
    (dict(lora_bias=True), "lora_bias"),
    (dict(bias="all"), "bias='all'"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
    (dict(target_modules=["lm_head"]), "lm_head"),
    (dict(peft_type="IA3"), "IA3"),
])
def test_refuses_by_name(adapter_dir, tmp_path, changes, named):
    with pytest.raises(LoraAdapterError, match=named):
        load_adapter("x", _edited(adapter_dir, tmp_path / "x", **changes))


def test_refuses_unplaceable_tensors_and_pickles(adapter_dir, tmp_path):
    d = _edited(adapter_dir, tmp_path / "emb")
    raw = load_file(str(d / "adapter_model.safetensors"))
    raw["base_model.model.model.embed_tokens.lora_embedding_A"] = raw[next(iter(raw))].clone()
    save_file(raw, str(d / "adapter_model.safetensors"))
    with pytest.raises(LoraAdapterError, match="lora_embedding_A"):
        load_adapter("x", d)
    with pytest.raises(LoraAdapterError, match="names layer 1; the base has 1"):
        load_adapter("x", adapter_dir, num_layers=1)
    d = _edited(adapter_dir, tmp_path / "bin")
    (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")
    with pytest.raises(LoraAdapterError, match="pickle"):
        load_adapter("x", d)
    with pytest.raises(LoraAdapterError, match="not a PEFT adapter directory"):
        load_adapter("x", tmp_path)
