"""What a loaded engine says it holds (engine/loading/resident.py, issue 48): on tiny GGUF files written by the
``gguf`` package, the summary's formats, bytes and tensor counts per layer kind equal what the model's objects hold
(the packed ``Linear.quant`` objects, the oneDNN-packed tensors, w8a16's int8 weights, the dense ones), a tied head's
table is counted once, the totals add up to the file's tensor bytes for a packed engine and to ~4 bytes a weight for a
dense one, the kernels named are those the backend runs, and the worker's log gets the block."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loading.gguf import open_gguf
from engine.loading.resident import _packed_tensors, summarize_weights
from engine.loading.weights_summary import KINDS, WeightGroup, WeightsSummary
from engine.models.layers import Linear, RMSNorm
from tests.engine.loading.gguf_files import write_gguf

KIND_OF = {"qkv_proj": "attention qkv", "o_proj": "attention output", "gate_up_proj": "mlp gate_up",
           "down_proj": "mlp down"}


@pytest.fixture(scope="module")
def q4_1(tiny_model, tmp_path_factory):
    """A Llama (untied head) in Q4_1: every projection, the table and the head packed."""
    return write_gguf(tiny_model("llama"), tmp_path_factory.mktemp("r") / "tiny.Q4_1.gguf", "Q4_1")


@pytest.fixture(scope="module")
def q8_0_tied(tiny_model, tmp_path_factory):
    """A Qwen2 (tied head: the token table is the LM head) in Q8_0."""
    return write_gguf(tiny_model("qwen2"), tmp_path_factory.mktemp("r") / "tied.Q8_0.gguf", "Q8_0")


def engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), num_blocks=16, dtype="float32", **kw))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def by_kind(summary: WeightsSummary) -> dict[str, WeightGroup]:
    kinds = [g.kind for g in summary.groups]
    assert len(kinds) == len(set(kinds)), kinds  # one format and kernel per kind in these models
    return {g.kind: g for g in summary.groups}


def linears_of(model, kind: str) -> list[Linear]:
    return [m for name, m in model.named_modules()
            if isinstance(m, Linear) and name != "lm_head" and KIND_OF.get(name.rsplit(".", 1)[-1]) == kind]


def test_a_packed_engine_holds_the_files_bytes_in_the_formats_its_objects_name(q4_1, caplog):
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        e = engine(q4_1, kernels="cpu")
    model, summary = e.runner.model, e.runner.weights
    groups = by_kind(summary)
    assert list(groups) == ["embedding", "attention qkv", "attention output", "mlp gate_up", "mlp down", "norms",
                            "lm_head"]
    for kind in KIND_OF.values():
        lins = linears_of(model, kind)
        assert {f"{lin.quant.fmt} packed" for lin in lins} == {groups[kind].format} == {"Q4_1 packed"}
        assert groups[kind].num_bytes == sum(lin.quant.num_bytes for lin in lins)  # no bias in a Llama
        assert groups[kind].num_tensors == model.cfg.num_layers
        assert groups[kind].kernel.startswith("C GEMV") and "fp32 activations" in groups[kind].kernel
    assert groups["embedding"].num_bytes == model.embed_quant.num_bytes
    assert groups["lm_head"].num_bytes == model.lm_head.quant.num_bytes and groups["lm_head"].shared_bytes == 0
    norms = [m.weight for m in model.modules() if isinstance(m, RMSNorm)]
    assert (groups["norms"].format, groups["norms"].num_bytes, groups["norms"].num_tensors) == \
        ("float32 dense", nbytes(norms), len(norms))
    # every tensor of the file kept as stored (the rows are whole 8-row groups: no padding), nothing else
    assert summary.weight_bytes == summary.checkpoint_bytes == open_gguf(q4_1).num_bytes
    assert summary.kernels == "cpu" and summary.decode_graphs.startswith("CPU recordings of C kernel calls")
    [block] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights of tiny")]
    assert "1.00x" in block and all(f"  {kind} " in block for kind in groups)
    assert summary.to_json()["weight_bytes"] == summary.weight_bytes
    assert [w["bytes"] for w in summary.to_json()["weights"]] == [g.num_bytes for g in summary.groups]


def test_a_tied_head_is_the_tables_bytes_counted_once(q8_0_tied):
    e = engine(q8_0_tied, kernels="cpu", quantized_activations="int8")
    model, groups = e.runner.model, by_kind(e.runner.weights)
    assert model.lm_head.quant is model.embed_quant
    assert groups["embedding"].format == groups["lm_head"].format == "Q8_0 packed"
    assert (groups["lm_head"].num_bytes, groups["lm_head"].shared_bytes) == (0, model.embed_quant.num_bytes)
    qkv = linears_of(model, "attention qkv")  # Qwen2's q/k/v have biases: counted with their projection
    assert groups["attention qkv"].num_bytes == sum(lin.quant.num_bytes + nbytes([lin.bias]) for lin in qkv)
    assert groups["attention qkv"].num_tensors == 2 * len(qkv)
    assert "int8 activations" in groups["mlp down"].kernel  # Q8_0 takes the int8 kernel
    assert e.runner.weights.weight_bytes == open_gguf(q8_0_tied).num_bytes


def test_dense_and_w8a16_engines_on_the_same_file_hold_what_their_objects_hold(q4_1):
    packed = engine(q4_1, kernels="torch").runner.weights
    assert {g.format for g in packed.groups} == {"Q4_1 packed", "float32 dense"}
    assert all(g.kernel.startswith("torch") for g in packed.groups)
    dense = engine(q4_1, kernels="cpu", quantized_weights="dense")
    model, groups = dense.runner.model, by_kind(dense.runner.weights)
    params = sum(p.numel() for p in model.parameters() if p is not None)
    if dense.runner.ops.pack_linear is not None:  # this torch has oneDNN: the projections reordered for it
        assert groups["mlp down"].format == "float32 oneDNN-packed" and groups["mlp down"].kernel == "oneDNN"
        params += sum(lin.packed.numel() for lin in model.modules() if isinstance(lin, Linear) and lin.packed is not None)
    assert groups["embedding"].format == "float32 dense"
    assert dense.runner.weights.weight_bytes == 4 * params  # fp32, every weight once
    assert dense.runner.weights.weight_bytes > 5 * packed.weight_bytes
    assert dense.runner.weights.decode_graphs.startswith("eager (dense projections")
    w8 = engine(q4_1, kernels="cpu", quantization="w8a16")
    model, groups = w8.runner.model, by_kind(w8.runner.weights)
    down = linears_of(model, "mlp down")
    assert groups["mlp down"].format == "int8 w8a16 (per channel)"
    assert groups["mlp down"].num_bytes == nbytes([t for lin in down for t in (lin.qweight, lin.scales)])
    assert groups["lm_head"].format == "float32 dense"  # w8a16 leaves the head in float


def test_experts_and_the_router_have_their_own_kinds(tiny_model, tmp_path):
    import transformers

    from tests.engine.loading.hf_saved import save_with_transformers
    from tests.engine.models.test_parity import SHAPE

    model_dir = save_with_transformers(tmp_path / "moe", transformers.MixtralConfig(
        **SHAPE, num_local_experts=4, num_experts_per_tok=2), tiny_model("llama"))
    e = engine(model_dir, kernels="torch")
    model, groups = e.runner.model, by_kind(e.runner.weights)
    experts = [p for m in model.modules() if hasattr(m, "gate_up_proj") and isinstance(m.gate_up_proj, torch.Tensor)
               for p in (m.gate_up_proj, m.down_proj)]
    assert (groups["experts"].num_bytes, groups["experts"].num_tensors) == (nbytes(experts), len(experts))
    assert groups["experts"].kernel == "grouped GEMMs: torch reference"
    assert groups["moe router"].num_tensors == SHAPE["num_hidden_layers"]
    assert e.runner.weights.weight_bytes == nbytes(p for p in model.parameters())
    assert e.runner.weights.checkpoint_bytes == (model_dir / "model.safetensors").stat().st_size
    assert [g.kind for g in e.runner.weights.groups] == sorted((g.kind for g in e.runner.weights.groups),
                                                               key=KINDS.index)


def test_a_packed_object_of_any_format_is_counted_by_its_tensors(q4_1):
    @dataclass(frozen=True)
    class Packed:  # a format this module has never seen: its name and its tensors are all it needs
        fmt: str
        qs: torch.Tensor
        scales: tuple[torch.Tensor, ...]
        rows: int

    e = engine(q4_1, kernels="torch")
    model = e.runner.model
    for lin in linears_of(model, "mlp down"):
        lin.quant = Packed("G4", torch.zeros(64, 32, dtype=torch.uint8), (torch.zeros(64, 2),), 64)
    groups = by_kind(summarize_weights(model, e.runner.ops, "eager"))
    assert groups["mlp down"].format == "G4 packed"
    assert groups["mlp down"].num_bytes == model.cfg.num_layers * (64 * 32 + 64 * 2 * 4)

    class Empty:
        fmt = "X"

    with pytest.raises(TypeError, match="holds no tensor"):
        _packed_tensors(Empty())


def test_a_gptq_checkpoint_is_reported_as_its_group_packed_objects_hold_it(tiny_model, tmp_path):
    """GPTQ int4, group 32, act-order (engine/loading/hf_quantized.py; kernels/cpu_quant_group.py's PackedGroup):
    the format and group size from the packed objects, every array they hold counted (quants, scales, zeros and
    the column permutation), the C group kernel named; the file's bytes are the directory's safetensors."""
    from tests.engine.loading import hf_quant_files

    path = hf_quant_files.write_gptq(tiny_model("llama"), tmp_path / "gptq", bits=4, group_size=32, desc_act=True)
    e = engine(path, kernels="cpu")
    model, groups = e.runner.model, by_kind(e.runner.weights)
    down = linears_of(model, "mlp down")
    assert groups["mlp down"].format == "G4 g32 packed" == f"{down[0].quant.fmt} g{down[0].quant.group_size} packed"
    assert groups["mlp down"].num_bytes == sum(lin.quant.num_bytes for lin in down)
    assert down[0].quant.perm is not None  # act-order: the permutation is part of what is held
    assert groups["mlp down"].kernel.startswith("C group GEMV") and "fp32 activations" in groups["mlp down"].kernel
    assert groups["embedding"].format == "float32 dense"  # GPTQ leaves the table in float
    assert e.runner.weights.checkpoint_bytes == sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert e.runner.weights.weight_bytes < e.runner.weights.checkpoint_bytes * 1.15
