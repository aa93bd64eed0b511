"""GGUF files (llama.cpp's format) as duet checkpoints: model config, weights and tokenizer from one file.

    ckpt = GGUFCheckpoint("SmolLM2-135M-Instruct.Q4_1.gguf")
    ckpt.model_config()        # -> ModelConfig, from the file's metadata
    ckpt.tokenizer()           # -> Tokenizer (engine/loading/gguf_tokenizer.py): vocabulary, merges, chat template
    ckpt.tensors()             # -> (HF tensor name, float32 numpy array), dequantized
    ckpt.tensors(keep={"Q8_0"})  # ... Q8_0 weights as QuantTensor: the file's blocks, not dequantized

No torch here (the router reads configs and tokenizers too); parsing and dequantization are the ``gguf``
package's (every tensor type it can dequantize: F32, F16, BF16, Q4_0 … Q8_0, the K-quants, the IQ types).
The loader turns the arrays into the serving dtype. Weights of the block types the kernel backend takes packed
(``keep``; engine/loading/quantized.py) come as :class:`QuantTensor`: the file's bytes, one row of blocks per
output row, Q/K rows restored to HF order like the dequantized ones (a row permutation moves whole rows of blocks).

Being exact about what the file says: which architectures run, and what their metadata keys and tensors mean,
is engine/loading/gguf_config.py (every ``<arch>.*`` key must be one it reads; any other refuses the file, naming it).
Here: tensor names map to HF names (:func:`engine.loading.gguf_config.layer_tensors`) and go through the same loader
path as safetensors. llama.cpp's converter interleaves the rows of Llama's Q and K projections (weights and
biases) for its rotary kernel; we undo it exactly as transformers does (:func:`unpermute_rows`); other
architectures are not permuted. Gemma files store every norm weight as 1 + w; we hand the loader w, as
transformers' GGUF loader does (the loader stores 1 + w for Gemma, engine/loading/weights.py). The RoPE vectors
(``rope_freqs``, Phi-3's ``rope_factors_*``) are part of the config, not weights. dtype "auto": float16 /
bfloat16 for files stored in those types, float32 otherwise (a quantized weight dequantizes exactly into float32).
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ModelLoadError
from engine.loading.gguf_config import ARCHITECTURES, CONFIG_TENSORS, gguf_model_config, layer_tensors
from engine.loading.paths import checkpoint_name
from engine.models.config import ModelConfig

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleave (``convert_hf_to_gguf.LlamaModel.permute``) on a weight or bias."""
    dim = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class QuantTensor:
    """A quantized weight as the file stores it: ``data`` uint8 [rows, bytes per row] of ggml blocks along each row
    (``fmt``: the ggml type's name, e.g. ``Q4_1``), for ``rows`` x ``cols`` weights."""

    fmt: str
    rows: int
    cols: int
    data: np.ndarray

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols], by the ``gguf`` package (for a piece of a parameter that is not kept packed)."""
        import gguf

        return np.array(gguf.dequantize(self.data, gguf.GGMLQuantizationType[self.fmt]), dtype=np.float32)


class GGUFCheckpoint:
    """One GGUF file, memory-mapped. Metadata is read once; tensors are dequantized one at a time."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # a truncated or foreign file: gguf raises ValueError / struct errors
            raise ModelLoadError(f"{self.path}: cannot read GGUF file: {e}") from e
        self.metadata: dict[str, Any] = {}
        for name, field in self._reader.fields.items():
            if name.startswith("GGUF."):
                continue
            try:
                self.metadata[name] = field.contents()
            except Exception as e:
                raise ModelLoadError(f"{self.path}: metadata {name!r} cannot be read: {e}") from e
        self.gguf_arch = self.metadata.get("general.architecture")
        if self.gguf_arch is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata has no 'general.architecture'")
        if self.gguf_arch not in ARCHITECTURES:
            raise ModelLoadError(f"{self.path}: GGUF architecture {self.gguf_arch!r} is not supported "
                                 f"(supported: {', '.join(ARCHITECTURES)})")
        self.architecture = ARCHITECTURES[self.gguf_arch]
        self.tensor_names = [t.name for t in self._reader.tensors]
        self._layer_tensors = layer_tensors(self.gguf_arch)

    # ------------------------------------------------------------------------------------------ config

    def model_config(self) -> ModelConfig:
        import gguf

        vectors = {t.name: tuple(float(x) for x in gguf.dequantize(t.data, t.tensor_type).reshape(-1))
                   for t in self._reader.tensors if t.name in CONFIG_TENSORS}
        return gguf_model_config(self.metadata, self.tensor_names, vectors, source=str(self.path),
                                 checkpoint_dtype=self._stored_dtype(), model_id=checkpoint_name(self.path))

    def _stored_dtype(self) -> str:
        import gguf

        types = {t.tensor_type for t in self._reader.tensors if t.name.endswith("weight") and len(t.shape) == 2}
        if types == {gguf.GGMLQuantizationType.F16}:
            return "float16"
        if types == {gguf.GGMLQuantizationType.BF16}:
            return "bfloat16"
        return "float32"

    # ------------------------------------------------------------------------------------------ tensors

    @property
    def num_bytes(self) -> int:
        return sum(int(t.n_bytes) for t in self._reader.tensors)

    def tensor_types(self) -> dict[str, str]:
        """HF name -> ggml type name of every weight (what the loader decides to keep packed from)."""
        return {self.hf_name(t.name): t.tensor_type.name for t in self._reader.tensors if t.name not in CONFIG_TENSORS}

    def tensors(self, keep: frozenset[str] = frozenset()) -> Iterator[tuple[str, np.ndarray | QuantTensor, int]]:
        """(HF name, float32 array, bytes read from the file) per weight, Q/K rows in HF order, Gemma's norms w;
        a 2-D weight whose type is in ``keep``: a :class:`QuantTensor` instead of the array."""
        import gguf

        cfg = self.model_config()
        for t in self._reader.tensors:
            if t.name in CONFIG_TENSORS:  # part of the config (RoPE), not a weight
                continue
            name = self.hf_name(t.name)
            heads = None
            if self.gguf_arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
                heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
            if t.tensor_type.name in keep and len(t.shape) == 2:
                cols, rows = (int(n) for n in t.shape)  # ggml lists the fastest dimension first
                data = np.asarray(t.data, dtype=np.uint8).reshape(rows, -1)
                data = unpermute_rows(data, heads) if heads else np.array(data)  # a copy: the file stays mapped
                yield name, QuantTensor(t.tensor_type.name, rows, cols, data), int(t.n_bytes)
                continue
            try:
                array = gguf.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise ModelLoadError(f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, which the gguf "
                                     "package cannot dequantize") from None
            array = np.array(array, dtype=np.float32)  # a writable copy (F32 tensors are read-only memmap views)
            if t.name.endswith(".ffn_gate_inp_shexp.weight") and array.ndim == 1:
                array = array[None, :]  # the shared expert's gate: a [1, hidden] projection, stored as a vector
            if heads:
                array = unpermute_rows(array, heads)
            if cfg.gemma.norm_plus_one and name.endswith("norm.weight"):
                array -= 1.0  # stored as 1 + w (the loader adds the 1 back, for checkpoints of either kind)
            yield name, array, int(t.n_bytes)

    def hf_name(self, gguf_name: str) -> str:
        base, _, kind = gguf_name.rpartition(".")
        if kind not in ("weight", "bias"):
            raise ModelLoadError(f"{self.path}: unexpected tensor {gguf_name!r}")
        if base in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[base]}.{kind}"
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if m and m.group(2) in self._layer_tensors:
            return f"model.layers.{m.group(1)}.{self._layer_tensors[m.group(2)]}.{kind}"
        raise ModelLoadError(f"{self.path}: tensor {gguf_name!r} has no place in {self.architecture}")

    # ------------------------------------------------------------------------------------------ tokenizer

    def tokenizer(self):
        from engine.loading.gguf_tokenizer import tokenizer_from_gguf_metadata

        return tokenizer_from_gguf_metadata(self.metadata, source=str(self.path))


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """One parse per file and process (config, tokenizer and weights all read the same metadata); a file
    replaced on disk is parsed again."""
    p = Path(path).resolve()
    stat = p.stat()
    return _open_gguf(str(p), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)
