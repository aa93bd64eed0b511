"""Decode steps of a packed model on the CPU replayed from recordings of their C kernel calls
(engine/decode_graphs.py, kernels/cpu_graph.py): the calls of the eager step on static, padded buffers, so the
tokens equal an engine without recordings and the log-probs and the KV cache agree to float rounding, over
batches that shrink through every bucket (the padding rows write nothing); a model the recording cannot cover runs eagerly and says
why; a replayed step checks its inputs. The packed models: GGUF Q4_1 (its token table packed too) and Q4_K, and a
GPTQ act-order checkpoint (a float token table, looked up in C; x's columns permuted in C per projection)."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from kernels import cpu_graph, cpu_native
from kernels.kv_quant import dequantize_ref
from tests.engine.loading.gguf_files import write_gguf
from tests.engine.loading.hf_quant_files import write_gptq
from tests.engine.test_decode_graphs import MAX_TOKENS, run


@pytest.fixture(scope="module", params=["Q4_1", "Q4_K", "gptq-act-order"])
def packed_file(request, tiny_model, tmp_path_factory):
    if request.param == "gptq-act-order":
        return write_gptq(tiny_model("llama"), tmp_path_factory.mktemp("rec") / "gptq", bits=4, group_size=32,
                          sym=False, desc_act=True)
    shape = {"hidden_size": 256, "intermediate_size": 512} if request.param == "Q4_K" else {}
    return write_gguf(tiny_model("llama", **shape), tmp_path_factory.mktemp("rec") / f"t.{request.param}.gguf",
                      request.param)


def engine(path, graphs: int, **kw) -> Engine:
    kw.setdefault("max_num_seqs", 8)
    return Engine(EngineConfig(model=str(path), num_blocks=64, dtype="float32", kernels="cpu",
                               cpu_graph_max_batch=graphs, **kw))


def test_recorded_decode_equals_eager(packed_file):
    eager, recorded = engine(packed_file, 0), engine(packed_file, 8)
    assert eager.runner.decode_graphs is None
    want, got = run(eager), run(recorded)
    graphs = recorded.runner.decode_graphs
    assert recorded.runner.fallbacks == []
    if packed_file.is_dir():  # the GPTQ checkpoint: act-order weights, packed for the group kernels; a float table
        model = recorded.runner.model
        assert model.layers[0].mlp.down_proj.quant.perm is not None and model.embed_quant is None
    assert {b for b, (rec, _) in graphs.graphs.items() if rec is not None} == {1, 2, 4, 8}  # batches 5 .. 1
    assert graphs.replays == sum(rec.replays for rec, _ in graphs.graphs.values()) >= max(MAX_TOKENS) - 1
    for k in want:  # a padded batch sums some rows in another order (the kernels split rows by M): not bit-exact
        assert got[k][0] == want[k][0], k
        torch.testing.assert_close(torch.tensor(got[k][1]), torch.tensor(want[k][1]), rtol=0, atol=1e-4)
    torch.testing.assert_close(recorded.runner.kv_cache, eager.runner.kv_cache, rtol=1e-4, atol=1e-4)  # no padding


def test_recorded_decode_with_an_int8_kv_cache_equals_eager(packed_file):
    """The int8 cache's store and attention are C calls too (kernels/cpu_kv_int8.py): recorded and replayed like the
    fp32 ones. The cache's bytes may differ by one step where a reordered fp32 row rounds the other way."""
    eager, recorded = engine(packed_file, 0, kv_cache_dtype="int8"), engine(packed_file, 8, kv_cache_dtype="int8")
    want, got = run(eager), run(recorded)
    graphs = recorded.runner.decode_graphs
    assert recorded.runner.fallbacks == [] and recorded.runner.kv_cache.dtype == torch.int8
    assert graphs.replays >= max(MAX_TOKENS) - 1
    for k in want:
        assert got[k][0] == want[k][0], k
        torch.testing.assert_close(torch.tensor(got[k][1]), torch.tensor(want[k][1]), rtol=0, atol=1e-4)
    for mine, theirs in zip(recorded.runner.kv_layers, eager.runner.kv_layers):  # within one step of each other
        for x, y, sx, sy in ((mine.key, theirs.key, mine.key_scales, theirs.key_scales),
                             (mine.value, theirs.value, mine.value_scales, theirs.value_scales)):
            step = torch.maximum(sx, sy).unsqueeze(-1)
            assert bool(((dequantize_ref(x, sx) - dequantize_ref(y, sy)).abs() <= step + 1e-5).all())


def test_a_new_kv_cache_is_recorded_again(packed_file):
    e = engine(packed_file, 4, enable_prefix_caching=False)  # the new cache holds none of the old blocks
    first = run(e)
    graphs = e.runner.decode_graphs
    old = {b: rec for b, (rec, _) in graphs.graphs.items()}
    old_cache = e.runner.kv_cache  # held: the new cache cannot take its address
    e.runner.allocate_kv(e.runner.num_blocks)  # what a resize does: new addresses
    assert e.runner.kv_cache.data_ptr() != old_cache.data_ptr()
    assert run(e) == first
    assert all(graphs.graphs[b][0] is not old[b] for b in graphs.graphs)


def test_a_replayed_step_checks_its_inputs(packed_file):
    e = engine(packed_file, 4)
    run(e)
    g = e.runner.decode_graphs
    vocab = e.model_config.vocab_size
    with pytest.raises(ValueError, match="token ids"):
        g.run([vocab], [3], [40], [[2]], [4])
    with pytest.raises(ValueError, match="slots"):
        g.run([5], [3], [e.runner.num_blocks * e.config.block_size], [[2]], [4])
    with pytest.raises(ValueError, match="block table"):
        g.run([5], [3], [40], [[e.runner.num_blocks]], [4])


def test_dense_projections_decode_eagerly(tiny_model, caplog):
    caplog.set_level("INFO", logger="engine.model_runner")
    e = engine(tiny_model("llama"), 8)
    assert e.runner.decode_graphs is None
    assert "dense projections run torch GEMMs" in caplog.text


def test_a_torch_operator_makes_a_function_not_replayable():
    x = torch.randn(2, 8)
    with pytest.raises(cpu_graph.NotReplayable, match="aten.add"):
        cpu_graph.record(lambda: cpu_native.silu_mul(x + 1))


def test_a_recording_replays_its_calls_on_new_values():
    x = torch.randn(3, 16)
    cpu_native.silu_mul(x)  # ctypes looks the function up before the recording
    rec, out = cpu_graph.record(lambda: cpu_native.silu_mul(x))
    assert len(rec.calls) == 1 and any(t.data_ptr() == out.data_ptr() for t in rec.tensors)
    x.copy_(torch.randn(3, 16))
    rec.replay()
    gate, up = x.chunk(2, dim=1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up)


def test_a_bucket_past_the_gemv_rows_runs_eagerly_and_the_smaller_ones_replay(packed_file):
    """From its format's rows (kernels/cpu_quant.py ``gemm_rows``: 24 for the 32-weight blocks, 40 where their digit
    planes run (VNNI), 64 for Q4_K; the group kernels' GEMM_ROWS) a packed linear dequantizes tiles for torch's GEMM: not recordable. That bucket and the
    larger ones run eagerly (said, counted); the smaller ones still replay."""
    from kernels import cpu_quant, cpu_quant_group

    fmts = {lin.quant.fmt for lin in engine(packed_file, 0).runner.model._linears() if lin.quant is not None}
    limit = min(cpu_quant_group.GEMM_ROWS if f in cpu_quant.GROUP_FORMAT_NAMES else cpu_quant.gemm_rows(f, "fp32")
                for f in fmts)
    from kernels.cpu_quant_isa import PLANES_LEVEL, isa_level

    blocks32 = cpu_quant.GEMM_ROWS_PLANES if isa_level(None) >= PLANES_LEVEL else cpu_quant.GEMM_ROWS_FP32
    assert limit == (64 if fmts == {"Q4_K"} else blocks32 if fmts == {"Q4_1"} else 24), fmts
    e = engine(packed_file, limit + 8, max_num_seqs=limit + 8)
    assert e.capture_decode_graphs() == len(e.runner.decode_graphs.sizes)
    graphs = e.runner.decode_graphs.graphs
    assert {b for b, (rec, _) in graphs.items() if rec is None} == {b for b in graphs if b >= limit}
    met = ("aten.index_select",) if packed_file.is_dir() else ("aten.mm", "aten.addmm", "linear")  # act-order: the
    assert any(op in f for op in met for f in e.runner.fallbacks), e.runner.fallbacks  # tiles' gather, then the GEMM
    eager = engine(packed_file, 0)
    assert [t for t, _ in run(e).values()] == [t for t, _ in run(eager).values()]
