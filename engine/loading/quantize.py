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
is not a multiple of 32 (one block). Under tensor parallelism each rank quantizes its own shards (whole rows, and
row-parallel shards start on 32-column blocks, so they are the one-rank engine's blocks), the LM head's rows
included; the token table keeps its Q8_0 values in float there (a rank's rows of a packed table are not built).
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
    done, left = 0, []
    with torch.no_grad():
        for name, lin in model.named_modules():
            if not isinstance(lin, Linear) or name == "lm_head" or lin.weight is None:
                continue
            if lin.in_features % 32:
                left.append(f"{name} ({lin.in_features} inputs, not whole 32-blocks)")
                continue
            blocks = quantize_ref(lin.weight.data, fmt)
            if dense:
                lin.weight.data.copy_(dequantize_ref(blocks).to(lin.weight.dtype))
            else:
                lin.quant, lin.weight = ops.pack_quant(blocks), None
            done += 1
        if model.cfg.hidden_size % 32:
            left.append("the token table and LM head (the hidden size is not whole 32-blocks)")
        else:
            _quantize_table(model, ops, dense)
    if model.cfg.moe.num_experts:
        left.append("the experts' tensors")
    if model.tp.enabled and not dense and not model.cfg.hidden_size % 32:
        left.append("the token table, holding its Q8_0 values (tensor parallelism: no packed rows per rank yet)")
    after = _float_bytes(model) + _packed_bytes(model)
    table = "" if model.cfg.hidden_size % 32 else f", the token table and LM head as {TABLE_FORMAT}"
    log.info("quantization %s: %d projections as %s blocks%s, %s; weights %.1f MB -> %.1f MB%s", scheme, done, fmt,
             table, "dequantized back into float (the reference)" if dense else f"packed for the {ops.name} kernels",
             before / 1e6, after / 1e6, f"; left float: {', '.join(left)}" if left else "")


def _quantize_table(model: CausalLM, ops: KernelOps, dense: bool) -> None:
    """The token table and the LM head (one tensor when tied) as Q8_0: packed (the table packed once for the lookup
    and a tied head); ``dense``: their float weights set to the blocks' values. Under tensor parallelism the head's
    rows of this rank are packed and the table keeps the blocks' values in float (a rank's packed table is not built)."""
    from kernels.quant import dequantize_ref, quantize_ref

    embed, head, tied = model.embed_tokens, model.lm_head, model.cfg.tie_word_embeddings
    table_q = quantize_ref(embed.weight.data, TABLE_FORMAT)
    head_q = table_q if tied else quantize_ref(head.weight.data, TABLE_FORMAT)
    if dense or model.tp.enabled:
        embed.weight.data.copy_(dequantize_ref(table_q).to(embed.weight.dtype))
    if dense:
        if not tied:
            head.weight.data.copy_(dequantize_ref(head_q).to(head.weight.dtype))
        return
    head.quant, head.weight = ops.pack_quant(head_q), None
    if not model.tp.enabled:
        model.embed_quant = head.quant if tied else ops.pack_quant(table_q)
        embed.weight = None


def _float_bytes(model: CausalLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _packed_bytes(model: CausalLM) -> int:
    """Bytes of the packed weights, each once (a tied table is the head's too)."""
    packed = {id(m.quant): m.quant for m in model.modules() if getattr(m, "quant", None) is not None}
    if model.embed_quant is not None:
        packed[id(model.embed_quant)] = model.embed_quant
    return sum(int(p.num_bytes) for p in packed.values())
