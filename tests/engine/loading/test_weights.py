"""Checkpoint loading: the real loader on real HF-format directories, and every error a user can hit."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine.loading.weights as loader
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.models.config import ModelConfig


def copy_dir(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def load(d, **kw):
    """The engine on the torch backend: its weights stay dense tensors to compare (the CPU path packs them for
    oneDNN; tests/kernels/test_cpu_native.py checks that)."""
    return Engine(EngineConfig(model=str(d), num_blocks=16, **{"kernels": "torch", **kw}))


def test_sharded_checkpoint_loads_same_weights(tiny_model):
    one = load(tiny_model("llama", seed=5)).runner.model.state_dict()
    three = load(tiny_model("llama", seed=5, num_shards=3)).runner.model.state_dict()
    assert one.keys() == three.keys()
    assert all(torch.equal(one[k], three[k]) for k in one)


def test_fused_projections_hold_the_checkpoint_tensors(tiny_model):
    d = tiny_model("qwen2")
    ckpt = load_file(str(d / "model.safetensors"))
    model = load(d).runner.model
    qkv = model.layers[1].self_attn.qkv_proj
    q, k = ckpt["model.layers.1.self_attn.q_proj.weight"], ckpt["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(qkv.weight[: q.shape[0]], q)
    assert torch.equal(qkv.weight[q.shape[0]: q.shape[0] + k.shape[0]], k)
    assert torch.equal(qkv.bias[: q.shape[0]], ckpt["model.layers.1.self_attn.q_proj.bias"])
    assert model.lm_head.weight is model.embed_tokens.weight  # tied


def test_bf16_load(tiny_model):
    e = load(tiny_model("llama"), dtype="bfloat16")
    assert e.runner.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert e.runner.kv_cache.dtype == torch.bfloat16
    out = e.generate([[5, 6, 7]], __import__("engine.request", fromlist=["x"]).SamplingParams(max_tokens=4))
    assert len(out[0]["token_ids"]) == 4


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)


def test_unsupported_architecture(tiny_model, tmp_path):
    d = copy_dir(tiny_model("llama"), tmp_path)
    edit_config(d, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load(d)


def test_unsupported_rope_scaling(tiny_model, tmp_path):
    d = copy_dir(tiny_model("llama"), tmp_path)
    edit_config(d, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelLoadError, match=r"unsupported rope_type 'yarn' \(in rope_scaling\)"):
        load(d)


def test_no_weights(tiny_model, tmp_path):
    d = copy_dir(tiny_model("llama"), tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load(d)


def test_missing_shard(tiny_model, tmp_path):
    d = copy_dir(tiny_model("llama", num_shards=2), tmp_path)
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="shards named in the index are missing"):
        load(d)


def test_shape_mismatch(tiny_model, tmp_path):
    d = copy_dir(tiny_model("llama"), tmp_path)
    edit_config(d, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"mlp\.(gate|up|down)_proj\.weight' has shape .* the model config implies"):
        load(d)


def test_missing_tensor(tiny_model, tmp_path):
    d = copy_dir(tiny_model("llama"), tmp_path)
    w = load_file(str(d / "model.safetensors"))
    del w["model.layers.0.self_attn.v_proj.weight"]
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="does not provide"):
        load(d)


def test_corrupt_file(tiny_model, tmp_path):
    d = copy_dir(tiny_model("llama"), tmp_path)
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="cannot read safetensors"):
        load(d)


def test_progress_bar_for_large_checkpoints(tiny_model, capsys, monkeypatch):
    monkeypatch.setattr(loader, "_PROGRESS_MIN_BYTES", 0)  # our tiny file counts as "large"
    d = tiny_model("llama")
    load(d)
    err = capsys.readouterr().err
    assert f"loading {d.name}" in err and "100%" in err
