"""The quantized C kernels' library (kernels/cpu/quant*.c, argument types set once) and the instruction set they run.

Levels (kernels/cpu/quant_common.h), each including the one before: ``scalar`` (portable C), ``avx2`` (AVX2 + FMA
+ F16C), ``avx512`` (+ AVX-512 F/BW/VL/DQ), ``vnni`` (+ AVX512-VNNI). Every kernel is compiled for every level
(gcc target attributes, whatever the build's -march) and each call passes the level to run at: the C side runs the
kernel's best variant at or below it (the fp32 kernels of the 32-weight formats have none above avx2; the
k-quants' fp32 kernels none above avx512). ``default_isa()``: the best this CPU has (cpuid), unless
DUET_QUANT_ISA=scalar|avx2|avx512|vnni forces one, read once at import (a level above what the CPU has is a
ValueError naming both, at the first call). tests/kernels/test_cpu_quant*.py run every level the CPU has.
"""
from __future__ import annotations

import ctypes
import os

from kernels.cpu_build import load

ISAS = ("scalar", "avx2", "avx512", "vnni")
_FORCED = os.environ.get("DUET_QUANT_ISA", "")
if _FORCED and _FORCED not in ISAS:
    raise ValueError(f"DUET_QUANT_ISA={_FORCED!r}: expected one of {', '.join(ISAS)}")
if os.environ.get("DUET_QUANT_SCALAR"):
    raise ValueError("DUET_QUANT_SCALAR is gone: set DUET_QUANT_ISA=scalar")

_lib_ready: ctypes.CDLL | None = None
_default_level: int | None = None
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
                         (cdll.duet_quant_k_linear_f32, k_linear), (cdll.duet_quant_k_linear_int8, k_linear)):
            fn.restype = _INT
            fn.argtypes = args
        cdll.duet_quant_k_dequantize.restype = None
        cdll.duet_quant_k_dequantize.argtypes = [_INT, _PTR, _I64, _PTR, _I64, _I64, _PTR, _INT, _INT]
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


def default_isa() -> str:
    """The level the kernels run at unless told otherwise."""
    return ISAS[isa_level(None)]
