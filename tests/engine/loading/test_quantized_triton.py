"""A GGUF file's quantized weights kept packed on the triton backend (kernels/quant_gpu.py, quant_gemm.py,
quant_rows.py): a tiny Llama written by the ``gguf`` package in Q4_1 (4-bit nibbles, fp16 scale and min per
32-block), run in the Triton interpreter on a CPU and compiled on a GPU.

Against the same backend on the weights dequantized at load (``quantized_weights: dense``): the same greedy tokens,
and prompt logits within 1e-4 (std ~4; the same fp32 products in another summation order, measured ~1e-6 in the
interpreter). Every projection, the token table and the LM head stay packed, and the packed bytes are the file's.
The decode forward reads no tensor value on the host with the data checks off (what a CUDA graph captures), and
decode steps on the graph path's static padded buffers give the eager steps' tokens and log-probs (real CUDA graphs
on a GPU).
"""
from __future__ import annotations

import os

import pytest
import torch

from engine.config import EngineConfig
from engine.decode_graphs import DecodeGraphs
from engine.engine import Engine
from engine.request import SamplingParams
from kernels.quant_gpu import GpuQuant, dequantize_ref
from tests.engine.loading.gguf_files import write_gguf
from tests.engine.models.test_kernel_backends import prompt_logits
from tests.engine.test_decode_graphs import _HostReads, run

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton needs CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU-only machines)")
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"
PROMPTS = [[5, 6, 7], list(range(10, 43)), list(range(60, 80))]


@pytest.fixture(scope="module")
def q4_1(tiny_model, tmp_path_factory):
    return write_gguf(tiny_model("llama"), tmp_path_factory.mktemp("q") / "tiny.Q4_1.gguf", "Q4_1")


def engine(path, graphs: int = 0, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), num_blocks=32, max_num_seqs=8, device=DEVICE, dtype="float32",
                               kernels="triton", cuda_graph_max_batch=graphs, **kw))


def test_every_weight_stays_packed_as_the_files_bytes(q4_1):
    from engine.loading.gguf import open_gguf

    packed, dense = engine(q4_1), engine(q4_1, quantized_weights="dense")
    model, ref = packed.runner.model, dense.runner.model
    linears = [(name, m) for name, m in model.named_modules() if isinstance(getattr(m, "quant", None), GpuQuant)]
    assert len(linears) == 4 * model.cfg.num_layers + 1  # qkv, o, gate_up, down; the LM head
    for name, lin in linears:  # q/k/v and gate/up joined row-wise: exactly the dense fused weights
        assert lin.weight is None and lin.quant.qs.device.type == DEVICE
        assert torch.equal(dequantize_ref(lin.quant), ref.get_submodule(name).weight), name
    assert torch.equal(dequantize_ref(model.embed_quant), ref.embed_tokens.weight)
    held = [m.quant for _, m in linears] + [model.embed_quant]
    ckpt = open_gguf(q4_1)
    assert sum(p.num_bytes for p in held) == sum(int(t.n_bytes) for t in ckpt._reader.tensors
                                                 if t.tensor_type.name == "Q4_1")


@pytest.mark.slow
def test_packed_on_triton_answers_as_the_dequantized_engine(q4_1):
    packed, dense = engine(q4_1), engine(q4_1, quantized_weights="dense")
    la, lb = prompt_logits(packed, PROMPTS[1]), prompt_logits(dense, PROMPTS[1])
    assert (la - lb).abs().max() <= 1e-4 and la.std() > 1
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert [r["token_ids"] for r in packed.generate(PROMPTS, params)] == \
        [r["token_ids"] for r in dense.generate(PROMPTS, params)]


def test_decode_forward_reads_no_values_on_the_host(q4_1, monkeypatch):
    e = engine(q4_1)
    g = DecodeGraphs(e.runner, 4, 8, capture=False)
    g._fill(4, [5, 6], [3, 4], [40, 41], [[2], [2]], [4, 5])
    monkeypatch.setenv("DUET_KERNEL_CHECKS", "0")
    probe = _HostReads()
    with torch.inference_mode(), probe:
        out = g._forward(4)
    assert out.shape == (4, e.model_config.hidden_size) and bool(out.isfinite().all())
    assert probe.seen == []


@pytest.mark.slow
def test_graph_path_decodes_as_eager(q4_1):
    eager, graphed = engine(q4_1), engine(q4_1, graphs=6 if ON_GPU else 0)
    if not ON_GPU:  # the static padded buffers, the forward run eagerly on them (tests/engine/test_decode_graphs.py)
        r = graphed.runner
        r.decode_graphs = DecodeGraphs(r, 6, -(-graphed.max_model_len // graphed.config.block_size), capture=False)
    assert graphed.runner.decode_graphs is not None and not graphed.runner.fallbacks
    assert run(graphed) == run(eager)
