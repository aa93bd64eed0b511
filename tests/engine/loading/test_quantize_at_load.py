"""``quantization: int8 | int4`` (engine/loading/quantize.py): a float checkpoint's projections quantized at load into
Q8_0 / Q4_1 blocks (the token table and LM head into Q8_0), kept packed, against the same engine with the same blocks
dequantized back into float (``quantized_weights: dense``, the reference). Every projection and the table hold exactly
the gguf-py blocks of their float weights; the torch backend's logits equal the reference's bit for bit (the same
fp32 GEMMs), the C kernels' (the GEMV at decode shapes) within 1e-5 of the logits' spread, greedy tokens equal; the
weights take under a third of their float bytes; what cannot be done is refused by name."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ConfigError
from engine.request import SamplingParams
from kernels.quant import QuantWeight, dequantize_ref
from tests.engine.loading.gguf_files import write_gguf
from tests.engine.models.test_kernel_backends import prompt_logits
from tests.engine.models.test_parity import random_prompts

FORMAT = {"int8": "Q8_0", "int4": "Q4_1"}
REL_RMS = 1e-5  # the C GEMV: reordered fp32 sums (tests/kernels/test_cpu_quant.py; measured ~5e-7 there)


def engines(path, scheme: str, kernels: str) -> tuple[Engine, Engine]:
    config = EngineConfig(model=str(path), num_blocks=64, dtype="float32", kernels=kernels, quantization=scheme)
    return Engine(config), Engine(config.replace(quantized_weights="dense"))


def greedy(engine: Engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    return [r["token_ids"] for r in engine.generate(random_prompts(512, lens=(5, 19)), params)]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_at_load_packed_equals_its_dequantized_reference(tiny_model, scheme):
    path = tiny_model("llama", tie_word_embeddings=False)
    float_weights = load_file(str(path / "model.safetensors"))
    packed, dense = engines(path, scheme, "torch")
    model = packed.runner.model
    fmt = FORMAT[scheme]
    q_proj = model.layers[0].self_attn.qkv_proj.quant  # q, k, v rows of blocks, joined: each the file's rows'
    want = np.concatenate([gguf.quantize(float_weights[f"model.layers.0.self_attn.{p}_proj.weight"],
                                         gguf.GGMLQuantizationType[fmt]) for p in "qkv"])
    assert isinstance(q_proj, QuantWeight) and q_proj.fmt == fmt and np.array_equal(q_proj.data.numpy(), want)
    assert model.embed_quant.fmt == model.lm_head.quant.fmt == "Q8_0" and model.embed_quant is not model.lm_head.quant
    assert np.array_equal(model.embed_quant.data.numpy(), gguf.quantize(float_weights["model.embed_tokens.weight"],
                                                                        gguf.GGMLQuantizationType.Q8_0))
    linears = [m for m in model.modules() if getattr(m, "quant", None) is not None]
    assert len(linears) == 4 * model.cfg.num_layers + 1 and all(m.weight is None for m in linears)
    ref = dense.runner.model
    assert torch.equal(ref.layers[0].self_attn.qkv_proj.weight, dequantize_ref(q_proj))  # the reference's weights
    prompt = random_prompts(512, lens=(30,))[0]
    assert torch.equal(prompt_logits(packed, prompt), prompt_logits(dense, prompt))
    assert greedy(packed) == greedy(dense)
    held = sum(m.quant.num_bytes for m in linears) + model.embed_quant.num_bytes
    floats = sum(p.numel() * 4 for p in ref.parameters())
    assert held + sum(p.numel() * 4 for p in model.parameters()) < floats / 3


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_at_load_on_the_cpu_kernels(tiny_model, scheme):
    """The C GEMV (prompt of 16 rows < GEMM_ROWS_FP32: not the tiles), the tied table packed once for both uses."""
    packed, dense = engines(tiny_model("qwen2"), scheme, "cpu")  # qwen2: tied embeddings, q/k/v biases
    model = packed.runner.model
    assert model.embed_quant is model.lm_head.quant and model.embed_tokens.weight is None
    prompt = random_prompts(512, lens=(16,))[0]
    ours, ref = prompt_logits(packed, prompt), prompt_logits(dense, prompt)
    assert not torch.equal(ours, ref)  # the GEMV's own fp32 order ...
    assert (ours - ref).pow(2).mean().sqrt() <= REL_RMS * ref.std()  # ... within the stated tolerance
    assert greedy(packed) == greedy(dense)


def test_what_quantization_at_load_cannot_do_is_refused(tiny_model, tmp_path):
    path = tiny_model("llama")
    with pytest.raises(ConfigError, match="quantization must be one of None, 'w8a16', 'int8', 'int4', got 'int2'"):
        EngineConfig(model=str(path), quantization="int2")
    gguf_file = write_gguf(path, tmp_path / "tiny.Q8_0.gguf", "Q8_0")
    with pytest.raises(ConfigError, match=r"quantized already \(Q8_0 tensors\)"):
        Engine(EngineConfig(model=str(gguf_file), num_blocks=64, kernels="torch", quantization="int4"))
    # the triton kernels take Q4_1 and Q8_0 (kernels/quant_gemm.py): packed there too, not refused
    triton = Engine(EngineConfig(model=str(path), num_blocks=64, kernels="triton", quantization="int4"))
    assert triton.runner.model.layers[0].mlp.down_proj.quant.fmt == "Q4_1"
    with pytest.raises(ConfigError, match="packs weights for the float32 kernels; this model runs in torch.bfloat16"):
        Engine(EngineConfig(model=str(path), num_blocks=64, kernels="torch", dtype="bfloat16", quantization="int8"))
