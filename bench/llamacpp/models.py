"""bench-llamacpp's model files, made locally (no hub) into ``.cache/bench/`` once and reused:

- ``smollm2-q4_1``: the default model's file as it is (SmolLM2-135M-Instruct Q4_1, engine/loading/default_model.py).
- ``smollm2-q8_0``: the same weights at Q8_0. The Q4_1 file is dequantized to an all-F32 GGUF with the ``gguf``
  package (``gguf.dequantize``, every tensor; the metadata copied, ``general.file_type`` ALL_F32), then
  ``llama-quantize ... Q8_0``: a quantization of the Q4_1 file's exact values, not a requantization of its
  blocks (no ``--allow-requantize``). The F32 file is deleted afterwards.
- ``synthetic-1.5b-q4_k_m``: a Llama-architecture model of ~1.56 B parameters (``SYNTHETIC``: hidden 2,048,
  24 layers, 32 heads / 8 KV heads, intermediate 8,192, SmolLM2's vocabulary of 49,152 with its tokenizer
  metadata copied from the default file, tied embeddings), random weights N(0, 0.02²) and norms 1, written
  as F16 one tensor at a time (``GGUFWriter``'s header, then each tensor generated and written: at most one
  tensor in memory, the largest the 201 MB token table), then ``llama-quantize ... Q4_K_M`` (what llama.cpp
  makes of it: Q4_K, Q6_K for half of attn_v / ffn_down and for the tied token table, F32 norms). The F16
  file (3.1 GB) is deleted afterwards.

Each file is written under a temporary name and renamed when complete, so an interrupted run leaves no
half file that a later run would take.
"""
from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "bench"
NOT_COPIED = ("GGUF.", "general.architecture", "general.file_type", "general.quantization_version")
TOKENIZER_KEYS = "tokenizer."
FILE_TYPE_ALL_F32, FILE_TYPE_MOSTLY_F16 = 0, 1


@dataclass(frozen=True)
class SyntheticLlama:
    hidden: int = 2048
    layers: int = 24
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 8192
    vocab: int = 49152
    context: int = 8192
    std: float = 0.02
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape: rows = outputs) in llama.cpp's order; a 1-D shape is a norm."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out = [("token_embd.weight", (self.vocab, h))]
        for i in range(self.layers):
            b = f"blk.{i}."
            out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (h, h)), (b + "attn_k.weight", (kv, h)),
                    (b + "attn_v.weight", (kv, h)), (b + "attn_output.weight", (h, h)),
                    (b + "ffn_norm.weight", (h,)), (b + "ffn_gate.weight", (self.intermediate, h)),
                    (b + "ffn_up.weight", (self.intermediate, h)), (b + "ffn_down.weight", (h, self.intermediate))]
        return [*out, ("output_norm.weight", (h,))]

    def num_params(self) -> int:
        return sum(int(np.prod(s)) for _, s in self.tensors())


SYNTHETIC = SyntheticLlama()


@dataclass(frozen=True)
class BenchModel:
    key: str  # smollm2-q4_1 | smollm2-q8_0 | synthetic-1.5b-q4_k_m
    label: str  # for the tables
    path: Path


MODEL_KEYS = ("smollm2-q4_1", "smollm2-q8_0", "synthetic-1.5b-q4_k_m")
LARGE = "synthetic-1.5b-q4_k_m"
LABELS = {"smollm2-q4_1": "SmolLM2-135M Q4_1", "smollm2-q8_0": "SmolLM2-135M Q8_0",
          "synthetic-1.5b-q4_k_m": "synthetic Llama 1.5B Q4_K_M"}


def ensure_model(key: str, quantize_bin: Path) -> BenchModel:
    """The model file for ``key`` (MODEL_KEYS), made first if it is not in the cache."""
    from engine.loading.default_model import default_model_path

    default = default_model_path()
    if key == "smollm2-q4_1":
        path = default
    elif key == "smollm2-q8_0":
        path = CACHE / "SmolLM2-135M-Instruct.Q8_0.gguf"
        if not path.exists():
            f32 = CACHE / "SmolLM2-135M-Instruct.F32.gguf"
            write_dequantized(default, f32)
            quantize(quantize_bin, f32, path, "Q8_0")
            f32.unlink()
    elif key == "synthetic-1.5b-q4_k_m":
        path = CACHE / "synthetic-llama-1.5b.Q4_K_M.gguf"
        if not path.exists():
            f16 = CACHE / "synthetic-llama-1.5b.F16.gguf"
            write_synthetic(SYNTHETIC, default, f16)
            quantize(quantize_bin, f16, path, "Q4_K_M")
            f16.unlink()
    else:
        raise ValueError(f"unknown bench model {key!r} (known: {', '.join(MODEL_KEYS)})")
    return BenchModel(key, LABELS[key], path)


def quantize(quantize_bin: Path, src: Path, dst: Path, qtype: str, threads: int = 2) -> None:
    tmp = dst.with_suffix(".part")
    log.info("llama-quantize %s -> %s %s", src.name, dst.name, qtype)
    p = subprocess.run([str(quantize_bin), str(src), str(tmp), qtype, str(threads)], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"llama-quantize {src} {qtype} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    tmp.rename(dst)


def _copy_fields(reader, writer, keep) -> None:
    for key, field in reader.fields.items():
        if key.startswith(NOT_COPIED) or not keep(key):
            continue
        sub = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)


def write_dequantized(src: Path, dst: Path) -> None:
    """``src`` with every tensor dequantized to F32 by ``gguf.dequantize``, all metadata copied."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".part")
    writer = gguf.GGUFWriter(None, arch)
    _copy_fields(reader, writer, lambda k: True)
    writer.add_file_type(FILE_TYPE_ALL_F32)
    shapes = []
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # numpy order: rows first
        shapes.append(shape)
        writer.add_tensor_info(t.name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    _write_all(writer, tmp, (gguf.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
                             for t, shape in zip(reader.tensors, shapes)))
    tmp.rename(dst)


def write_synthetic(spec: SyntheticLlama, tokenizer_src: Path, dst: Path) -> None:
    """An F16 Llama GGUF of ``spec``'s shape with random weights and ``tokenizer_src``'s tokenizer, streamed."""
    import gguf

    reader = gguf.GGUFReader(str(tokenizer_src))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    if vocab != spec.vocab:
        raise ValueError(f"{tokenizer_src}: {vocab} tokens, the synthetic model is for {spec.vocab}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".part")
    writer = gguf.GGUFWriter(None, "llama")
    writer.add_name(f"duet synthetic Llama {spec.num_params() / 1e9:.2f}B (random weights)")
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.hidden)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(spec.intermediate)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(spec.vocab)
    writer.add_file_type(FILE_TYPE_MOSTLY_F16)
    _copy_fields(reader, writer, lambda k: k.startswith(TOKENIZER_KEYS))
    plan = spec.tensors()
    for name, shape in plan:
        dtype = np.float32 if len(shape) == 1 else np.float16  # norms stay F32, as converters write them
        writer.add_tensor_info(name, shape, np.dtype(dtype), np.dtype(dtype).itemsize * int(np.prod(shape)))
    rng = np.random.default_rng(spec.seed)

    def arrays():
        for _name, shape in plan:
            if len(shape) == 1:
                yield np.ones(shape, dtype=np.float32)
            else:
                w = rng.standard_normal(shape, dtype=np.float32)
                w *= spec.std
                yield w.astype(np.float16)

    _write_all(writer, tmp, arrays())
    tmp.rename(dst)


def _write_all(writer, path: Path, arrays) -> None:
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    try:
        for a in arrays:
            writer.write_tensor_data(a)
    finally:
        writer.close()


def file_tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of the file's tensors per ggml type (``{"Q4_K": ..., "F32": ...}``)."""
    import gguf

    out: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return out
