"""Decode steps on the CUDA-graph path's static, padded buffers (engine/decode_graphs.py ``DecodeGraphs``).

On a CPU there are no CUDA graphs, so these tests run ``DecodeGraphs(capture=False)``: the same static buffers,
bucketing and padding rows, the forward run eagerly on them (on the triton backend too: the kernels a GPU would
capture, in the interpreter). What they check is what a graph would replay: a batch padded to its bucket gives the
tokens and log-probs of the unpadded eager step, and the padding rows write nothing into the KV cache. On a CUDA
machine the triton cases run on the GPU with real captured graphs against an engine without them.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config import EngineConfig
from engine.decode_graphs import DecodeGraphs
from engine.engine import Engine
from engine.errors import ConfigError
from engine.request import SamplingParams

# five prompts of different lengths: decode batches of 5, then fewer as requests finish (max_tokens differ)
PROMPTS = [[5, 6, 7], list(range(10, 43)), list(range(60, 80)), [9] * 17, list(range(100, 131))]
MAX_TOKENS = [9, 4, 7, 12, 6]


def run(engine: Engine) -> dict[str, tuple[list[int], list[float]]]:
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(
        max_tokens=m, temperature=0, ignore_eos=True, logprobs=0)).request_id for p, m in zip(PROMPTS, MAX_TOKENS)]
    got: dict[str, tuple[list[int], list[float]]] = {i: ([], []) for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.new_logprobs)
    return {str(k): got[i] for k, i in enumerate(ids)}


ON_GPU = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not ON_GPU,
                                  reason="Triton needs CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it on CPUs)")


def make(model_dir, kernels: str, graphs: bool) -> Engine:
    """A CPU engine, or for ``triton`` on a CUDA machine a GPU engine with (``graphs``) or without CUDA graphs."""
    device = "cuda" if kernels == "triton" and ON_GPU else "cpu"
    e = Engine(EngineConfig(model=str(model_dir), num_blocks=64, max_num_seqs=8, kernels=kernels, device=device,
                            cuda_graph_max_batch=6 if graphs else 0))
    if device == "cpu":
        assert e.runner.decode_graphs is None  # a CPU engine captures no graphs
        if graphs:
            r = e.runner
            r.decode_graphs = DecodeGraphs(r, 6, -(-e.max_model_len // e.config.block_size), capture=False)
    return e


@pytest.mark.parametrize("kernels", ["torch", "cpu", pytest.param("triton", marks=[pytest.mark.slow, needs_triton])])
def test_padded_static_decode_matches_eager(tiny_model, kernels):
    model_dir = tiny_model("llama")
    eager, padded = make(model_dir, kernels, False), make(model_dir, kernels, True)
    want, got = run(eager), run(padded)
    graphs = padded.runner.decode_graphs
    assert set(graphs.graphs) == {6, 4, 2, 1}  # decode batches of 5, 4, 3, 2, 1 → buckets 6, 4, 4, 2, 1
    if padded.runner.device.type == "cuda":  # real graphs: every bucket captured, every decode step replayed
        assert padded.runner.fallbacks == [] and all(g is not None for g, _ in graphs.graphs.values())
        assert graphs.replays > 0 and eager.runner.decode_graphs is None
    for k in want:
        assert got[k][0] == want[k][0], k
        assert len(got[k][0]) == MAX_TOKENS[int(k)]
        torch.testing.assert_close(torch.tensor(got[k][1]), torch.tensor(want[k][1]), rtol=0, atol=1e-4)
    # padding rows (slot -1) wrote nothing: both caches hold the same K/V in every block
    torch.testing.assert_close(padded.runner.kv_cache, eager.runner.kv_cache, rtol=0, atol=1e-5)


def test_buckets_and_padding_rows(tiny_model):
    e = make(tiny_model("llama"), "torch", False)
    g = DecodeGraphs(e.runner, 20, 4, capture=False)
    assert g.sizes == [1, 2, 4, 8, 16, 20]
    assert [g.bucket(n) for n in (1, 3, 5, 8, 9, 17, 20)] == [1, 4, 8, 8, 16, 20, 20]
    g._fill(4, [9, 9, 9], [50, 50, 50], [1, 2, 3], [[3, 3, 3, 3]] * 3, [60, 60, 60])  # wider, then narrower:
    g._fill(4, [11, 12], [3, 7], [5, 40], [[0], [2, 2, 2]], [4, 8])  # nothing of the first batch may remain
    assert g.input_ids[:4].tolist() == [11, 12, 0, 0]
    assert g.slots[:4].tolist() == [5, 40, -1, -1]
    assert g.seq_lens[:4].tolist() == [4, 8, 1, 1]
    assert g.tables[:4].tolist() == [[0, 0, 0, 0], [2, 2, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert DecodeGraphs(e.runner, 1, 4, capture=False).sizes == [1]
    assert DecodeGraphs(e.runner, 8, 4, capture=False).sizes == [1, 2, 4, 8]


def test_graph_batch_limit_is_validated():
    with pytest.raises(ConfigError, match="cuda_graph_max_batch"):
        EngineConfig(model="m", cuda_graph_max_batch=-1)


class _HostReads(TorchDispatchMode):
    """Records the aten ops that read a tensor's values on the host (a device sync on CUDA, which a graph
    capture refuses)."""
    SYNCING = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.is_nonzero", "aten.equal")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.SYNCING):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@needs_triton
def test_triton_decode_forward_reads_no_values_on_the_host(tiny_model, monkeypatch):
    """What a CUDA graph captures: the decode forward of the triton backend, data checks off as on CUDA, must
    not read tensor values on the host. With the checks on (the CPU default) the probe sees them: it works."""
    e = Engine(EngineConfig(model=str(tiny_model("llama")), num_blocks=32, kernels="triton",
                            device="cuda" if ON_GPU else "cpu", cuda_graph_max_batch=0))
    g = DecodeGraphs(e.runner, 4, 8, capture=False)
    g._fill(4, [5, 6], [3, 4], [40, 41], [[2], [2]], [4, 5])
    probes = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("DUET_KERNEL_CHECKS", setting)
        probes[setting] = _HostReads()
        with torch.inference_mode(), probes[setting]:
            out = g._forward(4)
        assert out.shape == (4, e.model_config.hidden_size) and bool(out.isfinite().all())
    assert probes["1"].seen, "the probe saw none of the checks' host reads"
    assert probes["0"].seen == []


def test_capture_all_fills_every_bucket_once(tiny_model):
    e = make(tiny_model("llama"), "torch", False)
    assert e.capture_decode_graphs() == 0  # a CPU engine has no graphs: nothing to capture
    g = DecodeGraphs(e.runner, 20, 4, capture=False)
    g.graphs[4] = (None, None)  # one bucket already there (a decode batch ran): not captured again
    assert g.capture_all() == len(g.sizes) - 1 and set(g.graphs) == set(g.sizes)
    assert g.capture_all() == 0


def test_moe_layers_count_the_real_rows_of_a_padded_batch(tiny_model, tmp_path):
    """A bucket of 4 holding 3 sequences: each sparse layer counts 3 tokens top_k times (not 4; the padding
    row is routed like any other), and the layers count every row again outside the padded path."""
    import transformers

    from engine.models.moe import SparseMoE
    from tests.engine.loading.hf_saved import save_with_transformers
    from tests.engine.models.test_parity import SHAPE

    model_dir = save_with_transformers(tmp_path / "moe", transformers.MixtralConfig(
        **SHAPE, num_local_experts=4, num_experts_per_tok=2), tiny_model("llama"))
    e = Engine(EngineConfig(model=str(model_dir), num_blocks=32, kernels="torch", cuda_graph_max_batch=0))
    moe = [m for m in e.runner.model.modules() if isinstance(m, SparseMoE)]
    g = DecodeGraphs(e.runner, 4, 8, capture=False)
    assert len(moe) == SHAPE["num_hidden_layers"] and g.moe_layers == moe
    g.capture_all()  # warm-up forwards of padding only
    assert [int(m.tokens_per_expert.sum()) for m in moe] == [0] * len(moe)
    g._fill(4, [5, 6, 7], [3, 4, 5], [40, 41, 42], [[2], [2], [2]], [4, 5, 6])
    with torch.inference_mode():
        g._forward(4)
    assert [int(m.tokens_per_expert.sum()) for m in moe] == [3 * 2] * len(moe)
    assert all(m.count_rows is None for m in moe)  # set only around the padded forward
    e.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=1, temperature=0))
    assert [int(m.tokens_per_expert.sum()) for m in moe] == [(3 + 4) * 2] * len(moe)
