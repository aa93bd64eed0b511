"""GPTQ, AWQ and compressed-tensors checkpoints kept packed (issue 48; engine/loading/hf_quantized.py,
kernels/quant_group.py, kernels/cpu/quant_g.c), each against a dense engine on the same checkpoint dequantized at load
(``quantized_weights: dense``).

Per format and type (tests/engine/loading/hf_quant_files.py writes them: GPTQ and AWQ by packers written from the
formats' layouts, compressed-tensors by its own library): the loader's weights equal the format's published
dequantization, written independently (AutoGPTQ's ``scales[g_idx] * (weight - zeros[g_idx])``, vLLM's AWQ reference,
compressed-tensors' ``decompress``), in fp32; the packer is checked against that too. The torch backend's logits equal
the dense engine's bit for bit; the C kernels' within 1e-5 of the logits' spread (a 16-token prompt: the GEMV, not
the prefill tiles), greedy tokens equal; the packed weights hold within 1.15x of the file's quantized tensor bytes.
"""
from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ConfigError, ModelLoadError
from engine.request import SamplingParams
from kernels import cpu_quant_group
from kernels.quant_group import GroupQuantWeight, dequantize_group_ref
from tests.engine.loading import hf_quant_files as files
from tests.engine.models.test_kernel_backends import prompt_logits
from tests.engine.models.test_parity import random_prompts

REL_RMS = 1e-5  # the C GEMV against the dense engine: reordered fp32 sums
WIDE = {"hidden_size": 128, "intermediate_size": 256}  # every width a multiple of 128 (group 128)
CASES = {
    "gptq-int4-sym-g32": ("gptq", {"bits": 4, "group_size": 32}),
    "gptq-int4-asym-g64-act-order": ("gptq", {"bits": 4, "group_size": 64, "sym": False, "desc_act": True}),
    "gptq-int4-sym-g128-act-order": ("gptq", {"bits": 4, "group_size": 128, "desc_act": True}),
    "gptq-int8-sym-per-row": ("gptq", {"bits": 8, "group_size": -1, "desc_act": True}),
    "gptq_v2-int8-asym-g32-act-order": ("gptq", {"bits": 8, "group_size": 32, "sym": False, "desc_act": True,
                                                 "v2": True}),
    "awq-int4-g32": ("awq", {"group_size": 32}),
    "awq-int4-g128": ("awq", {"group_size": 128}),
    "ct-w4a16-sym-g32": ("ct", {"bits": 4, "group_size": 32}),
    "ct-w4a16-asym-g64-bf16": ("ct", {"bits": 4, "group_size": 64, "sym": False}),
    "ct-w4a16-sym-g128": ("ct", {"bits": 4, "group_size": 128}),
    "ct-w8a16-sym-channel": ("ct", {"bits": 8, "group_size": None}),
    "ct-w8a16-asym-g32-bf16": ("ct", {"bits": 8, "group_size": 32, "sym": False}),
}
WRITERS = {"gptq": files.write_gptq, "awq": files.write_awq, "ct": files.write_compressed_tensors}
_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
          "ct": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")}


def model_for(case: str, tiny_model):
    kw = {**(WIDE if "g128" in case else {}), **({"dtype": "bfloat16"} if "bf16" in case else {})}
    return tiny_model("llama", **kw)


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tiny_model, tmp_path_factory):
    kind, kw = CASES[request.param]
    path = WRITERS[kind](model_for(request.param, tiny_model), tmp_path_factory.mktemp("q") / request.param, **kw)
    return request.param, path


def reference(case: str, tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The layer's weight by its format's own formula (hf_quant_files), from the file's tensors."""
    kind, kw = CASES[case]
    p = {part: tensors[f"{prefix}.{part}"] for part in _PARTS[kind] if f"{prefix}.{part}" in tensors}
    if kind == "gptq":
        return files.gptq_dequantize(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], kw["bits"],
                                     v1=not kw.get("v2"))
    if kind == "awq":
        return files.awq_dequantize(p["qweight"], p["qzeros"], p["scales"], kw["group_size"])
    return files.compressed_tensors_dequantize(p, kw["bits"], kw["group_size"], kw.get("sym", True))


def engines(path, kernels: str) -> tuple[Engine, Engine]:
    config = EngineConfig(model=str(path), num_blocks=64, dtype="float32", kernels=kernels)
    return Engine(config), Engine(config.replace(quantized_weights="dense"))


def greedy(engine: Engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    return [r["token_ids"] for r in engine.generate(random_prompts(512, lens=(5, 19)), params)]


def test_the_packer_writes_what_the_formats_formula_reads(tiny_model, tmp_path):
    """GPTQ / AWQ packers (tests only) against the published dequantization: the quants the packer meant, read back."""
    src = tiny_model("llama")
    w = load_file(str(src / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    for bits, sym, v2 in ((4, False, False), (8, True, True)):
        order = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(3))
        q, scales, zeros, g_idx = files.gptq_quantize(w, bits, 32, sym, order, v1=not v2)
        want = (scales.float()[g_idx.long()].T * (q - zeros[g_idx.long()].T).float())
        got = files.gptq_dequantize(files._pack_rows(q.T, bits), files._pack_cols(zeros - (0 if v2 else 1), bits),
                                    scales, g_idx, bits, v1=not v2)
        assert torch.equal(got, want) and (got - w).abs().max() < 0.6 * scales.float().max()
    out = files.write_awq(src, tmp_path / "awq")
    t = load_file(str(out / "model.safetensors"))
    got = files.awq_dequantize(t["model.layers.0.mlp.down_proj.qweight"], t["model.layers.0.mlp.down_proj.qzeros"],
                               t["model.layers.0.mlp.down_proj.scales"], 32)
    assert (got - w).abs().max() < 0.6 * t["model.layers.0.mlp.down_proj.scales"].float().max()


def test_loaded_weights_are_the_formats_dequantization_and_logits_equal_bit_for_bit(checkpoint):
    case, path = checkpoint
    packed, dense = engines(path, "torch")
    tensors = load_file(str(path / "model.safetensors"))
    model, ref = packed.runner.model, dense.runner.model
    for layer in range(model.cfg.num_layers):
        for fused, parts in (("self_attn.qkv_proj", "qkv"), ("mlp.gate_up_proj", ("gate", "up"))):
            names = [f"{p}_proj" for p in parts]
            owner = fused.split(".")[0]
            want = torch.cat([reference(case, tensors, f"model.layers.{layer}.{owner}.{n}") for n in names])
            lin = model.get_submodule(f"layers.{layer}.{fused}")
            assert isinstance(lin.quant, GroupQuantWeight) and lin.weight is None
            assert torch.equal(dequantize_group_ref(lin.quant), want)
            assert torch.equal(ref.get_submodule(f"layers.{layer}.{fused}").weight, want)
        down = reference(case, tensors, f"model.layers.{layer}.mlp.down_proj")
        assert torch.equal(dequantize_group_ref(model.layers[layer].mlp.down_proj.quant), down)
    if "act-order" in case:  # a column permutation where a row has several groups (down_proj's input is widest)
        assert (model.layers[0].mlp.down_proj.quant.perm is None) == (CASES[case][1]["group_size"] == -1)
    prompt = random_prompts(512, lens=(16,))[0]
    assert torch.equal(prompt_logits(packed, prompt), prompt_logits(dense, prompt))
    assert greedy(packed) == greedy(dense)


def test_the_cpu_kernels_serve_them_close_to_the_dense_engine_in_the_files_bytes(checkpoint):
    case, path = checkpoint
    packed, dense = engines(path, "cpu")
    model = packed.runner.model
    prompt = random_prompts(512, lens=(16,))[0]
    ours, ref = prompt_logits(packed, prompt), prompt_logits(dense, prompt)
    assert not torch.equal(ours, ref)  # the GEMV's own fp32 order (not the prefill tiles) ...
    assert (ours - ref).pow(2).mean().sqrt() <= REL_RMS * ref.std()  # ... within the stated tolerance
    assert greedy(packed) == greedy(dense)
    tensors = load_file(str(path / "model.safetensors"))
    def nbytes(parts) -> int:
        return sum(t.numel() * t.element_size() for name, t in tensors.items() if name.rsplit(".", 1)[1] in parts)

    held = sum(m.quant.num_bytes for m in model.modules() if getattr(m, "quant", None) is not None)
    assert nbytes(("qweight", "weight_packed")) < held <= 1.15 * nbytes(_PARTS[CASES[case][0]])


def test_auto_dtype_of_a_half_precision_checkpoint_is_float32_on_a_cpu(tiny_model, tmp_path):
    """A GPTQ checkpoint saved in float16 (as they are): "auto" runs it in float32 on a CPU, packed for the C
    kernels; asking for bfloat16 runs the torch backend (the C kernels take float32), whose reference keeps the
    layer's quants and dequantizes them per call."""
    path = files.write_gptq(tiny_model("llama", dtype="float16"), tmp_path / "gptq")
    engine = Engine(EngineConfig(model=str(path), num_blocks=64))
    assert engine.runner.dtype == torch.float32 and engine.runner.model.ops.name == "cpu"
    assert isinstance(engine.runner.model.layers[0].mlp.down_proj.quant, cpu_quant_group.PackedGroup)
    bf16 = Engine(EngineConfig(model=str(path), num_blocks=64, dtype="bfloat16"))
    assert bf16.runner.dtype == torch.bfloat16 and bf16.runner.model.ops.name == "torch"
    assert isinstance(bf16.runner.model.layers[0].mlp.down_proj.quant, GroupQuantWeight)
    assert len(greedy(bf16)[0]) == len(greedy(engine)[0])  # it runs


def test_float_layers_stay_float_and_mixed_pieces_are_dequantized(tiny_model, tmp_path, caplog):
    """An ignore list: layer 1's down_proj float in the file stays a float weight; layer 0's k_proj float makes its
    fused q/k/v mixed: the q and v pieces are dequantized at load (said in the log)."""
    path = files.write_compressed_tensors(tiny_model("llama"), tmp_path / "ct", float_layers=(
        "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.k_proj"))
    with caplog.at_level(logging.INFO, logger="engine.loading.quantized"):
        packed, dense = engines(path, "cpu")
    model = packed.runner.model
    assert model.layers[1].mlp.down_proj.quant is None and model.layers[0].self_attn.qkv_proj.quant is None
    assert model.layers[0].mlp.down_proj.quant is not None and model.layers[1].self_attn.qkv_proj.quant is not None
    assert "dequantized at load: the G4 tensors of the rest" in caplog.text
    assert greedy(packed) == greedy(dense)


def test_act_order_pieces_with_different_column_orders_are_dequantized_logged(tiny_model, tmp_path, caplog):
    path = files.write_gptq(tiny_model("llama"), tmp_path / "gptq", desc_act=True, shared_order=False)
    with caplog.at_level(logging.WARNING, logger="engine.loading.quantized"):
        packed, dense = engines(path, "cpu")
    model = packed.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.quant is None and qkv.packed is not None  # a float weight (in oneDNN's layout on the cpu backend)
    assert model.layers[0].self_attn.o_proj.quant is not None  # a single piece keeps its own order
    assert "self_attn.qkv_proj.weight dequantized at load: its pieces cannot share one packed layout" in caplog.text
    assert greedy(packed) == greedy(dense)


def _edit(path, config: dict | None = None, drop: str | None = None, change: dict | None = None,
          model_config: dict | None = None) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(config or {})
    (path / "config.json").write_text(json.dumps({**cfg, **(model_config or {})}))
    tensors = load_file(str(path / "model.safetensors"))
    tensors = {k: v for k, v in tensors.items() if k != drop}
    save_file({**tensors, **(change or {})}, str(path / "model.safetensors"))


@pytest.mark.parametrize("kind, edit, error, message", [
    ("gptq", {"drop": "model.layers.0.mlp.up_proj.qzeros"}, ModelLoadError,
     "model.layers.0.mlp.up_proj: a gptq layer without qzeros"),
    ("gptq", {"config": {"group_size": 64}}, ModelLoadError,
     "down_proj: gptq tensors do not fit together: 4 groups of 32 columns, the config says group_size 64"),
    ("gptq", {"change": {"model.layers.0.mlp.down_proj.g_idx": torch.zeros(128, dtype=torch.int32)}}, ModelLoadError,
     "down_proj: gptq tensors do not fit together: g_idx puts unequal numbers of columns in the groups"),
    ("gptq", {"change": {"model.layers.0.mlp.down_proj.qweight": torch.zeros(8, 64, dtype=torch.int64)}},
     ModelLoadError, "qweight must be a 2-D int32 tensor, got torch.int64"),
    ("ct", {"config": {"config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": {
        "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}}}}}, ModelLoadError,
     "an asymmetric scheme whose layers lack weight_zero_point"),
    ("gptq", {"quantization": "int4"}, ConfigError, r"quantized already \(quantization_config: gptq\)"),
    ("gptq", {"model_config": {"tie_word_embeddings": True}, "change": {
        f"lm_head.{part}": torch.zeros(1, 1, dtype=torch.int32) for part in ("qweight", "qzeros", "scales")}},
     ModelLoadError, "a quantized lm_head in a checkpoint with tied embeddings"),
])
def test_broken_or_contradictory_checkpoints_are_refused_by_name(tiny_model, tmp_path, kind, edit, error, message):
    path = WRITERS[kind](tiny_model("llama"), tmp_path / kind)
    quantization = edit.pop("quantization", None)
    _edit(path, **edit)
    with pytest.raises(error, match=message):
        Engine(EngineConfig(model=str(path), num_blocks=64, kernels="cpu", quantization=quantization))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gptq-int4-asym-g64-act-order", "quantization-int4"])
def test_tensor_parallel_ranks_serve_them_like_one_rank(tiny_model, tmp_path, case):
    """Over 2 ranks: a GPTQ checkpoint dequantized at load on every rank (packed rows are not split across ranks
    yet), and ``quantization: int4`` quantizing each rank's own shards (row-parallel shards start on 32-column
    blocks, so they are the one-rank engine's blocks; the head's rows packed, the table's Q8_0 values in float):
    greedy tokens equal the one-rank engine's, logprobs within tests/engine/models/test_tensor_parallel.py's
    tolerance (partial sums reduced across ranks)."""
    from tests.engine.models.test_tensor_parallel import assert_same, run
    from tests.engine.tp_engines import tp_engine

    if case == "quantization-int4":
        config = EngineConfig(model=str(tiny_model("llama")), num_blocks=64, kernels="torch", quantization="int4")
    else:
        kind, kw = CASES[case]
        config = EngineConfig(model=str(WRITERS[kind](tiny_model("llama"), tmp_path / case, **kw)), num_blocks=64,
                              kernels="torch")
    want = run(Engine(config))
    with tp_engine(config, 2) as engine:
        model = engine.runner.model
        assert (model.layers[0].self_attn.o_proj.quant is not None) == (case == "quantization-int4")
        assert (model.lm_head.quant is not None) == (case == "quantization-int4")  # this rank's rows of the head
        assert model.embed_quant is None  # the token table stays float under tensor parallelism
        assert_same(run(engine), want)
