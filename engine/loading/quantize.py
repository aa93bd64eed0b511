"""A float checkpoint's weights quantized at load (``quantization: int8 | int4``, issue 48): group-wise round to
nearest into GGUF blocks, which the packed kernels then serve exactly as they serve a GGUF file's.

- int8: every projection as Q8_0 (symmetric, 32 weights per group, fp16 scale);
- int4: every projection as Q4_1 (asymmetric, 32 weights per group, fp16 scale and min);
- in both, the token table and the LM head (one table when tied) as Q8_0. The head maps the last hidden state
  straight to the logits, so its error is the logits' error; llama.cpp keeps it at >= 6 bits in its 4-bit mixes
  (Q6_K in Q4_K_M) for that reason, and 8 bits here cost a quarter of its float32 bytes. The table and the head are
  one tensor in most small models (tied), where 4 bits for the head would mean 4 bits for the embeddings too.
The blocks are gguf-py's (llama.cpp's reference quantizers, bit-exact: kernels/quant.py ``quantize_ref``).

What stays float, and the log says so: MoE expert tensors (as w8a16 leaves them), a projection whose input width
is not a multiple of 32 (one block), and, under tensor parallelism, the token table and head (a rank's rows of a
packed table are not built; the projections are quantized per rank, each shard's rows and 32-column blocks whole).
``dense`` (``quantized_weights: dense``): the same blocks dequantized back into the float weights: the reference
the packed path is checked against. The weights are quantized after the float checkpoint is loaded, so the load's
peak memory is the float model's; the float weights are freed one by one as their blocks are made.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.errors import ConfigError
from engine.loading.checkpoint import load_model_config
from engine.loading.paths import is_gguf
from engine.models.kernel_backend import KernelOps
from engine.models.layers import Linear
from engine.models.llama import CausalLM

log = logging.getLogger(__name__)
PROJECTION_FORMAT = {"int8": "Q8_0", "int4": "Q4_1"}
TABLE_FORMAT = "Q8_0"  # the token table and the LM head, in both modes (module docstring)


def check_quantizable(path: str | Path, scheme: str, ops: KernelOps, dtype: torch.dtype, dense: bool) -> None:
    """Before loading: a ConfigError unless ``path`` is a float checkpoint ``ops`` can serve quantized by
    ``scheme`` (quantizing a quantized checkpoint again would serve neither its weights nor the float ones)."""
    fmt = PROJECTION_FORMAT[scheme]
    if not dense and not {fmt, TABLE_FORMAT} <= ops.quant_formats:
        raise ConfigError(f"quantization {scheme!r} packs {fmt} blocks, which the {ops.name} kernels do not take "
                          f"(the cpu and torch backends do; on a GPU use quantization 'w8a16')")
    if not dense and dtype != torch.float32:
        raise ConfigError(f"quantization {scheme!r} packs weights for the float32 kernels; this model runs in {dtype}")
    if is_gguf(path):
        from engine.loading.gguf import open_gguf

        quantized = sorted({t for t in open_gguf(path).tensor_types().values() if t not in ("F32", "F16", "BF16")})
        if quantized:
            raise ConfigError(f"quantization {scheme!r} quantizes a float checkpoint; {path} is quantized already "
                              f"({', '.join(quantized)} tensors): leave quantization unset to serve them")
    elif load_model_config(path).quantization is not None:
        raise ConfigError(f"quantization {scheme!r} quantizes a float checkpoint; {path} is quantized already "
                          f"(quantization_config: {load_model_config(path).quantization.method}): leave "
                          f"quantization unset to serve it")


def quantize_model(model: CausalLM, scheme: str, ops: KernelOps, dense: bool = False) -> None:
    """Quantize ``model``'s float weights in place by ``scheme`` ("int8" | "int4"), packed by ``ops.pack_quant``
    (``dense``: dequantized back into the float weights instead); ``check_quantizable`` first."""
    from kernels.quant import dequantize_ref, quantize_ref

    fmt = PROJECTION_FORMAT[scheme]
    before = _float_bytes(model)

    def quantize(w: torch.Tensor, f: str):
        q = quantize_ref(w, f)
        if dense:
            w.copy_(dequantize_ref(q).to(w.dtype))
            return None
        return ops.pack_quant(q)

    done, left = 0, []
    with torch.no_grad():
        for name, lin in model.named_modules():
            if not isinstance(lin, Linear) or name == "lm_head" or lin.weight is None:
                continue
            if lin.in_features % 32:
                left.append(f"{name} ({lin.in_features} inputs, not whole 32-blocks)")
                continue
            packed = quantize(lin.weight.data, fmt)
            if packed is not None:
                lin.quant, lin.weight = packed, None
            done += 1
        tied = model.cfg.tie_word_embeddings
        if model.tp.enabled or model.cfg.hidden_size % 32:
            left.append("the token table and LM head" + (" (tensor parallelism)" if model.tp.enabled else ""))
        else:
            table = quantize(model.embed_tokens.weight.data, TABLE_FORMAT)
            head = table if tied else quantize(model.lm_head.weight.data, TABLE_FORMAT)
            if table is not None:
                model.embed_quant, model.embed_tokens.weight = table, None
                model.lm_head.quant, model.lm_head.weight = head, None
    if model.cfg.moe.num_experts:
        left.append("the experts' tensors")
    after = _float_bytes(model) + _packed_bytes(model)
    table = "" if "the token table and LM head" in " ".join(left) else f", the token table and LM head as {TABLE_FORMAT}"
    log.info("quantization %s: %d projections as %s blocks%s, %s; weights %.1f MB -> %.1f MB%s", scheme, done, fmt,
             table, "dequantized back into float (the reference)" if dense else f"packed for the {ops.name} kernels",
             before / 1e6, after / 1e6, f"; left float: {', '.join(left)}" if left else "")


def _float_bytes(model: CausalLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _packed_bytes(model: CausalLM) -> int:
    """Bytes of the packed weights, each once (a tied table is the head's too)."""
    packed = {id(m.quant): m.quant for m in model.modules() if getattr(m, "quant", None) is not None}
    if model.embed_quant is not None:
        packed[id(model.embed_quant)] = model.embed_quant
    return sum(int(p.num_bytes) for p in packed.values())
