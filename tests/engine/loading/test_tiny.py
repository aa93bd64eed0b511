"""The tiny checkpoints are real HF checkpoints: transformers loads them without complaint, sharding is
exactly HF's, the bytes are reproducible, and greedy decoding is well conditioned (no near-ties)."""

import json

import pytest
import torch
import transformers  # the reference (a test dependency: pip install .[test])
from safetensors import safe_open

from engine.loading.tiny import ARCHITECTURES, make_tiny_model

transformers.logging.set_verbosity_error()

ARCHS = sorted(ARCHITECTURES)
PROMPTS = ["Hello world", "The model token cache", "héllo 世界 🙂", "def f(x): return x * 2"]


@pytest.fixture(scope="module")
def tiny_dirs(tiny_model):
    """Default-argument checkpoint per arch (from the session cache in tests/conftest.py; never modified)."""
    return {arch: tiny_model(arch) for arch in ARCHS}


def load_hf(model_dir):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    return model.eval(), info


def weight_bytes(model_dir):
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_in_transformers_and_runs_forward(tiny_dirs, arch):
    model, info = load_hf(tiny_dirs[arch])
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(model).__name__ == ARCHITECTURES[arch]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dirs[arch])
    assert len(tokenizer) <= model.config.vocab_size
    ids = tokenizer("héllo 世界 🙂", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_files_follow_hf_conventions(tiny_dirs, arch):
    model_dir = tiny_dirs[arch]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[arch]] and config["model_type"] == arch
    assert config["head_dim"] * config["num_attention_heads"] == config["hidden_size"]
    assert config["tie_word_embeddings"] is (arch == "qwen2")
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
    assert ("lm_head.weight" in names) is (arch != "qwen2")
    assert ("model.layers.1.self_attn.q_proj.bias" in names) is (arch == "qwen2")
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.1.mlp.down_proj.weight"} <= names
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["add_bos_token"] is (arch != "qwen2")
    generation_eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    assert isinstance(generation_eos, list) is (arch == "qwen2")


def test_tied_embeddings_are_tied_in_transformers(tiny_dirs):
    model, _ = load_hf(tiny_dirs["qwen2"])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_sharded_checkpoint_loads_same_weights(tmp_path, tiny_dirs):
    sharded = make_tiny_model(tmp_path, "llama", num_shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert shard_files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (sharded / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shard_files
    tensors = {}
    for name in shard_files:
        with safe_open(sharded / name, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())

    sharded_state = load_hf(sharded)[0].state_dict()
    whole_state = load_hf(tiny_dirs["llama"])[0].state_dict()
    assert sharded_state.keys() == whole_state.keys()
    for name, tensor in whole_state.items():
        assert torch.equal(sharded_state[name], tensor), name


def test_same_arguments_give_identical_bytes(tmp_path):
    first = weight_bytes(make_tiny_model(tmp_path / "a", "qwen2", seed=3, num_shards=2))
    second = weight_bytes(make_tiny_model(tmp_path / "b", "qwen2", seed=3, num_shards=2))
    other_seed = weight_bytes(make_tiny_model(tmp_path / "c", "qwen2", seed=4, num_shards=2))
    assert first == second
    assert first["tokenizer.json"] == other_seed["tokenizer.json"]  # the tokenizer does not depend on seed
    assert first["model-00001-of-00002.safetensors"] != other_seed["model-00001-of-00002.safetensors"]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decoding_is_well_conditioned(tiny_dirs, arch):
    """Top-1/top-2 logit gaps dwarf fp32 rounding error, so token-exact parity tests are not flaky."""
    model, _ = load_hf(tiny_dirs[arch])
    model64 = load_hf(tiny_dirs[arch])[0].double()
    ids = torch.randint(3, 500, (8, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, logits64 = model(ids).logits.double(), model64(ids).logits
    max_error = (logits - logits64).abs().max().item()
    top2 = logits64.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert torch.equal(logits.argmax(-1), logits64.argmax(-1))
    assert max_error < 1e-4
    assert gaps.median() > 1e3 * max_error
    # A random model's gap density near zero is ~1/median; measured share under 100x the error is ~0.3%.
    assert (gaps < 100 * max_error).float().mean() < 0.01

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dirs[arch])
    for prompt in PROMPTS:
        prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            top2 = model(prompt_ids).logits[0, -1].topk(2).values
        assert top2[0] - top2[1] > 1e-3, prompt
        generated = model.generate(
            prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=24, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, prompt_ids.shape[1] :].tolist()
        assert len(set(generated)) >= 8, (prompt, generated)  # not stuck repeating a token


def test_options_reach_transformers(tmp_path):
    rope_scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    llama = make_tiny_model(tmp_path / "llama", "llama", dtype="bfloat16", rope_scaling=rope_scaling,
                            tie_word_embeddings=True, num_layers=1)
    model, info = load_hf(llama)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    rope = getattr(model.config, "rope_parameters", None) or model.config.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0

    mistral = make_tiny_model(tmp_path / "mistral", "mistral", sliding_window=8, num_layers=1)
    model, _ = load_hf(mistral)
    assert model.config.sliding_window == 8
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(3, 40)[None]).logits).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"arch": "gpt2"}, "unknown arch"),
        ({"vocab_size": 200}, "vocab_size"),
        ({"num_heads": 3}, "num_heads"),
        ({"dtype": "int8"}, "dtype"),
        ({"num_shards": 1000}, "num_shards"),
    ],
)
def test_rejects_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_tiny_model(tmp_path, **kwargs)
