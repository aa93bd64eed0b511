"""Building and loading the CPU path's C kernels (kernels/cpu/*.c; the launchers are kernels/cpu_native.py).

Build: ``$CC`` (default ``cc``) ``-O3 -march=native -fopenmp``, each source with its own flags, linked into
``$DUET_CACHE_DIR/kernels`` (default ``~/.cache/duet/kernels``; a private temp dir if that is not writable),
named by a hash of the sources and headers, the flags, the compiler's version and this CPU's model and
feature flags, so a library built for another machine is never loaded. It is linked under a temporary name
and renamed, so concurrent workers building at once are safe. A build takes about two seconds and needs a C
compiler; without one ``load()`` raises ``NativeKernelError`` with the compiler's message, and the engine
(engine/models/kernel_backend.py) logs it, counts it, and runs the torch references instead.

torch must be imported first: the library's OpenMP runtime is then torch's libgomp (the same soname is
already loaded), so its threads are torch's threads.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import torch  # noqa: F401  (first: its libgomp is the one the library binds to)

# source -> its own flags; elementwise.c: a * b + c stays two roundings (no FMA), as torch's elementwise ops
# compute it, so the fused ops agree with the layers' torch code to the last bit where the order allows; quant.c,
# quant_k*.c: dequantizing is gguf-py's d * q + m, two roundings (its FMAs are explicit intrinsics); quant_g.c: its
# scalar twin's sums stay one rounding per operation, as written
_SOURCES = {Path(__file__).parent / "cpu" / name: flags for name, flags in (
    ("attention.c", []), ("attention_kv8.c", []), ("elementwise.c", ["-ffp-contract=off"]),
    ("quant.c", ["-ffp-contract=off"]), ("quant_planes.c", ["-ffp-contract=off"]),
    ("quant_k.c", ["-ffp-contract=off"]), ("quant_k_int8.c", ["-ffp-contract=off"]),
    ("quant_k_planes.c", ["-ffp-contract=off"]),
    ("quant_g.c", ["-ffp-contract=off"]), ("lora.c", []))}
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fopenmp", "-fPIC", "-std=gnu11"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None

_I64, _INT, _F32, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class NativeKernelError(RuntimeError):
    """The C kernels could not be built or loaded on this machine (the message says why)."""


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def _cpu_identity() -> str:
    ident = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                ident += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        ident += platform.processor()
    return ident


def library_path() -> Path:
    try:
        version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeKernelError(f"no C compiler ({_compiler()}): {e}") from e
    # the headers and the templates the sources include (attention_decode.inc, attention_kv8.inc)
    headers = sorted([*(Path(__file__).parent / "cpu").glob("*.h"), *(Path(__file__).parent / "cpu").glob("*.inc")])
    parts = [f"{src.read_text()}{flags}" for src, flags in _SOURCES.items()] + [h.read_text() for h in headers] + [
        " ".join(_FLAGS), version, _cpu_identity()]
    key = hashlib.sha256("\0".join(parts).encode())
    root = Path(os.environ.get("DUET_CACHE_DIR") or Path.home() / ".cache" / "duet") / "kernels"
    name = f"duet_cpu_{key.hexdigest()[:16]}.so"
    if not (root / name).exists() and not _writable(root):  # a read-only home (containers): a private temp dir
        root = Path(tempfile.gettempdir()) / f"duet-kernels-{os.getuid()}"
    return root / name


def _writable(root: Path) -> bool:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(root, os.W_OK)


def _build(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        try:
            objects = []
            for src, flags in _SOURCES.items():
                obj = os.path.join(tmp, src.stem + ".o")
                _run([_compiler(), *_FLAGS, *flags, "-c", str(src), "-o", obj])
                objects.append(obj)
            lib = os.path.join(tmp, "lib.so")
            _run([_compiler(), "-shared", "-fopenmp", *objects, "-o", lib, "-lm"])
            os.replace(lib, path)
        except (OSError, subprocess.SubprocessError) as e:
            raise NativeKernelError(f"building the CPU kernels failed: {e}") from e


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise NativeKernelError(f"building the CPU kernels failed ({' '.join(cmd)}):\n{proc.stderr.strip()[-2000:]}")


def _declare_int8_kv(lib: ctypes.CDLL) -> None:
    """kernels/cpu/attention_kv8.c (1-byte KV caches, int8 / fp8 e4m3 / fp8 e5m2: kernels/cpu_kv_int8.py)."""
    cache = [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64]  # values + strides (block, token, head), scales + strides
    fresh = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR]  # prefill's fresh K and V rows + strides (token, head), fresh
    for sfx in ("i8", "e4m3", "e5m2"):
        decode, prefill = getattr(lib, f"duet_decode_attention_{sfx}"), getattr(lib, f"duet_prefill_attention_{sfx}")
        store = getattr(lib, f"duet_store_kv_{sfx}")
        decode.restype = _INT
        decode.argtypes = [_PTR, _I64, _I64, *cache, *cache, _PTR, _I64, _PTR, _PTR, _I64, _I64,
                           _INT, _INT, _INT, _INT, _INT, _F32, _INT, _INT]
        prefill.restype = _INT
        prefill.argtypes = [_PTR, _I64, _I64, *cache, *cache, *fresh, _PTR, _I64, _PTR, _PTR, _PTR, _I64,
                            _I64, _INT, _INT, _INT, _INT, _INT, _F32, _INT, _INT]
        store.restype = None
        store.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64,
                          _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _INT, _INT, _INT]


def load() -> ctypes.CDLL:
    """The loaded library (built first if this machine has none yet)."""
    global _lib
    with _lock:
        if _lib is None:
            path = library_path()
            if not path.exists():
                _build(path)
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:
                raise NativeKernelError(f"loading {path} failed: {e}") from e
            lib.duet_decode_attention_f32.restype = _INT
            lib.duet_decode_attention_f32.argtypes = [
                _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64,
                _I64, _INT, _INT, _INT, _INT, _INT, _F32, _INT, _INT]
            lib.duet_prefill_attention_f32.restype = _INT
            lib.duet_prefill_attention_f32.argtypes = [
                _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64,
                _I64, _INT, _INT, _INT, _INT, _INT, _F32, _INT, _INT]
            lib.duet_gather_kv_f32.restype = None
            lib.duet_gather_kv_f32.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _INT, _INT, _I64, _PTR, _PTR]
            lib.duet_check_paged_f32.restype = _INT
            lib.duet_check_paged_f32.argtypes = [_PTR, _I64, _PTR, _INT, _INT, _INT, _I64]
            lib.duet_store_kv_f32.restype = None
            lib.duet_store_kv_f32.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64,
                                              _INT, _I64]
            _declare_int8_kv(lib)
            lib.duet_rms_norm_f32.restype = None
            lib.duet_rms_norm_f32.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _INT, _F32, _INT]
            lib.duet_rotary_f32.restype = None
            lib.duet_rotary_f32.argtypes = [_PTR, _I64, _I64, _INT, _INT, _INT, _PTR, _PTR, _PTR, _INT]
            lib.duet_silu_mul_f32.restype = None
            lib.duet_silu_mul_f32.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _INT, _INT]
            lib.duet_embedding_f32.restype = _INT
            lib.duet_embedding_f32.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _INT]
            _lib = lib
        return _lib
