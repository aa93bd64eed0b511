"""The quantized C kernels' library (kernels/cpu/quant*.c, argument types set once), the instruction set they run and
the memory their packed weights live in.

Levels (kernels/cpu/quant_common.h), each including the one before: ``scalar`` (portable C), ``avx2`` (AVX2 + FMA
+ F16C), ``avx512`` (+ AVX-512 F/BW/VL/DQ), ``vnni`` (+ AVX512-VNNI). Every kernel is compiled for every level
(gcc target attributes, whatever the build's -march) and each call passes the level to run at: the C side runs the
kernel's best variant at or below it (the fp32 kernels of the 32-weight formats have none above avx2; the
k-quants' fp32 kernels none above avx512). ``default_isa()``: the best this CPU has (cpuid), unless
DUET_QUANT_ISA=scalar|avx2|avx512|vnni forces one, read once at import (a level above what the CPU has is a
ValueError naming both, at the first call). tests/kernels/test_cpu_quant*.py run every level the CPU has.

``in_huge_pages``: a packed weight of 2 MB or more is copied into memory advised for transparent huge pages
(Linux, ``madvise(MADV_HUGEPAGE)``: THP's "madvise" mode, the common default). A GEMV streams each weight once;
with 4 KB pages every 4 KB is a TLB miss (in a VM, a two-level page walk) that the prefetchers do not run ahead
of. Measured on this 2-vCPU KVM guest, 2048x8192 Q4_K M=1 from memory, C loop (the same kernels), 4 KB -> 2 MB
pages: fp32 5.6 -> 8.5 GB/s on 1 thread, int8 (VNNI) 7.9 -> 10.9; 2 threads int8 15.2 -> 18.7 (plain reads:
12.8 GB/s on 1 thread, 23.6 on 2). Where madvise fails the weight stays where it was, logged once.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

import torch

from kernels.cpu_build import load

log = logging.getLogger(__name__)

ISAS = ("scalar", "avx2", "avx512", "vnni")
PLANES_LEVEL = ISAS.index("vnni")  # from this level fp32 x goes to the digit-plane kernels (quant_planes.c, quant_k_planes.c)
_FORCED = os.environ.get("DUET_QUANT_ISA", "")
if _FORCED and _FORCED not in ISAS:
    raise ValueError(f"DUET_QUANT_ISA={_FORCED!r}: expected one of {', '.join(ISAS)}")
if os.environ.get("DUET_QUANT_SCALAR"):
    raise ValueError("DUET_QUANT_SCALAR is gone: set DUET_QUANT_ISA=scalar")

_lib_ready: ctypes.CDLL | None = None
_default_level: int | None = None
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_huge_pages_failed = False
_amx_bf16: bool | None = None
_I64, _INT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def lib() -> ctypes.CDLL:
    """The loaded kernels (kernels/cpu_build.py), the quantized entry points' argument types set."""
    global _lib_ready
    if _lib_ready is None:
        cdll = load()
        cdll.duet_quant_isa.restype = _INT
        cdll.duet_quant_isa.argtypes = []
        linear = [_INT, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _INT, _INT]
        k_linear = [_INT, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _INT, _INT]
        for fn, args in ((cdll.duet_quant_linear, linear), (cdll.duet_quant_linear_f32, linear),
                         (cdll.duet_quant_linear_planes, linear),
                         (cdll.duet_quant_k_linear_f32, k_linear),
                         (cdll.duet_quant_k_linear_planes, k_linear), (cdll.duet_quant_k_linear_int8, k_linear)):
            fn.restype = _INT
            fn.argtypes = args
        cdll.duet_quant_k_dequantize.restype = None
        cdll.duet_quant_k_dequantize.argtypes = [_INT, _PTR, _I64, _PTR, _I64, _I64, _PTR, _INT, _INT]
        cdll.duet_quant_k_dequantize_bf16.restype = _INT
        cdll.duet_quant_k_dequantize_bf16.argtypes = [_INT, _PTR, _I64, _I64, _I64, _PTR, _INT, _INT]
        cdll.duet_quant_dequantize_bf16.restype = _INT
        cdll.duet_quant_dequantize_bf16.argtypes = [_INT, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _INT, _INT]
        cdll.duet_quant_dequantize.restype = None
        cdll.duet_quant_dequantize.argtypes = [_INT, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _PTR, _INT,
                                               _INT]
        _lib_ready = cdll
    return _lib_ready


def supported_isas() -> tuple[str, ...]:
    """The levels this CPU takes, lowest first."""
    return ISAS[:lib().duet_quant_isa() + 1]


def isa_level(isa: str | None) -> int:
    """The C side's level for ``isa`` (None: ``default_isa()``); a ValueError for a name this CPU cannot run."""
    global _default_level
    if isa is None:
        if _default_level is None:
            _default_level = isa_level(_FORCED or supported_isas()[-1])
        return _default_level
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {', '.join(ISAS)}, got {isa!r}")
    have = supported_isas()
    if isa not in have:
        source = "DUET_QUANT_ISA" if isa == _FORCED else "isa"
        raise ValueError(f"{source}={isa!r}, but this CPU takes at most {have[-1]!r}")
    return ISAS.index(isa)


def amx_bf16() -> bool:
    """This CPU has AMX-BF16 tiles (Linux's /proc/cpuinfo flag ``amx_bf16``), so torch's bf16 GEMM (oneDNN) runs on
    them: 512 x 1536 x 1536 in 1.16 ms against fp32's 7.1 on 2 threads (kernels/cpu_quant.py). Read once."""
    global _amx_bf16
    if _amx_bf16 is None:
        try:
            flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
        except OSError:
            flags = ""
        _amx_bf16 = "amx_bf16" in flags.split()
    return _amx_bf16


def default_isa() -> str:
    """The level the kernels run at unless told otherwise."""
    return ISAS[isa_level(None)]


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) copied into fresh memory whose whole 2 MB pages are advised for transparent huge pages;
    under 2 MB, off Linux, or where madvise fails (logged once): ``t`` itself."""
    global _huge_pages_failed
    nbytes = t.numel() * t.element_size()
    if nbytes < _HUGE_PAGE or _huge_pages_failed or not sys.platform.startswith("linux"):
        return t
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)  # untouched yet: its pages come at the copy
    start = raw.data_ptr()
    offset = -start % _HUGE_PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start + offset, nbytes // _HUGE_PAGE * _HUGE_PAGE, _MADV_HUGEPAGE) != 0:
        _huge_pages_failed = True
        log.warning("kernels: madvise(MADV_HUGEPAGE) failed (%s): packed weights stay in 4 KB pages",
                    os.strerror(ctypes.get_errno()))
        return t
    out = raw[offset:offset + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
