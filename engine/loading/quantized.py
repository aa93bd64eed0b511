"""Quantized checkpoint weights kept packed (issue 48): which of a GGUF file's weights stay in their blocks, and
their assembly into the model.

A parameter stays packed when the kernel backend's quantized linear takes its block type
(``KernelOps.quant_formats``), every checkpoint tensor that fills it has that one type (q, k and v of a fused
projection alike), and it is a projection's weight (a ``Linear``) or the token table (with it a tied LM head: one
packed table serves the lookup and the head). The rest is dequantized at load as before, and the loader says how
much of each: other block types, norms and biases (F32 in the files), MoE expert tensors, tensor parallelism
(splitting packed rows across ranks is not built yet), ``quantization: w8a16`` (it quantizes dense weights
itself) and ``quantized_weights: dense``.

The pieces of a fused projection are joined row-wise (the block rows of q, then k, then v): a row of blocks is a
row of weights, so joining and permuting rows is exact on the packed bytes. Nothing is converted: the backend's
``pack_quant`` gets the file's blocks as they are (kernels/quant.py ``QuantWeight``), and a repack is lossless.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from engine.errors import ModelLoadError
from engine.loading.gguf import QuantTensor
from engine.models.kernel_backend import KernelOps
from engine.models.layers import Linear
from engine.models.llama import CausalLM

log = logging.getLogger(__name__)
EMBEDDING = "embed_tokens.weight"


def packed_params(model: CausalLM, tensor_types: dict[str, str], ops: KernelOps) -> dict[str, str]:
    """Our parameter name -> block type, for each parameter kept packed (``tensor_types``: HF name -> ggml type)."""
    if not ops.quant_formats or model.tp.enabled:
        return {}
    by_param: dict[str, set[str]] = {}
    for hf_name, fmt in tensor_types.items():
        target = model.checkpoint_to_param(hf_name)
        if target is not None:
            by_param.setdefault(target[0], set()).add(fmt)
    kept = {}
    for name, fmts in by_param.items():
        if len(fmts) != 1 or not fmts <= ops.quant_formats or not name.endswith(".weight"):
            continue
        if name == EMBEDDING or isinstance(model.get_submodule(name.rsplit(".", 1)[0]), Linear):
            kept[name] = next(iter(fmts))
    return kept


def drop_dense(model: CausalLM, kept: dict[str, str]) -> None:
    """Before the model's memory is allocated: the parameters kept packed get none."""
    for name in kept:
        owner, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(owner), attr, None)
    if EMBEDDING in kept and model.cfg.tie_word_embeddings:
        model.lm_head.weight = None


class PackedPieces:
    """The pieces of every kept parameter as they arrive from the file, joined and packed at the end."""

    def __init__(self, model: CausalLM, kept: dict[str, str]) -> None:
        self.model, self.kept = model, kept
        self.pieces: dict[str, dict[object, QuantTensor]] = {}

    def add(self, name: str, piece, tensor: QuantTensor) -> None:
        if name not in self.kept:
            raise ModelLoadError(f"{name}: a {tensor.fmt} tensor arrived for a parameter not kept packed")
        self.pieces.setdefault(name, {})[piece] = tensor

    def install(self, ops: KernelOps) -> set[str]:
        """Join, check against the config's shapes, pack, and put each parameter in place; its name returned."""
        from kernels.quant import QuantWeight

        done = set()
        for name, pieces in self.pieces.items():
            owner = name.rsplit(".", 1)[0]
            module = self.model.get_submodule(owner)
            order = sorted(pieces, key=lambda p: -1 if p is None else p)
            if None in pieces and len(pieces) > 1:
                raise ModelLoadError(f"{name}: the checkpoint gives it whole and in pieces")
            data = np.concatenate([pieces[p].data for p in order]) if len(order) > 1 else pieces[order[0]].data
            cols = {pieces[p].cols for p in order}
            rows, want = data.shape[0], self._shape(name, module)
            if len(cols) != 1 or (rows, *cols) != want:
                raise ModelLoadError(f"{name}: quantized pieces of {rows} x {sorted(cols)} weights, the model config "
                                     f"implies {want[0]} x {want[1]}")
            packed = ops.pack_quant(QuantWeight(self.kept[name], rows, want[1], torch.from_numpy(data)))
            if name == EMBEDDING:
                self.model.embed_quant = packed
                if self.model.cfg.tie_word_embeddings:
                    self.model.lm_head.quant = packed
            else:
                module.quant = packed
            done.add(name)
        return done

    def _shape(self, name: str, module) -> tuple[int, int]:
        if name == EMBEDDING:
            return self.model.cfg.vocab_size, self.model.cfg.hidden_size
        return module.out_features, module.in_features


def report(model: CausalLM, kept: dict[str, str], tensor_types: dict[str, str], ops: KernelOps,
           reason: str | None) -> None:
    """One log line: what stays packed, and which quantized tensors are dequantized at load, and why."""
    quantized = {hf: t for hf, t in tensor_types.items() if t not in ("F32", "F16", "BF16")}
    dense = sorted({t for hf, t in quantized.items()
                    if (model.checkpoint_to_param(hf) or ("",))[0] not in kept})
    if kept:
        log.info("weights: %d parameters kept packed (%s) on the %s kernels%s", len(kept),
                 ", ".join(sorted(set(kept.values()))), ops.name,
                 f"; dequantized at load: the {', '.join(dense)} tensors of the rest" if dense else "")
    elif dense:
        log.warning("weights: the checkpoint's %s tensors are dequantized at load (%s)", ", ".join(dense),
                    reason or f"the {ops.name} kernels take no quantized weights")
