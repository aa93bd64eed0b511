"""Quantized checkpoint weights kept packed (issue 48): which of a GGUF file's or a Hugging Face quantized
checkpoint's weights stay packed, and their assembly into the model.

A parameter stays packed when the kernel backend's quantized linear takes its type (``KernelOps.quant_formats``:
GGUF block types, and G4 / G8 for GPTQ / AWQ / compressed-tensors layers, engine/loading/hf_quantized.py), every
checkpoint tensor that fills it has that one type (q, k and v of a fused projection alike), and it is a
projection's weight (a ``Linear``) or, in a GGUF block type, the token table (with it a tied LM head: one packed
table serves the lookup and the head). The rest is dequantized at load, and the loader says how much of each:
other block types, norms and biases (float in the files), a fused projection whose GPTQ / AWQ pieces are not all
quantized alike, MoE expert tensors, tensor parallelism (splitting packed rows across ranks is not built yet), what
the backend does not take (the triton backend: GGUF blocks only, no G4 / G8 yet; the torch backend on CUDA: none),
``quantization: w8a16`` (it quantizes float weights itself) and ``quantized_weights: dense``.

The pieces of a fused projection are joined row-wise (the block rows of q, then k, then v): a row of blocks is a
row of weights, so joining and permuting rows is exact on the packed bytes. Nothing is converted: the backend's
``pack_quant`` gets the file's blocks as they are (kernels/quant.py ``QuantWeight``), or a layer's quants, scales
and zeros unpacked from their int32 words (kernels/quant_group.py ``GroupQuantWeight``); a repack is lossless.
Act-order pieces must share one column order (GPTQ computes it from the layer's input, which q, k and v share);
pieces that do not are dequantized at load, logged.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from engine.errors import ModelLoadError
from engine.loading.hf_fp8 import Fp8Weight
from engine.loading.hf_fp8 import join_rows as join_fp8_rows
from engine.models.kernel_backend import KernelOps
from engine.models.layers import Linear, QuantParts
from engine.models.llama import CausalLM
from kernels.quant import GGUF_BLOCKS  # the block formats a token table may stay packed in (``quant_rows``)

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
        if not fmts <= ops.quant_formats or not name.endswith(".weight"):
            continue
        is_linear = isinstance(model.get_submodule(name.rsplit(".", 1)[0]), Linear)
        if len(fmts) > 1:  # a fused projection of GGUF pieces in several block types: kept as parts (QuantParts)
            if is_linear and fmts <= set(GGUF_BLOCKS):
                kept[name] = "+".join(sorted(fmts))
            continue
        fmt = next(iter(fmts))
        if (name == EMBEDDING and fmt in GGUF_BLOCKS) or is_linear:
            kept[name] = fmt
    return kept


def kept_formats(kept: dict[str, str]) -> frozenset[str]:
    """Every block type some kept parameter holds (a parameter of parts: "Q4_K+Q6_K")."""
    return frozenset(f for v in kept.values() for f in v.split("+"))


def drop_dense(model: CausalLM, kept: dict[str, str]) -> None:
    """Before the model's memory is allocated: the parameters kept packed get none."""
    for name in kept:
        owner, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(owner), attr, None)
    if EMBEDDING in kept and model.cfg.tie_word_embeddings:
        model.lm_head.weight = None


class PackedPieces:
    """The pieces of every kept parameter as they arrive from the file; a parameter is joined and packed as soon as
    its last piece is in (a GPTQ / AWQ / compressed-tensors layer's unpacked quants are not held to the end)."""

    def __init__(self, model: CausalLM, kept: dict[str, str]) -> None:
        self.model, self.kept = model, kept
        self.pieces: dict[str, dict[object, object]] = {}
        self.done: set[str] = set()

    def add(self, name: str, piece, tensor) -> None:
        """``tensor``: a GGUF ``QuantTensor`` or a ``GroupQuantWeight`` (engine/loading/hf_quantized.py)."""
        if name not in self.kept:
            raise ModelLoadError(f"{name}: a {tensor.fmt} tensor arrived for a parameter not kept packed")
        self.pieces.setdefault(name, {})[piece] = tensor
        if set(self.pieces[name]) == self.model.pieces(name) or None in self.pieces[name]:
            self._install(name, self.pieces.pop(name))

    def install(self) -> set[str]:
        """Join, check against the config's shapes, pack, and put in place what is left; every installed
        parameter's name returned."""
        for name in list(self.pieces):
            self._install(name, self.pieces.pop(name))
        return self.done

    def _install(self, name: str, pieces: dict) -> None:
        from kernels.quant import QuantWeight
        from kernels.quant_group import GroupQuantWeight

        module = self.model.get_submodule(name.rsplit(".", 1)[0])
        order = sorted(pieces, key=lambda p: -1 if p is None else p)
        if None in pieces and len(pieces) > 1:
            raise ModelLoadError(f"{name}: the checkpoint gives it whole and in pieces")
        parts = [pieces[p] for p in order]
        want = self._shape(name, module)
        if isinstance(parts[0], Fp8Weight):
            weight = self._join_fp8(name, module, parts, want)
            if weight is None:
                return
        elif isinstance(parts[0], GroupQuantWeight):
            weight = self._join_group(name, module, parts, want)
            if weight is None:
                return
        else:
            rows, cols = sum(p.data.shape[0] for p in parts), {p.cols for p in parts}
            if len(cols) != 1 or (rows, *cols) != want:
                raise ModelLoadError(f"{name}: quantized pieces of {rows} x {sorted(cols)} weights, the "
                                     f"model config implies {want[0]} x {want[1]}")
            runs = self._runs(parts)  # consecutive pieces of one block type joined: one packed weight each
            if len(runs) > 1:
                packed, r0 = [], 0
                for fmt, data in runs:
                    packed.append((r0, self.model.ops.pack_quant(QuantWeight(fmt, data.shape[0], want[1],
                                                                             torch.from_numpy(data)))))
                    r0 += data.shape[0]
                module.quant = QuantParts(tuple(packed), want[0], want[1])
                self.done.add(name)
                return
            weight = QuantWeight(runs[0][0], rows, want[1], torch.from_numpy(runs[0][1]))
        packed = self.model.ops.pack_quant(weight)
        if name == EMBEDDING:
            self.model.embed_quant = packed
            if self.model.cfg.tie_word_embeddings:
                self.model.lm_head.quant = packed
        else:
            module.quant = packed
        self.done.add(name)

    @staticmethod
    def _runs(parts: list) -> list[tuple[str, np.ndarray]]:
        """(block type, joined rows) per run of consecutive pieces of one type (q, k Q4_K | v Q6_K)."""
        runs: list[tuple[str, list]] = []
        for p in parts:
            if runs and runs[-1][0] == p.fmt:
                runs[-1][1].append(p.data)
            else:
                runs.append((p.fmt, [p.data]))
        return [(fmt, np.concatenate(d) if len(d) > 1 else d[0]) for fmt, d in runs]

    def _join_fp8(self, name: str, module, parts: list, want: tuple[int, int]):
        """FP8 pieces joined row-wise (engine/loading/hf_fp8.py ``join_rows``), or, where one GEMM would not compute
        what the pieces do (static input scales that differ, blocks a piece does not fill), one packed weight per
        piece (``QuantParts``)."""
        rows, cols = sum(p.rows for p in parts), {p.cols for p in parts}
        if (rows, *cols) != want or len(cols) != 1:
            raise ModelLoadError(f"{name}: FP8 pieces of {rows} x {sorted(cols)} weights, the model config implies "
                                 f"{want[0]} x {want[1]}")
        joined = join_fp8_rows(parts) if len(parts) > 1 else parts[0]
        if joined is not None:
            return joined
        log.info("weights: %s kept as %d FP8 parts (their scales cannot be joined into one GEMM)", name, len(parts))
        packed, r0 = [], 0
        for p in parts:
            packed.append((r0, self.model.ops.pack_quant(p)))
            r0 += p.rows
        module.quant = QuantParts(tuple(packed), want[0], want[1])
        self.done.add(name)
        return None

    def _join_group(self, name: str, module, parts: list, want: tuple[int, int]):
        """The GPTQ / AWQ / compressed-tensors pieces of one weight joined row-wise; when their act-order column
        permutations differ (one packed weight has one column order), the float weight instead (logged)."""
        from kernels.quant_group import dequantize_group_ref, join_rows

        rows, cols = sum(p.rows for p in parts), {p.cols for p in parts}
        if (rows, *cols) != want or len(cols) != 1:
            raise ModelLoadError(f"{name}: quantized pieces of {rows} x {sorted(cols)} weights, the model config "
                                 f"implies {want[0]} x {want[1]}")
        try:
            return join_rows(parts)
        except ValueError as e:
            log.warning("weights: %s dequantized at load: its pieces cannot share one packed layout (%s)", name, e)
            dense = torch.cat([dequantize_group_ref(p) for p in parts]).to(self.model.norm.weight.dtype)
            module.weight = torch.nn.Parameter(dense, requires_grad=False)
            self.done.add(name)
            return None

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
