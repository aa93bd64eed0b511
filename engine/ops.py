"""The kernel backend seam: which implementation of each op the model calls.

``torch``: the plain-torch references in kernels/ (the CPU path). ``triton``: the Triton launchers (CUDA, or
the Triton interpreter on CPU when forced, as the tests do). ``auto``: triton on CUDA, torch on CPU.
``DUET_KERNELS`` in the environment overrides ``auto``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from engine.errors import ConfigError


@dataclass(frozen=True)
class KernelOps:
    name: str
    store_kv: Callable
    prefill_attention: Callable
    decode_attention: Callable
    linear: Callable
    w8a16_linear: Callable


def resolve_backend(requested: str, device: str) -> str:
    env = os.environ.get("DUET_KERNELS", "").strip().lower()
    choice = requested if requested != "auto" else (env or "auto")
    if choice == "auto":
        choice = "triton" if device.startswith("cuda") else "torch"
    if choice not in ("torch", "triton"):
        raise ConfigError(f"unknown kernel backend {choice!r} (DUET_KERNELS / kernels: torch | triton | auto)")
    if choice == "triton" and not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("the triton backend on CPU needs TRITON_INTERPRET=1 in the environment before start-up")
    return choice


def get_ops(backend: str) -> KernelOps:
    from kernels import decode_attention, gemm, prefill_attention, store_kv

    if backend == "torch":
        return KernelOps(
            name="torch",
            store_kv=store_kv.store_kv_ref,
            prefill_attention=prefill_attention.prefill_attention_ref,
            decode_attention=decode_attention.paged_decode_attention_ref,
            linear=gemm.gemm_ref,
            w8a16_linear=gemm.w8a16_gemm_ref,
        )
    return KernelOps(
        name="triton",
        store_kv=store_kv.store_kv,
        prefill_attention=prefill_attention.prefill_attention,
        decode_attention=decode_attention.paged_decode_attention,
        linear=gemm.gemm,
        w8a16_linear=gemm.w8a16_gemm,
    )
