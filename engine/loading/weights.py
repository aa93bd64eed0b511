"""Loading a checkpoint into ``CausalLM``: a Hugging Face directory or a GGUF file.

A directory's weights come from ``model.safetensors.index.json`` (sharded) or every ``*.safetensors`` file,
a GGUF file's from engine/loading/gguf.py (dequantized, Q/K rows restored to HF order, HF tensor names); either
way tensor by tensor (both memory-map, so peak memory is the model plus one tensor), with a progress bar
from 64 MiB of checkpoint up. q/k/v and gate/up land in their fused parameters. Every failure a user can cause is a
``ModelLoadError`` that names the file or tensor: missing files, an unsupported architecture, a tensor
whose shape does not match the config, or parameters the checkpoint does not provide.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError
from engine.loading.gguf import QuantTensor, open_gguf
from engine.loading.hf_fp8 import Fp8Weight
from engine.loading.hf_fp8 import dequantize as dequantize_fp8
from engine.loading.hf_quantized import assemble, quantized_layers, tensor_types
from engine.loading.paths import is_gguf
from engine.loading.quantize import PROJECTION_FORMAT, check_quantizable, quantize_model
from engine.loading.quantized import PackedPieces, drop_dense, kept_formats, packed_params, report
from engine.models.config import ModelConfig
from engine.models.kernel_backend import KernelOps
from engine.models.llama import CausalLM
from engine.models.tensor_parallel import TensorParallel
from kernels.quant_group import GroupQuantWeight, dequantize_group_ref

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PROGRESS_MIN_BYTES = 64 << 20  # show a progress bar for checkpoints from 64 MiB up


def resolve_dtype(requested: str, cfg: ModelConfig, device: str) -> torch.dtype:
    """"auto": the checkpoint's dtype; a GPTQ / AWQ / compressed-tensors checkpoint on a CPU: float32 (its dtype is
    its scales' and its float layers'; the packed kernels take float32 activations), as for a quantized GGUF file."""
    auto = "float32" if cfg.quantization is not None and device == "cpu" else cfg.checkpoint_dtype
    name = auto if requested == "auto" else requested
    if name not in _DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r} (supported: {', '.join(_DTYPES)})")
    return _DTYPES[name]


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir}: shards named in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        has_bin = any(model_dir.glob("*.bin"))
        hint = " (only PyTorch .bin weights found; convert them to safetensors)" if has_bin else ""
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files{hint}")
    return files


def checkpoint_tensors(path: str | Path, keep: frozenset[str] = frozenset()
                       ) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """(HF tensor name, tensor) for every tensor of a checkpoint directory or GGUF file; a GGUF weight of a block
    type in ``keep``: its blocks as they are (``QuantTensor``)."""
    if is_gguf(path):
        ckpt = open_gguf(path)
        total = ckpt.num_bytes
        items = ((name, t if isinstance(t, QuantTensor) else torch.from_numpy(t), nbytes)
                 for name, t, nbytes in ckpt.tensors(keep))
    else:
        files = weight_files(Path(path))
        total = sum(f.stat().st_size for f in files)
        items = _safetensors_items(files)
    bar = None
    if total >= _PROGRESS_MIN_BYTES:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {Path(path).name}", file=sys.stderr)
    try:
        for name, tensor, nbytes in items:
            yield name, tensor
            if bar is not None:
                bar.update(nbytes)
    finally:
        if bar is not None:
            bar.close()


def _tensor_dtypes(model_dir: Path) -> dict[str, str]:
    """Every tensor of a checkpoint directory -> its safetensors dtype ("F32", "I32", ...), from the headers."""
    dtypes = {}
    for f in weight_files(model_dir):
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    dtypes[name] = st.get_slice(name).get_dtype()
        except Exception as e:  # a truncated or corrupt file
            raise ModelLoadError(f"{f}: cannot read safetensors file: {e}") from e
    return dtypes


def _safetensors_items(files: list[Path]) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(name, tensor, bytes of the file it accounts for: its own, plus the header for a file's last one)."""
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                names, left = list(st.keys()), f.stat().st_size
                for i, name in enumerate(names):
                    tensor = st.get_tensor(name)
                    nbytes = left if i == len(names) - 1 else tensor.numel() * tensor.element_size()
                    left -= nbytes
                    yield name, tensor, nbytes
        except ModelLoadError:
            raise
        except Exception as e:  # a truncated or corrupt file
            raise ModelLoadError(f"{f}: cannot read safetensors file: {e}") from e


def load_model(
    model_path: str | Path,
    cfg: ModelConfig,
    ops: KernelOps,
    dtype: torch.dtype,
    device: str,
    max_positions: int,
    tp: TensorParallel | None = None,
    keep_quantized: bool = True,
    quantization: str | None = None,
) -> CausalLM:
    """``tp``: load this rank's part of every split parameter (engine/models/tensor_parallel.py); each rank reads the
    checkpoint itself (memory-mapped: only its parts are copied). ``keep_quantized``: a quantized checkpoint's
    weights the backend takes stay packed (engine/loading/quantized.py); False: all dequantized.
    ``quantization`` "int8" / "int4": a float checkpoint's weights quantized after loading (engine/loading/quantize.py;
    packed, or with ``keep_quantized`` False dequantized back: the reference); other values are the caller's."""
    at_load = quantization if quantization in PROJECTION_FORMAT else None
    if at_load:  # before any memory is spent: refused unless the checkpoint and the backend can
        check_quantizable(model_path, at_load, ops, dtype, dense=not keep_quantized)
    with torch.device("meta"):
        model = CausalLM(cfg, ops, max_positions, tp)
    kept: dict[str, str] = {}
    hf_quant = None if is_gguf(model_path) else cfg.quantization
    if is_gguf(model_path) or hf_quant is not None:
        if hf_quant is not None:
            dtypes = _tensor_dtypes(Path(model_path))
            layers = quantized_layers(dtypes, hf_quant)
            if cfg.tie_word_embeddings and "lm_head" in layers:  # the head would be the float table: not the file's
                raise ModelLoadError(f"{model_path}: a quantized lm_head in a checkpoint with tied embeddings")
            types = tensor_types(dtypes, hf_quant)
        else:
            types = open_gguf(model_path).tensor_types()
        reason = None if keep_quantized else "quantized_weights: dense, or quantization: w8a16"
        if getattr(hf_quant, "method", None) == "fp8" and reason is None:
            reason = f"the {ops.name} kernels have no FP8 GEMM: to {str(dtype).removeprefix('torch.')}"
        kept = packed_params(model, types, ops) if keep_quantized else {}
        report(model, kept, types, ops, reason)
        drop_dense(model, kept)
    pieces = PackedPieces(model, kept)
    model.to_empty(device=device)
    model.to(dtype)
    model.reset_counters()  # to_empty left the counting buffers uninitialised
    model.rope = model.rope.__class__(cfg, max_positions).to(device)  # buffers are not checkpoint data
    if model.rope_local is not None:
        model.rope_local = model.rope.__class__(cfg.local_rope_config(), max_positions).to(device)
    if cfg.tie_word_embeddings and model.embed_tokens.weight is not None:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: dict[str, set[int]] = {}
    with torch.no_grad():
        tensors = checkpoint_tensors(model_path, kept_formats(kept))
        for hf_name, tensor in tensors if hf_quant is None else assemble(tensors, hf_quant, layers):
            target = model.checkpoint_to_param(hf_name)
            if target is None:
                continue
            name, piece = target
            if isinstance(tensor, (QuantTensor, GroupQuantWeight, Fp8Weight)) and name in kept:
                pieces.add(name, piece, tensor)
                continue
            if isinstance(tensor, GroupQuantWeight):  # not kept packed: its float weights
                tensor = dequantize_group_ref(tensor)
            elif isinstance(tensor, Fp8Weight):  # float(q) * scale in fp32, then the model dtype
                tensor = dequantize_fp8(tensor)
            elif isinstance(tensor, QuantTensor):
                # a piece of a parameter kept dense, come as blocks because its type is kept elsewhere
                tensor = torch.from_numpy(tensor.dequantize())
            param = params.get(name)
            if param is None:
                raise ModelLoadError(f"checkpoint tensor {hf_name!r} has no place in {cfg.architecture}")
            try:
                dest = model.param_piece(name, param.data, piece)
            except IndexError:
                raise ModelLoadError(f"checkpoint tensor {hf_name!r}: expert {piece[0]} is beyond the config's "
                                     f"{cfg.moe.num_experts} experts") from None
            try:
                tensor = model.tp_narrow(name, piece, tensor)
            except RuntimeError as e:  # a split past the tensor's end: its shape does not match the config
                raise ModelLoadError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, which the model config's "
                                     f"tensor-parallel split cannot take: {e}") from None
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ModelLoadError(
                    f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, the model config implies {tuple(dest.shape)}")
            dest.copy_(tensor.to(dtype))
            loaded.setdefault(name, set()).update(model.covered(name, piece))
    if cfg.gemma.norm_plus_one:  # Gemma's RMSNorm scales by 1 + weight: stored so, the norm code is Llama's
        for name, param in params.items():
            if name.endswith("norm.weight"):
                param.data.add_(1.0)
    packed = pieces.install()
    missing = [name for name in kept if name not in packed]
    for name, _param in params.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        got = loaded.get(name, set())
        if None not in got and not model.pieces(name) <= got:
            missing.append(name)
    if missing:
        raise ModelLoadError(f"{model_path}: checkpoint does not provide {len(missing)} parameter(s), e.g. {missing[:4]}")
    if at_load:
        quantize_model(model, at_load, ops, dense=not keep_quantized)
    return model.eval()
