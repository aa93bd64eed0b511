"""The CPU path's batched LoRA shrink / expand (kernels/cpu/lora.c): ``lora_add`` with kernels/lora.py's signature
and semantics (its reference ``lora_add_ref``), fp32 activations on the CPU, one C call per projection; the adapters'
weights stored in fp32, or in bf16 / fp16 (``lora_dtype``: half the bytes read, widened exactly on load).

The C kernel groups the step's tokens by slot itself (so each adapter's weights are read once per call for all its
tokens, and nothing is grouped on the host), reads only the diagonal blocks of a fused projection's ``bt``, and
checks every slot and the shard offsets on every call (a replayed step, kernels/cpu_graph.py, included). AVX-512 /
AVX2 / portable C chosen per call as for the quantized kernels (kernels/cpu_quant_isa.py: the best this CPU takes
unless ``isa`` or DUET_QUANT_ISA forces a lower level); OpenMP over (slot, tokens, rows / columns) items,
``torch.get_num_threads()`` threads. A token's result does not depend on the rest of the batch or on the thread
count (the C file's docstring says why), so a padded, recorded decode step gives the eager step's bits.

Measured with ``python -m bench.kernels.lora_cpu`` (2026-11-28, the 2-vCPU dev VM: a decode step's 120 projections of
SmolLM2-135M, batch 16, 8 adapters of rank 16, each call after its oneDNN GEMM): 11.7 ms a step in fp32 (156 MB read,
13 GB/s), 10.1 ms in bf16 (78 MB); AVX2 the same as AVX-512 within the noise, the portable C 44 ms. The engine-level
figures (``make bench-lora``) are in bench/engine/lora.py.
"""
from __future__ import annotations

import ctypes

import torch

from kernels.cpu_build import NativeKernelError
from kernels.cpu_quant_isa import isa_level, lib
from kernels.lora import check_lora_args

_I64, _INT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_declared: ctypes.CDLL | None = None
_ERRORS = {1: "a token's slot is outside [-1, slots)", 2: "shard_cols is not a partition of out's columns",
           3: "no scratch memory", 4: "an unknown weight type"}
_WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # kernels/cpu/lora.c's W_F32, W_BF16, W_F16


def _lib() -> ctypes.CDLL:
    global _declared
    if _declared is None:
        cdll = lib()
        cdll.duet_lora_add_f32.restype = _INT
        cdll.duet_lora_add_f32.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _INT, _I64, _I64,
                                           _I64, _PTR, _PTR, _PTR, _INT, _INT]
        _declared = cdll
    return _declared


def lora_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scaling: torch.Tensor,
             token_slots: torch.Tensor, shard_cols: torch.Tensor, *, isa: str | None = None) -> torch.Tensor:
    """``out`` [T, N] += each token's adapter delta, in place (kernels/lora.py ``lora_add``); returns ``out``.
    x / out fp32, a / bt fp32, bf16 or fp16. ``isa``: scalar | avx2 | avx512 | vnni (avx512's kernels), None:
    kernels/cpu_quant_isa.py's default."""
    check_lora_args(out, x, a, bt, scaling, token_slots, shard_cols, (torch.float32,))
    if not (out.is_cpu and x.is_cpu and a.is_cpu and bt.is_cpu and scaling.is_cpu and token_slots.is_cpu
            and shard_cols.is_cpu):
        raise ValueError("the C kernels take CPU tensors, got "
                         f"{[t.device.type for t in (out, x, a, bt, scaling, token_slots, shard_cols)]}")
    t, k = x.shape
    n, shards = out.shape[1], shard_cols.shape[0] - 1
    if t == 0 or n == 0:
        return out
    rc = _lib().duet_lora_add_f32(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), t, k, n, a.data_ptr(),
                                  bt.data_ptr(), _WEIGHT_TYPES[a.dtype], a.shape[0], shards, a.shape[1] // shards,
                                  shard_cols.data_ptr(), scaling.data_ptr(), token_slots.data_ptr(), isa_level(isa),
                                  torch.get_num_threads())
    if rc == 1:
        raise ValueError(f"token_slots must be in [-1, {a.shape[0]})")
    if rc == 2:
        raise ValueError(f"shard_cols must rise from 0 to out's {n} columns")
    if rc:
        raise NativeKernelError(f"duet_lora_add_f32: {_ERRORS.get(rc, rc)}")
    return out
