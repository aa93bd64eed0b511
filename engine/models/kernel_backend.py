"""The kernel backend seam: which implementation of each op the model calls.

``torch``: the plain-torch references in kernels/. ``cpu``: the CPU path: KV stores,
attention and the fused per-token ops from kernels/cpu_native.py (C, and GEMM-shaped torch; float32 only);
GEMMs by oneDNN on weights packed once at load.
``triton``: the Triton launchers, the fused per-token ops of kernels/fused.py included (CUDA, or the Triton
interpreter on CPU when forced, as the tests do). One exception, by measurement: on a CUDA device the dense
(unquantized) GEMMs go to cuBLAS through ``torch.nn.functional.linear``: on an H200 it ran 1.1-1.2x our best
Triton tile config at decode shapes replayed from CUDA graphs (M = 1, 16 of 4096x4096; 3x when launched from
Python) and 1.3x at prefill (M = 4096) (bench/kernels/gemm_sweep.py, `make bench-kernels`, 2026-11-25,
docs/benchmarks.md); the int8 weight-only GEMM (no cuBLAS equivalent) stays Triton, and so do the GEMMs of a
quantized checkpoint's packed weights (kernels/quant_gemm.py; dequantize + cuBLAS from its ``DEQUANT_GEMM_ROWS``
rows of x). In the interpreter
the Triton GEMM runs, so the tests keep it exercised through the engine. A MoE layer's experts run as one
fused-MoE kernel pair (kernels/fused_moe.py), on a GPU and in the interpreter alike.
``auto``: triton on CUDA; on a CPU, ``cpu`` for float32 models and ``torch`` otherwise. ``DUET_KERNELS`` in the
environment overrides ``auto``.

A quantized KV cache (``kv_cache_dtype``, engine/kv/cache_dtype.py) needs store and attention kernels that read its
pages (values + per-token, per-head scales): ``torch`` has int8 and both fp8s (the references), ``cpu`` int8
and both fp8s (kernels/cpu_kv_int8.py), ``triton`` int8 and both fp8s (kernels/store_kv.py, kernels/_paged_kv.py)
(``KV_CACHE_DTYPES_BY_BACKEND``); ``get_ops`` refuses the others by name rather than run something else. On a GPU
below compute capability 8.9 (A100: 8.0) Triton 3.9 has no e4m3 type ("type fp8e4nv not supported in this
architecture", seen compiling the store for sm_80 with tests/kernels/sm90_compile.py's stand-in driver; int8 and
e5m2 compile there), so ``fp8_e4m3`` on ``triton`` is refused at start-up there, naming the GPU.

If ``auto`` picks ``cpu`` and the C library cannot be built or loaded (no compiler), the engine runs ``torch``
instead: ``resolve_backend`` returns the reason, the runner logs it and the worker counts it
(``duet_kernel_fallbacks``). Asking for ``cpu`` by name makes the same failure a ConfigError.
"""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import ConfigError

log = logging.getLogger(__name__)
BACKENDS = ("torch", "cpu", "triton")


@dataclass(frozen=True)
class KernelOps:
    name: str
    store_kv: Callable
    prefill_attention: Callable
    decode_attention: Callable
    linear: Callable
    w8a16_linear: Callable
    # fused per-token ops (kernels/cpu_native.py in C, kernels/fused.py in Triton); None: the layers' own torch
    # code (engine/models/layers.py)
    rms_norm: Callable | None = None
    rotary_: Callable | None = None
    silu_mul: Callable | None = None
    # GEMMs on weights packed once at load (oneDNN's blocked layout); None: ``linear`` on the dense weight
    pack_linear: Callable | None = None
    linear_packed: Callable | None = None
    # the whole MoE expert block in one call (kernels/fused_moe.py, triton only); None: engine/models/moe.py's grouped
    # GEMMs through ``linear``
    fused_moe: Callable | None = None
    # quantized checkpoint weights kept packed (engine/loading/quantized.py): the block types (ggml names) this
    # backend takes; ``pack_quant(kernels.quant.QuantWeight)`` once at load, then ``quant_linear(x, packed, bias,
    # out=None)`` (``out``: a [M, rows] view, columns of a wider output, written and returned) and
    # ``quant_rows(packed, ids)`` (a quantized token table). Empty: such weights are dequantized at load.
    quant_formats: frozenset[str] = frozenset()
    pack_quant: Callable | None = None
    quant_linear: Callable | None = None
    quant_rows: Callable | None = None
    quantized_activations: str = "fp32"  # what ``quant_linear`` does to x: fp32, or int8 per 32-block (cpu only)
    # ``embedding(table, ids)``: rows of a float token table (one rank's whole table); None: torch's embedding
    embedding: Callable | None = None
    # the attention launchers take ``softcap=`` (Gemma 2's attention logit cap); False: engine/models/attention.py runs
    # the torch references for capped models (the runner counts it as a kernel fallback)
    attention_softcap: bool = False
    # ``lora_add(out, x, a, bt, scaling, token_slots, shard_cols)``: LoRA adapters' deltas added per token
    # (kernels/cpu_lora.py in C, kernels/lora.py in Triton); None: engine/lora/ops.py's torch forms
    lora_add: Callable | None = None
    # ``lora_slots(n_slots, in_features, shard_sizes, max_rank, dtype)``: a projection's adapter slots in the
    # kernel's own layout (``write(slot, shards)``, ``add_(out, x, scaling, token_slots)``; kernels/cpu_lora.py
    # ``PackedLoraSlots``); None: engine/lora/pool.py holds the logical ``a`` / ``bt`` for ``lora_add``
    lora_slots: Callable | None = None


def resolve_backend(requested: str, device: str, dtype: torch.dtype = torch.float32) -> tuple[str, str | None]:
    """(backend, fallback reason or None). A fallback is ``auto`` settling for ``torch`` on a CPU because the C
    kernels would not build or load."""
    env = os.environ.get("DUET_KERNELS", "").strip().lower()
    choice = requested if requested != "auto" else (env or "auto")
    if choice not in ("auto", *BACKENDS):
        raise ConfigError(f"unknown kernel backend {choice!r} (DUET_KERNELS / kernels: {' | '.join(BACKENDS)} | auto)")
    on_cuda = device.startswith("cuda")
    if choice == "auto":
        if on_cuda:
            return "triton", None
        if dtype != torch.float32:
            log.info("kernels: torch references (the C attention kernels take float32, the model is %s)", dtype)
            return "torch", None
        try:
            _load_native()
        except Exception as e:  # noqa: BLE001 - any build/load failure means: run the references, said loudly
            log.warning("kernels: the C attention kernels are unavailable, running the torch references "
                        "(slower): %s", e)
            return "torch", f"{type(e).__name__}: {e}"
        return "cpu", None
    if choice == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("the triton backend on CPU needs TRITON_INTERPRET=1 in the environment before start-up")
    if choice == "cpu":
        if on_cuda:
            raise ConfigError("the cpu kernel backend runs on a CPU device only")
        if dtype != torch.float32:
            raise ConfigError(f"the cpu kernel backend takes float32 models, this one is {dtype}")
        try:
            _load_native()
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"the cpu kernel backend is unavailable: {e}") from e
    return choice, None


def _load_native() -> None:
    from kernels import cpu_native

    cpu_native.load()


def _cpu_quant_linear(activations: str) -> Callable:
    """kernels/cpu_quant.py's linear for ``activations``, chosen once here rather than per call: int8 activations
    where its int8 kernel takes the format (``INT8_FORMATS``: every GGUF format, the k-quants' x per 256), fp32
    for the rest, so a model mixing them runs in one mode."""
    from kernels import cpu_quant

    if activations == "fp32":
        return functools.partial(cpu_quant.linear, activations="fp32")
    int8_formats = cpu_quant.INT8_FORMATS

    def linear(x, packed, bias=None, out=None):
        return cpu_quant.linear(x, packed, bias, activations=activations if packed.fmt in int8_formats else "fp32",
                                out=out)
    return linear


def _cpu_pack_quant(w):
    """Once per weight at load: GGUF blocks by kernels/cpu_quant.py, GPTQ / AWQ / compressed-tensors layers by
    kernels/cpu_quant_group.py."""
    from kernels import cpu_quant, cpu_quant_group
    from kernels.quant_group import GroupQuantWeight

    return cpu_quant_group.pack(w) if isinstance(w, GroupQuantWeight) else cpu_quant.pack(w)


def _torch_quant_linear(x, w, bias=None, out=None):
    """The references (float32 sums) rounded to x's dtype: a bfloat16 model's next layer takes bfloat16."""
    from kernels import quant, quant_group

    if isinstance(w, quant_group.GroupQuantWeight):
        y = quant_group.group_linear_ref(x, w, bias)
    else:
        y = quant.quant_linear_ref(x, w, bias)
    return y.to(x.dtype) if out is None else out.copy_(y)


def _check_e4m3_gpu(device: str) -> None:
    """Triton compiles float8e4nv (torch's float8_e4m3fn) for compute capability >= 8.9 only (module docstring)."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(f"kv_cache_dtype fp8_e4m3 on the triton kernels needs a GPU of compute capability >= 8.9; "
                          f"{torch.cuda.get_device_name(device)} is {major}.{minor} (int8 and fp8_e5m2 run there)")


def _triton_quant_formats() -> frozenset[str]:
    from kernels import quant_gpu

    return quant_gpu.GPU_FORMATS | {"FP8"}


def _triton_pack_quant(w, device: str, dtype: torch.dtype):
    """GGUF blocks and GPTQ / AWQ / compressed-tensors layers into kernels/quant_gpu.py's layout; an FP8 layer
    (engine/loading/hf_fp8.py) kept in FP8 where it measures faster than its dequantized weight (kernels/fp8_gemm.py
    ``prefer_fp8``: timed on CUDA, per layer shape; else the weight in ``dtype``, logged)."""
    from kernels import fp8_gemm, quant_gpu

    if getattr(w, "fmt", None) != "FP8":
        return quant_gpu.pack_gpu(w, device=device)
    packed = fp8_gemm.pack(w, w.activations, w.group_size, w.scale_ub, device=device)
    key = (packed.rows, packed.cols, packed.block)
    if key not in _FP8_CHOICE:
        _FP8_CHOICE[key] = fp8_gemm.prefer_fp8(packed, dtype)
        if not _FP8_CHOICE[key]:
            log.info("kernels: FP8 %dx%d layers run in %s: their dequantized GEMM measured faster", packed.rows,
                     packed.cols, dtype)
    return packed if _FP8_CHOICE[key] else fp8_gemm.as_dense(packed, dtype)


_FP8_CHOICE: dict[tuple, bool] = {}  # per FP8 layer shape: whether the FP8 GEMM measured faster (once a process)


def _triton_quant_linear(x, packed, bias=None, out=None):
    from kernels import fp8_gemm, quant_gemm

    if packed.fmt == "FP8":
        return fp8_gemm.linear(x, packed, bias, out=out)
    y = quant_gemm.quant_gemm(x, packed, bias)
    return y if out is None else out.copy_(y)


# the quantized KV cache dtypes (EngineConfig.kv_cache_dtype) each backend's store and attention kernels read
KV_CACHE_DTYPES_BY_BACKEND = {"torch": ("int8", "fp8_e4m3", "fp8_e5m2"), "cpu": ("int8", "fp8_e4m3", "fp8_e5m2"),
                              "triton": ("int8", "fp8_e4m3", "fp8_e5m2")}


def get_ops(backend: str, device: str = "cpu", quantized_activations: str = "fp32",
            dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto") -> KernelOps:
    """``quantized_activations`` (EngineConfig's): "int8" makes the cpu backend's quantized linear quantize its
    activations per 32-block (llama.cpp's scheme); the other backends take fp32 only. ``dtype``: the model's; the
    triton and torch backends' quantized token-table rows come out in it (the torch references' linears in x's dtype).
    ``kv_cache_dtype`` (EngineConfig's): a quantized one this backend's kernels do not read yet
    (``KV_CACHE_DTYPES_BY_BACKEND``) is a ConfigError naming both."""
    from kernels import decode_attention, gemm, prefill_attention, store_kv

    if quantized_activations != "fp32" and backend != "cpu":
        raise ConfigError(f"quantized_activations {quantized_activations!r} needs the cpu kernel backend, "
                          f"not {backend}")
    if kv_cache_dtype != "auto" and kv_cache_dtype not in KV_CACHE_DTYPES_BY_BACKEND[backend]:
        takes = [b for b, names in KV_CACHE_DTYPES_BY_BACKEND.items() if kv_cache_dtype in names]
        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype} is not implemented yet on the {backend} kernels "
                          f"(it runs on: {', '.join(takes)}; kernels=torch takes every KV dtype)")
    if backend == "triton" and kv_cache_dtype == "fp8_e4m3" and device.startswith("cuda"):
        _check_e4m3_gpu(device)

    if backend == "cpu":
        from kernels import cpu_kv_int8, cpu_lora, cpu_native, cpu_quant

        if not cpu_native.onednn_available():
            log.warning("kernels: this torch build has no oneDNN: the CPU path's GEMMs run on dense weights (MKL)")
        int8_kv = kv_cache_dtype != "auto"  # the C kernels of a 1-byte cache (kernels/cpu/attention_kv8.c)
        return KernelOps(
            name="cpu",
            store_kv=cpu_kv_int8.store_kv if int8_kv else cpu_native.store_kv,
            prefill_attention=cpu_kv_int8.prefill_attention if int8_kv else cpu_native.prefill_attention,
            decode_attention=cpu_kv_int8.paged_decode_attention if int8_kv else cpu_native.paged_decode_attention,
            linear=gemm.gemm_ref,
            w8a16_linear=gemm.w8a16_gemm_ref,
            rms_norm=cpu_native.rms_norm,
            rotary_=cpu_native.rotary_,
            silu_mul=cpu_native.silu_mul,
            embedding=cpu_native.embedding,
            pack_linear=cpu_native.pack_linear if cpu_native.onednn_available() else None,
            linear_packed=cpu_native.linear_packed,
            quant_formats=frozenset(cpu_quant.GGUF_BLOCKS) | cpu_quant.GROUP_FORMAT_NAMES,  # kernels/cpu/quant*.c
            pack_quant=_cpu_pack_quant, quant_rows=cpu_quant.rows,
            quant_linear=_cpu_quant_linear(quantized_activations), quantized_activations=quantized_activations,
            lora_add=cpu_lora.lora_add, lora_slots=cpu_lora.PackedLoraSlots,
        )
    if backend == "torch":
        from kernels import quant, quant_group

        return KernelOps(
            name="torch",
            # the references, dequantized per call, exactly; on CPU tensors (the loader's blocks stay in host memory)
            quant_formats=(frozenset(quant.GGUF_BLOCKS) | frozenset(quant_group.GROUP_FORMATS.values())
                           if device == "cpu" else frozenset()),
            pack_quant=lambda w: w, quant_linear=_torch_quant_linear,
            quant_rows=lambda w, ids: quant.quant_rows_ref(w, ids).to(dtype),
            store_kv=store_kv.store_kv_ref,
            prefill_attention=prefill_attention.prefill_attention_ref,
            decode_attention=decode_attention.paged_decode_attention_ref,
            linear=gemm.gemm_ref,
            w8a16_linear=gemm.w8a16_gemm_ref,
            attention_softcap=True,
        )
    from kernels import fused, fused_moe, lora, quant_rows

    return KernelOps(
        name="triton",
        # quantized weights kept packed on the device, dequantized in registers (kernels/quant_gemm.py); FP8
        # checkpoints' weights in FP8 (kernels/fp8_gemm.py: torch._scaled_mm)
        quant_formats=_triton_quant_formats(), pack_quant=functools.partial(_triton_pack_quant, device=device,
                                                                            dtype=dtype),
        quant_linear=_triton_quant_linear, quant_rows=functools.partial(quant_rows.quant_rows, dtype=dtype),
        store_kv=store_kv.store_kv,
        prefill_attention=prefill_attention.prefill_attention,
        decode_attention=decode_attention.paged_decode_attention,
        linear=gemm.gemm_ref if device.startswith("cuda") else gemm.gemm,  # cuBLAS on a GPU (module doc)
        w8a16_linear=gemm.w8a16_gemm,
        rms_norm=fused.rms_norm,
        rotary_=fused.rotary_,
        silu_mul=fused.silu_mul,
        fused_moe=fused_moe.fused_moe,
        attention_softcap=True,
        lora_add=lora.lora_add,
    )
