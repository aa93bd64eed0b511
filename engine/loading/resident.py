"""What a loaded model holds, read from its objects once after load (issue 48): ``summarize_weights`` walks the
model and returns a ``WeightsSummary`` (engine/loading/weights_summary.py).

Per layer kind (embedding, attention qkv / output, mlp gate_up / down, moe router, experts, norms, lm_head, other):
- the format is what the module holds: a packed quantized weight (``Linear.quant``, ``CausalLM.embed_quant``) by
  its own ``fmt`` ("Q4_1 packed"), a oneDNN-packed weight (``Linear.packed``), w8a16's int8 weight and scales
  (``Linear.qweight``), or a dense tensor by its dtype;
- the bytes are those of its tensors: every tensor a packed object holds (whatever the format, so formats added
  later are counted without a change here), the weight, the bias. A tensor shared with an earlier kind (a tied LM
  head: the token table) is counted once, where it appears first, and shown as ``shared_bytes`` on the later one.
  A oneDNN-packed tensor has no storage to measure: its elements times their size (the blocked layout may pad);
- the kernel is the function the backend (``KernelOps``) calls for it, named by what it is: the C quantized GEMV
  with its SIMD path and activation mode, oneDNN, cuBLAS (torch's GEMM on a CUDA device), Triton, or the torch
  references. A packed object of a kind not named here is reported by its module and class.
The totals: the resident bytes, and the checkpoint's tensor bytes (``checkpoint_bytes``).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from engine.loading.paths import is_gguf
from engine.loading.weights_summary import KINDS, WeightGroup, WeightsSummary
from engine.models.kernel_backend import KernelOps
from engine.models.layers import Linear, QuantParts, RMSNorm
from engine.models.llama import CausalLM
from engine.models.moe import Experts


def summarize_weights(model: CausalLM, ops: KernelOps, decode_graphs: str,
                      checkpoint_bytes: int | None = None) -> WeightsSummary:
    """``model``'s resident weights by layer kind, format and kernel (see the module docstring)."""
    tally = _Tally()
    if model.embed_quant is not None:
        tally.add("embedding", f"{_fmt(model.embed_quant)} packed", _rows_kernel(ops),
                  _packed_tensors(model.embed_quant), 1)
    elif model.embed_tokens.weight is not None:
        w = model.embed_tokens.weight
        tally.add("embedding", f"{_dtype(w)} dense", "torch index_select", [w], 1)
    seen = {id(model.embed_tokens)}
    for name, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        if isinstance(module, Linear):
            kind = "lm_head" if name == "lm_head" else _linear_kind(name)
            fmt, kernel, tensors = _linear(module, ops)
            bias = [module.bias] if module.bias is not None else []
            tally.add(kind, fmt, kernel, tensors + bias, 1 + len(bias))
        elif isinstance(module, Experts):
            params = [p for p in (module.gate_up_proj, module.down_proj) if p is not None]
            kernel = "Triton fused MoE" if ops.fused_moe is not None else \
                f"grouped GEMMs: {_dense_kernel(ops, params[0])}"
            tally.add("experts", f"{_dtype(params[0])} dense", kernel, params, len(params))
        elif isinstance(module, RMSNorm):
            kernel = _norm_kernel(ops) if module.fused is not None else "torch"
            tally.add("norms", f"{_dtype(module.weight)} dense", kernel, [module.weight], 1)
    counted = tally.ids
    rest = [p for p in model.parameters() if p is not None and id(p) not in counted and _key(p) not in tally.keys]
    for p in rest:
        tally.add("other", f"{_dtype(p)} dense", "torch", [p], 1)
    return WeightsSummary(groups=tally.groups(), kernels=ops.name, decode_graphs=decode_graphs,
                          checkpoint_bytes=checkpoint_bytes)


def checkpoint_tensor_bytes(path: str | Path) -> int | None:
    """A GGUF file's tensor bytes (every tensor's data, as stored); a directory's ``*.safetensors`` files' bytes
    (their small JSON headers included); None for anything else."""
    if is_gguf(path):
        from engine.loading.gguf import open_gguf

        return open_gguf(path).num_bytes
    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    return sum(f.stat().st_size for f in files) or None


class _Tally:
    """Groups keyed by (kind, format, kernel), each tensor counted once (the first group that holds it)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str, str], list[int]] = {}  # -> [bytes, tensors, shared bytes]
        self.keys: set = set()
        self.ids: set[int] = set()

    def add(self, kind: str, fmt: str, kernel: str, tensors: list[torch.Tensor], num_tensors: int) -> None:
        row = self.rows.setdefault((kind, fmt, kernel), [0, 0, 0])
        row[1] += num_tensors
        for t in tensors:
            self.ids.add(id(t))
            nbytes, key = t.numel() * t.element_size(), _key(t)
            if key in self.keys:
                row[2] += nbytes
            else:
                self.keys.add(key)
                row[0] += nbytes

    def groups(self) -> tuple[WeightGroup, ...]:
        order = sorted(self.rows, key=lambda k: (KINDS.index(k[0]), -self.rows[k][0], k[1], k[2]))
        return tuple(WeightGroup(kind, fmt, kernel, *self.rows[(kind, fmt, kernel)])
                     for kind, fmt, kernel in order)


def _key(t: torch.Tensor):
    """The same memory -> the same key: (storage address, offset, bytes); a tensor without storage (oneDNN's
    blocked layout) by identity."""
    if t.layout != torch.strided:
        return ("object", id(t))
    return (t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size(), t.numel() * t.element_size())


def _linear_kind(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "qkv_proj":
        return "attention qkv"
    if leaf == "o_proj":
        return "attention output"
    if leaf == "gate_up_proj":
        return "mlp gate_up"
    if leaf == "down_proj":
        return "mlp down"
    if leaf in ("gate", "shared_expert_gate"):
        return "moe router"
    return "other"


def _linear(lin: Linear, ops: KernelOps) -> tuple[str, str, list[torch.Tensor]]:
    """(format, kernel, weight tensors) of what ``lin.forward`` runs, in its order of precedence."""
    if lin.quant is not None:
        return f"{_fmt(lin.quant)} packed", _quant_kernel(ops, lin.quant), _packed_tensors(lin.quant)
    if lin.packed is not None:
        return f"{_dtype(lin.packed)} oneDNN-packed", "oneDNN", [lin.packed]
    if lin.qweight is not None:
        group = lin.qweight.shape[1] // lin.scales.shape[1]
        scales = "per channel" if lin.scales.shape[1] == 1 else f"group {group}"
        return f"int8 w8a16 ({scales})", _w8a16_kernel(ops), [lin.qweight, lin.scales]
    return f"{_dtype(lin.weight)} dense", _dense_kernel(ops, lin.weight), [lin.weight]


def _fmt(packed) -> str:
    """The packed object's format name (its ``fmt``, with its ``group_size`` where it has one)."""
    fmt = getattr(packed, "fmt", None)
    fmt = fmt if isinstance(fmt, str) else type(packed).__name__
    if isinstance(packed, QuantParts) and fmt == "FP8":  # FP8 pieces kept apart: what each is
        return " + ".join(dict.fromkeys(_fmt(p) for _, p in packed.parts)) + " (parts)"
    if fmt == "FP8":  # kernels/fp8_gemm.py: its scales' layout, or the dequantized weight it measured faster
        if packed.dense is not None:
            return f"FP8 checkpoint, {_dtype(packed.dense)} dense"
        scales = f"{packed.block[0]}x{packed.block[1]} block" if packed.block else "per-row"
        return f"FP8 e4m3 ({scales} scales)"
    group = getattr(packed, "group_size", None)
    return f"{fmt} g{group}" if isinstance(group, int) else fmt


def _packed_tensors(packed) -> list[torch.Tensor]:
    """Every tensor a packed weight object holds (its dataclass fields, or attributes), however its format packs;
    a projection packed in parts (``QuantParts``): every part's."""
    if isinstance(packed, QuantParts):
        return [t for _, p in packed.parts for t in _packed_tensors(p)]
    values = [getattr(packed, f.name) for f in dataclasses.fields(packed)] if dataclasses.is_dataclass(packed) \
        else list(vars(packed).values())
    out = []
    for v in values:
        out.extend(x for x in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(x, torch.Tensor))
    if not out:
        raise TypeError(f"a packed weight of type {type(packed).__module__}.{type(packed).__qualname__} holds no "
                        "tensor to count (engine/loading/resident.py)")
    return out


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _quant_kernel(ops: KernelOps, packed) -> str:
    if isinstance(packed, QuantParts):  # one call per part, each its format's kernel
        return "; ".join(dict.fromkeys(f"{p.fmt}: {_quant_kernel(ops, p)}" for _, p in packed.parts))
    if ops.name == "torch":
        return "torch reference (dequantized per call)"
    module = type(packed).__module__
    if module == "kernels.fp8_gemm":
        return ("torch linear (FP8 measured slower)" if packed.dense is not None else
                f"torch._scaled_mm W8A8, activations {packed.activations}")
    if ops.name == "cpu" and module == "kernels.cpu_quant":  # GGUF blocks (and int8 / int4 quantized at load)
        from kernels import cpu_quant
        from kernels.cpu_quant_isa import default_isa

        int8 = ops.quantized_activations == "int8" and packed.fmt in cpu_quant.INT8_FORMATS
        rows = cpu_quant.gemm_rows(packed.fmt, "int8" if int8 else "fp32")
        # the level the calls pass: each kernel runs its best variant at or below it (kernels/cpu_quant_isa.py)
        acts = "int8 activations" if int8 else "fp32 activations" + (
            " (int8 digit planes on VNNI)" if default_isa() == "vnni" else "")
        gemm = "bf16 tiles + torch bf16 GEMM (AMX)" if int8 and cpu_quant.bf16_prefill("int8") else "tiles + torch GEMM"
        return f"C GEMV ({default_isa()} or below), {acts}; {gemm} from {rows} rows"
    if ops.name == "cpu" and module == "kernels.cpu_quant_group":  # GPTQ / AWQ / compressed-tensors
        from kernels import cpu_quant_group
        from kernels.cpu_quant_isa import default_isa

        isa = "scalar" if cpu_quant_group.FORCE_SCALAR or default_isa() == "scalar" else "avx2"
        return f"C group GEMV ({isa}), fp32 activations; tiles + torch GEMM from {cpu_quant_group.GEMM_ROWS} rows"
    return f"{ops.name}: {module}.{type(packed).__qualname__}"


def _rows_kernel(ops: KernelOps) -> str:
    """What looks up a packed token table's rows (``KernelOps.quant_rows``)."""
    if ops.name == "torch":
        return "torch reference (rows dequantized per lookup)"
    fn = getattr(ops.quant_rows, "func", ops.quant_rows)  # a functools.partial: the function it calls
    if fn.__module__ == "kernels.cpu_quant":
        return "C rows dequantized per lookup"
    return f"{ops.name}: {fn.__module__}.{fn.__name__}"


def _dense_kernel(ops: KernelOps, weight: torch.Tensor) -> str:
    from kernels import gemm

    if ops.linear is gemm.gemm_ref:
        if weight.device.type == "cuda":
            return "cuBLAS (torch)"
        return "torch GEMM" if ops.name == "cpu" else "torch reference"
    if ops.linear is gemm.gemm:
        return "Triton GEMM"
    return f"{ops.name}: {ops.linear.__module__}.{ops.linear.__name__}"


def _w8a16_kernel(ops: KernelOps) -> str:
    from kernels import gemm

    if ops.w8a16_linear is gemm.w8a16_gemm:
        return "Triton int8 weight-only GEMM"
    if ops.w8a16_linear is gemm.w8a16_gemm_ref:
        return "torch reference (int8 dequantized per call)"
    return f"{ops.name}: {ops.w8a16_linear.__module__}.{ops.w8a16_linear.__name__}"


def _norm_kernel(ops: KernelOps) -> str:
    return {"cpu": "C rms_norm", "triton": "Triton fused rms_norm"}.get(ops.name, f"{ops.name} rms_norm")
