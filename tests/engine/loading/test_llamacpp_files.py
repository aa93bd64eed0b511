"""GGUF files quantized by llama.cpp's own llama-quantize (tests/engine/loading/llamacpp_files/, written by
tools/make_llamacpp_fixtures.py): the k-quant mixes Q4_K_M and Q5_K_M (Q4_K / Q5_K with Q6_K) and Q4_1 as llama.cpp
really makes them, kept packed (issue 48, must-show 1). Every quantized tensor dequantizes bit-exactly as the gguf
package does it; the packed engine's weights are exactly the dense engine's (``quantized_weights: dense``); the
logits equal that dense engine's (torch references: bit for bit; the C kernels with fp32 activations: within 1e-5
of the logits' spread, RMS); greedy tokens equal, decode steps replayed from CPU recordings included."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.models.layers import QuantParts
from engine.request import SamplingParams
from kernels.quant import GGUF_BLOCKS, QuantWeight, dequantize_ref
from tests.engine.models.test_kernel_backends import prompt_logits
from tests.engine.models.test_parity import random_prompts

FILES = sorted((Path(__file__).parent / "llamacpp_files").glob("*.gguf"))
MIXES = {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"}, "Q4_1": {"Q4_1", "Q6_K"}}  # llama.cpp: the head Q6_K


def test_the_files_are_llamacpps_mixes():
    assert {f.name.split(".")[1] for f in FILES} == set(MIXES)
    for f in FILES:
        kinds = {t.tensor_type.name for t in gguf.GGUFReader(f).tensors} - {"F32"}
        assert kinds == MIXES[f.name.split(".")[1]], f.name


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_tensor_dequantizes_as_the_gguf_package_does(path):
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type.name not in GGUF_BLOCKS:
            continue
        rows, cols = int(t.shape[1]), int(t.shape[0])
        w = QuantWeight(t.tensor_type.name, rows, cols, torch.from_numpy(np.array(t.data).reshape(rows, -1)))
        want = gguf.dequantize(t.data, t.tensor_type).reshape(rows, cols)
        assert torch.equal(dequantize_ref(w), torch.from_numpy(np.ascontiguousarray(want))), t.name


@pytest.fixture(scope="module", params=FILES, ids=lambda p: p.name)
def engines(request):
    config = EngineConfig(model=str(request.param), num_blocks=64, dtype="float32", max_num_seqs=4)
    return {k: Engine(config.replace(kernels=k)) for k in ("torch", "cpu")} | {
        "dense": Engine(config.replace(kernels="torch", quantized_weights="dense"))}


def dequantized(q) -> torch.Tensor:
    if isinstance(q, QuantParts):
        return torch.cat([dequantize_ref(p) for _, p in q.parts])
    return dequantize_ref(q)


def test_packed_weights_equal_the_dense_engines(engines):
    packed, dense = engines["torch"].runner.model, engines["dense"].runner.model
    linears = [(n, m) for n, m in packed.named_modules() if getattr(m, "quant", None) is not None]
    assert len(linears) == 4 * packed.cfg.num_layers + 1  # qkv, o, gate_up, down; the untied head
    for name, lin in linears:
        assert lin.weight is None and torch.equal(dequantized(lin.quant), dense.get_submodule(name).weight), name
    qkv = packed.layers[0].self_attn.qkv_proj.quant  # the k-quant mixes: q, k in Q4_K / Q5_K, v in Q6_K: two parts
    if engines["torch"].config.model.endswith("_K_M.gguf"):
        assert isinstance(qkv, QuantParts) and [p.fmt for _, p in qkv.parts][1] == "Q6_K", qkv.fmt
        q_rows = packed.cfg.num_heads * packed.cfg.head_dim + packed.cfg.num_kv_heads * packed.cfg.head_dim
        assert [r0 for r0, _ in qkv.parts] == [0, q_rows]
    assert torch.equal(dequantize_ref(packed.embed_quant), dense.embed_tokens.weight)


def test_logits_and_greedy_tokens_equal_the_dense_engines(engines):
    prompt = random_prompts(320, lens=(37,))[0]
    ref = prompt_logits(engines["dense"], prompt)
    assert torch.equal(prompt_logits(engines["torch"], prompt), ref)  # the references' fp32 GEMMs
    ours = prompt_logits(engines["cpu"], prompt)
    assert (ours - ref).pow(2).mean().sqrt() <= 1e-5 * ref.std()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = random_prompts(320, lens=(5, 29, 12))
    want = [r["token_ids"] for r in engines["dense"].generate(prompts, params)]
    assert [r["token_ids"] for r in engines["torch"].generate(prompts, params)] == want
    cpu = engines["cpu"]
    assert [r["token_ids"] for r in cpu.generate(prompts, params)] == want
    assert cpu.runner.decode_graphs is not None and cpu.runner.decode_graphs.replays > 0  # recorded decode steps


def test_the_weights_summary_counts_every_part(engines):
    """What /v1/models and /metrics report (engine/loading/resident.py) for a projection packed in parts: both
    formats, every part's bytes."""
    from engine.loading.resident import summarize_weights

    e = engines["cpu"]
    model = e.runner.model
    summary = summarize_weights(model, e.runner.ops, "eager")
    held = sum(m.quant.num_bytes for m in model.modules() if getattr(m, "quant", None) is not None)
    held += model.embed_quant.num_bytes
    assert sum(g.num_bytes for g in summary.groups if "packed" in g.format) == held
    if e.config.model.endswith("_K_M.gguf"):
        qkv = next(g for g in summary.groups if g.kind == "attention qkv")
        assert "Q6_K" in qkv.format and "Q6_K" in qkv.kernel, qkv
