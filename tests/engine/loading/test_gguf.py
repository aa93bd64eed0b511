"""GGUF checkpoints (engine/loading/gguf.py, engine/loading/gguf_tokenizer.py) on tiny files written the way llama.cpp
writes them, against transformers' own GGUF loading of the same file (an independent dequantization, un-permute
and tokenizer conversion), and every refusal a user can meet."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.loading.checkpoint import load_model_config, load_tokenizer
from engine.loading.gguf import GGUFCheckpoint
from engine.loading.paths import checkpoint_name, is_gguf
from engine.loading.tiny import tiny_corpus
from engine.request import SamplingParams
from tests.engine.loading.gguf_files import write_gguf
from tests.engine.loading.hf_saved import hf_reference

ROOT = Path(__file__).resolve().parents[3]
WIDE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)  # rows fit 256-value K blocks
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13] * 7, list(range(40, 140))]
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


def engine_for(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), num_blocks=64, **kw))


def greedy(engine: Engine, prompts=PROMPTS, n: int = 24) -> list[list[int]]:
    res = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [r["token_ids"] for r in res]


def hf_gguf_greedy(path: Path, prompts=PROMPTS, n: int = 24) -> list[list[int]]:
    model = hf_reference(path.parent, gguf_file=path.name)
    return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.mark.slow
@pytest.mark.parametrize("arch, qtype", [("llama", t) for t in TYPES] + [("qwen2", "Q8_0"), ("qwen2", "Q4_K")])
def test_greedy_equals_transformers_loading_the_same_gguf(tiny_model, gguf_dir, arch, qtype):
    path = write_gguf(tiny_model(arch, **WIDE), gguf_dir / f"{arch}-{qtype}.gguf", qtype,
                      pre="qwen2" if arch == "qwen2" else "gpt-2")
    engine = engine_for(path, dtype="float32")  # transformers runs float32 too (auto: the file's F16/BF16)
    assert greedy(engine) == hf_gguf_greedy(path)
    engine.pool.check()
    assert load_model_config(path).checkpoint_dtype == {"F16": "float16", "BF16": "bfloat16"}.get(qtype, "float32")


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_qwen3_gguf_equals_transformers_loading_the_same_file(tiny_model, gguf_dir, qtype):
    """llama.cpp's qwen3 layout (q/k norms per head) against transformers' GGUF loading; F32 also against the
    checkpoint it came from (head_dim 128: transformers' qwen3 GGUF mapping takes its default head size)."""
    from tests.engine.loading.hf_saved import save_with_transformers

    hf_dir = gguf_dir / "qwen3-hf"
    if not hf_dir.exists():
        save_with_transformers(hf_dir, transformers.Qwen3Config(
            vocab_size=512, hidden_size=512, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=128, max_position_embeddings=1024), tiny_model("llama"))
    path = write_gguf(hf_dir, gguf_dir / f"qwen3-{qtype}.gguf", qtype)
    assert load_model_config(path).qk_norm
    ours = greedy(engine_for(path, dtype="float32"))
    assert ours == hf_gguf_greedy(path)
    if qtype == "F32":
        assert ours == greedy(engine_for(hf_dir))


@pytest.mark.slow
def test_qwen3_moe_gguf_equals_transformers_loading_the_same_file(tiny_model, gguf_dir):
    """llama.cpp's qwen3moe (every expert's projection in one 3-D tensor, the router ffn_gate_inp) against
    transformers' GGUF loading and the checkpoint it came from (moe_intermediate_size 768: transformers' qwen3moe
    GGUF mapping takes its default)."""
    from tests.engine.loading.hf_saved import save_with_transformers

    hf_dir = save_with_transformers(gguf_dir / "qwen3moe-hf", transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=768, norm_topk_prob=True), tiny_model("llama"))
    path = write_gguf(hf_dir, gguf_dir / "qwen3moe-F32.gguf", "F32")
    cfg = load_model_config(path)
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.sparse_layers) == (4, 2, (0, 1))
    ours = greedy(engine_for(path))
    assert ours == hf_gguf_greedy(path) == greedy(engine_for(hf_dir))


@pytest.mark.slow
def test_qwen2_moe_gguf_equals_transformers_loading_the_same_file(tiny_model, gguf_dir):
    """llama.cpp's qwen2moe: the experts as in qwen3moe plus the shared expert and its gate (a vector in the
    file), weights not renormalised (transformers' qwen2moe GGUF mapping takes its default expert sizes)."""
    from tests.engine.loading.hf_saved import save_with_transformers

    hf_dir = save_with_transformers(gguf_dir / "qwen2moe-hf", transformers.Qwen2MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632), tiny_model("llama"))
    path = write_gguf(hf_dir, gguf_dir / "qwen2moe-F32.gguf", "F32", pre="qwen2")
    cfg = load_model_config(path)
    assert cfg.moe.shared_expert_intermediate_size == 5632 and not cfg.moe.norm_topk_prob and cfg.qkv_bias
    ours = greedy(engine_for(path))
    assert ours == hf_gguf_greedy(path) == greedy(engine_for(hf_dir))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_gguf_restores_the_checkpoint_exactly(tiny_model, gguf_dir, arch):
    """HF → GGUF (llama.cpp's Q/K row permutation) → duet gives back every weight bit for bit."""
    hf_dir = tiny_model(arch)
    path = write_gguf(hf_dir, gguf_dir / f"{arch}-exact.gguf", "F32", pre="qwen2" if arch == "qwen2" else "gpt-2")
    # the torch backend keeps every weight a dense tensor in the state dict (the CPU path packs projections)
    from_gguf, from_dir = engine_for(path, kernels="torch"), engine_for(hf_dir, kernels="torch")
    assert from_gguf.model_config.architecture == from_dir.model_config.architecture
    a, b = from_gguf.runner.model.state_dict(), from_dir.runner.model.state_dict()
    assert "layers.0.self_attn.qkv_proj.weight" in a
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert greedy(from_gguf) == greedy(from_dir)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_tokenizer_and_chat_template_equal_transformers(tiny_model, gguf_dir, arch):
    path = write_gguf(tiny_model(arch), gguf_dir / f"{arch}-tok.gguf", "Q8_0", pre="qwen2" if arch == "qwen2" else "gpt-2")
    ours = load_tokenizer(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = tiny_corpus()[:40] + ["", " ", "  two  spaces", "tabs\tand\nnewlines\n\n", "<|im_start|>x<|im_end|>",
                                  "<s>no</s>", "12345 6789", "naïve 東京 🙂"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi!"},
                {"role": "user", "content": "the river and the mountain"}]
    ref_ids = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ours.encode_chat(messages) == ref_ids["input_ids"]
    assert ours.eos_token_ids == {ref.eos_token_id}


def test_gguf_with_linear_rope_scaling_equals_the_hf_checkpoint(tiny_model, gguf_dir):
    """transformers' GGUF loader drops rope.scaling metadata; duet applies it (and equals the HF directory)."""
    hf_dir = tiny_model("llama", rope_scaling={"rope_type": "linear", "factor": 4.0})
    path = write_gguf(hf_dir, gguf_dir / "linear.gguf", "F32",
                      metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    cfg = load_model_config(path)
    assert (cfg.rope_type, cfg.rope_params_dict) == ("linear", {"factor": 4.0})
    assert greedy(engine_for(path)) == greedy(engine_for(hf_dir))


def llama_cpp_rope_freqs(head_dim: int, theta: float, factor: float, low: float, high: float, old_ctx: int):
    """The ``rope_freqs`` tensor llama.cpp's converter writes for a llama3-rope checkpoint (its own formula)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_gguf_rope_freqs_equal_llama3_rope_scaling(tiny_model, gguf_dir):
    """A Llama-3.1-style GGUF carries its RoPE scaling as rope_freqs; it runs like the HF llama3 checkpoint."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf_dir = tiny_model("llama", rope_scaling=scaling)
    factors = llama_cpp_rope_freqs(16, 10000.0, 8.0, 1.0, 4.0, 64)
    assert len(set(factors.tolist())) > 2  # low, high and smoothed frequencies all present at this shape
    path = write_gguf(hf_dir, gguf_dir / "llama31.gguf", "F32", extra_tensors={"rope_freqs.weight": factors})
    cfg = load_model_config(path)
    assert cfg.rope_freq_factors == tuple(factors.tolist()) and cfg.rope_type == "default"
    assert greedy(engine_for(path), n=40) == greedy(engine_for(hf_dir), n=40)


@pytest.mark.parametrize("kw, message", [
    (dict(metadata={"llama.attention.sliding_window": 64}), "llama.attention.sliding_window=64"),
    (dict(metadata={"llama.attn_logit_softcapping": 30.0}), "llama.attn_logit_softcapping=30.0"),
    (dict(metadata={"llama.expert_count": 8}), r"expert_count=8 \(mixture of experts\)"),
    (dict(metadata={"llama.rope.dimension_count": 8}), r"rope.dimension_count=8 < head dim 16 \(partial rotary\)"),
    (dict(metadata={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}),
     "rope.scaling.type='yarn' is not supported"),
    (dict(extra_tensors={"rope_freqs.weight": np.ones(5)}), "rope_freqs has 5 factors, head_dim 16 needs 8"),
    (dict(tokenizer_model="llama"), "a SentencePiece vocabulary needs tokenizer.ggml.scores"),
    (dict(tokenizer_model="t5"), "tokenizer.ggml.model='t5' is not supported"),
    (dict(pre="made-up-pre"), "tokenizer.ggml.pre='made-up-pre' is not a pre-tokenizer duet knows"),
    (dict(drop_metadata=("tokenizer.ggml.pre",)), "tokenizer.ggml.pre=None"),
    (dict(drop_metadata=("llama.block_count",)), "no 'llama.block_count'"),
])
def test_gguf_variants_duet_does_not_implement_are_refused_by_name(tiny_model, gguf_dir, kw, message):
    path = write_gguf(tiny_model("llama"), gguf_dir / "odd.gguf", "Q8_0", **kw)
    with pytest.raises(ModelLoadError, match=message):
        engine_for(path)


def test_unsupported_gguf_architecture_and_tensor_type(tiny_model, gguf_dir):
    w = gguf.GGUFWriter(str(gguf_dir / "gemma.gguf"), "gemma")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'gemma' is not supported"):
        load_model_config(gguf_dir / "gemma.gguf")
    path = write_gguf(tiny_model("llama"), gguf_dir / "q81.gguf", "Q8_0")
    odd = gguf_dir / "q81-odd.gguf"
    _rewrite_with_q8_1_tensor(path, odd)
    with pytest.raises(ModelLoadError, match="type Q8_1, which the gguf package cannot dequantize"):
        engine_for(odd)


def _rewrite_with_q8_1_tensor(src: Path, dst: Path) -> None:
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(name, value)
        else:
            w.add_key_value(name, value, vtype)
    for t in reader.tensors:
        if t.name == "blk.0.ffn_down.weight":  # as Q8_1, a type llama.cpp has and gguf-py cannot dequantize
            rows, cols = int(t.shape[1]), int(t.shape[0])
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            w.add_tensor(t.name, np.zeros((rows, cols // block * size), np.uint8),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def test_corrupt_gguf_is_a_load_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    assert is_gguf(bad)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        load_model_config(bad)
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_model_config(tmp_path / "missing.gguf")


def test_served_names(tmp_path, tiny_model, gguf_dir):
    path = write_gguf(tiny_model("llama"), gguf_dir / "Tiny-Chat-7B.Q4_K_M.gguf", "Q8_0")
    assert checkpoint_name(path) == "Tiny-Chat-7B"
    assert checkpoint_name(path.rename(gguf_dir / "tiny-f16.gguf")) == "tiny"
    assert checkpoint_name(tiny_model("llama")) == Path(tiny_model("llama")).name
    assert GGUFCheckpoint(gguf_dir / "tiny-f16.gguf").model_config().model_id == "tiny"


def test_cli_generate_from_a_gguf_file(tiny_model, gguf_dir):
    path = write_gguf(tiny_model("qwen2"), gguf_dir / "cli.gguf", "Q8_0", pre="qwen2")
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "--model", str(path), "--chat",
                          "--prompt", "the river", "--max-tokens", "8", "--num-blocks", "32"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    engine = engine_for(path)
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "the river"}])
    want = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0))[0]["text"]
    assert out.stdout.strip() == want.strip()
    bad = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "--model", str(gguf_dir / "nope.gguf")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "duet: error:" in bad.stderr and "Traceback" not in bad.stderr


def test_router_reads_a_gguf_config_and_tokenizer_without_torch(tiny_model, gguf_dir):
    """The router process never imports torch (it tokenizes and builds the model card from the GGUF too)."""
    path = write_gguf(tiny_model("llama"), gguf_dir / "router.gguf", "Q4_0")
    code = ("import sys; from engine.loading.checkpoint import load_model_config, load_tokenizer; "
            f"load_model_config({str(path)!r}); load_tokenizer({str(path)!r}).encode('hi'); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120).returncode == 0
