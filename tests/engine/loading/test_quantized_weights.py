"""A GGUF file's quantized weights kept packed (issue 48, engine/loading/quantized.py): tiny Llama checkpoints written
by the ``gguf`` package in each block type the kernels take, loaded with their weights packed and with every weight
dequantized at load (``quantized_weights: dense``, the path before issue 48). The packed weights dequantize to
exactly the dense ones (the repack is lossless), the logits of the two engines match, greedy tokens are equal, and
the packed engine holds the file's quantized bytes instead of float32 weights. The k-quants (Q4_K, Q5_K, Q6_K: rows of
256-weight super-blocks) on a tiny Llama whose hidden and intermediate sizes are multiples of 256 (else the writer, like
llama.cpp, stores F32), random super-blocks with sane scales."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ConfigError
from engine.loading.gguf import open_gguf
from engine.models.layers import QuantParts
from engine.request import SamplingParams
from kernels.quant import GGUF_BLOCKS, dequantize_ref
from tests.engine.loading.gguf_files import write_gguf
from tests.engine.models.test_kernel_backends import prompt_logits
from tests.engine.models.test_parity import random_prompts

FORMATS = sorted(set(GGUF_BLOCKS) & {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})
K_QUANT_MODEL = {"hidden_size": 256, "intermediate_size": 512}  # every projection's rows 256-multiples


@pytest.fixture(scope="module", params=FORMATS)
def gguf_file(request, tiny_model, tmp_path_factory):
    model = tiny_model("llama", **K_QUANT_MODEL) if GGUF_BLOCKS[request.param].k_quant else tiny_model("llama")
    return write_gguf(model, tmp_path_factory.mktemp("q") / f"tiny.{request.param}.gguf", request.param)


def engines(path, kernels: str = "torch", activations: str = "fp32") -> tuple[Engine, Engine]:
    config = EngineConfig(model=str(path), num_blocks=64, dtype="float32", kernels=kernels)
    return Engine(config.replace(quantized_activations=activations)), Engine(config.replace(quantized_weights="dense"))


def test_packed_weights_equal_the_dequantized_ones_and_so_do_the_outputs(gguf_file):
    packed, dense = engines(gguf_file)
    fmt = gguf_file.suffixes[-2].lstrip(".")
    model, ref = packed.runner.model, dense.runner.model
    linears = [(name, lin) for name, lin in model.named_modules() if getattr(lin, "quant", None) is not None]
    assert len(linears) == 4 * model.cfg.num_layers + 1  # qkv, o, gate_up, down; the head (tied: the table)
    for name, lin in linears:  # q/k/v and gate/up joined row-wise: exactly the dense fused weights
        assert lin.quant.fmt == fmt and lin.weight is None
        assert torch.equal(dequantize_ref(lin.quant), ref.get_submodule(name).weight), name
    assert model.embed_quant is not None and torch.equal(dequantize_ref(model.embed_quant), ref.embed_tokens.weight)
    prompt = random_prompts(512, lens=(40,))[0]
    assert torch.equal(prompt_logits(packed, prompt), prompt_logits(dense, prompt))  # the same fp32 GEMMs
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = random_prompts(512, lens=(5, 33))
    assert [r["token_ids"] for r in packed.generate(prompts, params)] == \
        [r["token_ids"] for r in dense.generate(prompts, params)]


def test_the_packed_engine_holds_the_files_quantized_bytes(gguf_file):
    packed, dense = engines(gguf_file)
    ckpt = open_gguf(gguf_file)
    quantized_bytes = sum(int(t.n_bytes) for t in ckpt._reader.tensors if t.tensor_type.name in GGUF_BLOCKS)
    model = packed.runner.model
    held = sum(m.quant.num_bytes for m in model.modules() if getattr(m, "quant", None) is not None)  # tied: once
    held += 0 if model.cfg.tie_word_embeddings else model.embed_quant.num_bytes
    assert held == quantized_bytes  # every quantized tensor of the file, packed as it is
    dense_bytes = sum(p.numel() * p.element_size() for p in dense.runner.model.parameters())
    packed_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + held
    assert packed_bytes < dense_bytes / 2.5


def test_dense_is_the_old_path_and_a_bad_value_is_refused(gguf_file):
    _, dense = engines(gguf_file)
    assert all(getattr(m, "quant", None) is None for m in dense.runner.model.modules())
    assert dense.runner.model.embed_quant is None
    with pytest.raises(ConfigError, match="quantized_weights must be 'auto' or 'dense', got 'packed'"):
        EngineConfig(model=str(gguf_file), quantized_weights="packed")
    with pytest.raises(ConfigError, match="quantized_activations must be 'fp32' or 'int8', got 'int4'"):
        EngineConfig(model=str(gguf_file), quantized_activations="int4")
    with pytest.raises(ConfigError, match="quantized_activations 'int8' needs the cpu kernel backend, not torch"):
        Engine(EngineConfig(model=str(gguf_file), kernels="torch", quantized_activations="int8"))


@pytest.mark.parametrize("activations, rel_rms", [("fp32", 1e-5), ("int8", 0.05)])
def test_the_cpu_kernels_serve_packed_weights_close_to_the_dense_engine(gguf_file, activations, rel_rms):
    """The C kernels (kernels/cpu_quant.py) against the same engine on the dequantized weights. Stated tolerances, as
    the RMS of the logits' error over their spread: fp32 activations 1e-5 (reordered fp32 sums, measured ~1.5e-6);
    int8 activations per 32-block (llama.cpp's scheme, the default) 5 % on this random tiny model, whose logits
    amplify every error (measured 2.4-2.7 %); the k-quants' x per 256 (llama.cpp's q8_K) 10 % (measured 3.0 % Q6_K,
    4.1 % Q5_K, 6.3 % Q4_K). fp32 (the default): the same greedy tokens; int8: the same argmax at >= 85 % of the
    prompt's positions (measured 87.5-100 %: a random model's near-ties flip under 8-bit activations, which is why
    int8 is opt-in: ``quantized_activations``)."""
    fmt = gguf_file.suffixes[-2].lstrip(".")
    exact = activations == "fp32"  # every format has an int8 kernel (the k-quants: x per 256, as llama.cpp's q8_K)
    if not exact and GGUF_BLOCKS[fmt].k_quant:
        rel_rms = 0.1
    packed, dense = engines(gguf_file, kernels="cpu", activations=activations)
    assert packed.runner.model.layers[0].self_attn.qkv_proj.quant is not None
    prompt = random_prompts(512, lens=(40,))[0]
    ours, ref = prompt_logits(packed, prompt), prompt_logits(dense, prompt)
    assert (ours - ref).pow(2).mean().sqrt() <= rel_rms * ref.std()
    if not exact:
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85
        return
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = random_prompts(512, lens=(5, 33))
    assert [r["token_ids"] for r in packed.generate(prompts, params)] == \
        [r["token_ids"] for r in dense.generate(prompts, params)]


@pytest.mark.parametrize("qtype, v_type, model", [("Q4_1", "Q8_0", {}), ("Q4_K", "Q6_K", K_QUANT_MODEL),
                                                   ("Q4_1", "F16", {})])
def test_a_fused_projection_of_mixed_types(tiny_model, tmp_path, qtype, v_type, model):
    """A Q4_K_M file's q and k in Q4_K and v in Q6_K (in about half the layers): that qkv stays packed as two parts
    (engine/models/layers.py ``QuantParts``: q and k joined, v apart), each exactly its dense rows. A piece in a
    float type (F16 v) cannot be packed: that qkv is dequantized at load, its q and k arriving as blocks (their type
    is kept elsewhere) and dequantized by the loader."""
    path = write_gguf(tiny_model("llama", **model), tmp_path / f"mixed.{qtype}.gguf", qtype,
                      qtype_of={"attn_v": v_type, "ffn_down": v_type})
    packed, dense = engines(path)
    m, ref = packed.runner.model, dense.runner.model
    q_rows = (m.cfg.num_heads + m.cfg.num_kv_heads) * m.cfg.head_dim
    for layer, ref_layer in zip(m.layers, ref.layers):
        qkv, want = layer.self_attn.qkv_proj, ref_layer.self_attn.qkv_proj.weight
        assert layer.self_attn.o_proj.quant.fmt == qtype
        if v_type == "F16":
            assert qkv.quant is None and torch.equal(qkv.weight, want)
            continue
        assert isinstance(qkv.quant, QuantParts) and qkv.quant.fmt == f"{qtype}+{v_type}"
        assert [(r0, p.fmt) for r0, p in qkv.quant.parts] == [(0, qtype), (q_rows, v_type)]
        assert torch.equal(torch.cat([dequantize_ref(p) for _, p in qkv.quant.parts]), want)
        assert layer.mlp.down_proj.quant.fmt == v_type
    prompt = random_prompts(512, lens=(40,))[0]
    assert torch.equal(prompt_logits(packed, prompt), prompt_logits(dense, prompt))



def test_int8_activations_prefill_on_bf16_tiles(gguf_file, monkeypatch):
    """A prompt of GEMM_ROWS_BF16 tokens or more with int8 activations: on a CPU with AMX-BF16 every packed linear
    runs bf16 tiles through torch's bf16 GEMM (kernels/cpu_quant.py; bit-exact with it: tests/kernels/
    test_cpu_quant_bf16.py), elsewhere the fp32 tiles or the int8 GEMV. Against the dense engine, the RMS of the
    logits' error over their spread within 10 % and the argmax equal at >= 90 % of positions: measured on bf16 tiles
    1.1-2.1 % (Q5_K 8.8 %) and 92-100 %, against the int8 GEMV's 2.5-6.5 % (Q6_K 18.7 %) on the same prompt — this
    random tiny model amplifies any rounding."""
    from kernels import cpu_quant, cpu_quant_isa

    called = []
    real = cpu_quant._linear_gemm_bf16
    monkeypatch.setattr(cpu_quant, "_linear_gemm_bf16", lambda *a: called.append(1) or real(*a))
    packed, dense = engines(gguf_file, kernels="cpu", activations="int8")
    prompt = random_prompts(512, lens=(cpu_quant.GEMM_ROWS_BF16 + 16,))[0]
    ours, ref = prompt_logits(packed, prompt), prompt_logits(dense, prompt)
    assert bool(called) == cpu_quant_isa.amx_bf16()
    assert (ours - ref).pow(2).mean().sqrt() <= 0.1 * ref.std()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
