"""A CPU decode step recorded once and replayed: the C kernel calls of one forward, without the Python that made
them (the CPU's counterpart of a CUDA graph; engine/decode_graphs.py uses it).

Why: a decode step of a small packed model is ~270 C calls of 5-40 µs each, and the Python around them (modules,
argument checks, views, output allocations) cost more than the calls: on SmolLM2-135M Q4_1 at batch 1 the layers'
Python was about half the step (measured: see engine/decode_graphs.py).

``record(fn)`` runs ``fn()`` once with every ``duet_*`` function of the kernels' library (kernels/cpu_build.py
``load``; the same ctypes object every wrapper calls through) swapped for a recorder that notes the function and
its converted arguments, then calls it. Under a ``TorchDispatchMode`` that allows only allocations and views: any
other torch operator in ``fn`` (a GEMM in torch, an index_select, a fill, a value read on the host such as
``int(t.max())``) would not be in the recording, so it fails the recording with ``NotReplayable`` naming the
operator, and the caller runs eagerly. The tensors allocated during the recording are kept by it (the recorded
calls write into them at replay); everything else a call points at (weights, the KV cache, the caller's static
input buffers) must outlive the ``Recording``: the caller's responsibility (engine/decode_graphs.py keys a
recording by the KV cache's address).

While recording, ``recording()`` is True and the wrappers skip their checks of values (kernels/_triton_utils.py
``value_checks_enabled``): the caller checks a replayed step's inputs itself, once. Checks of shapes still run
(they are fixed for a recording). A recorded check call (``duet_check_*``, returning nonzero on bad input) is
kept once per distinct arguments, and runs at replay like the rest.

``Recording.replay()`` calls the recorded functions in order; a nonzero return (a C kernel's error code) raises
``NativeKernelError`` naming the function.
"""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.cpu_build import NativeKernelError, load

_state = threading.local()
_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default}


class NotReplayable(RuntimeError):
    """The recorded function did something a replay of its C calls would not repeat."""


def recording() -> bool:
    """A recording is under way on this thread (the wrappers then skip their value checks)."""
    return getattr(_state, "active", False)


class Recording:
    """The C calls of one run of a function, and the tensors they write."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable, tuple]] = []
        self.tensors: list[torch.Tensor] = []  # allocated while recording: kept alive for the replays
        self._checks: set[tuple] = set()
        self.replays = 0

    def note(self, name: str, fn: Callable, args: tuple) -> None:
        if name.startswith("duet_check_"):
            key = (name, args)
            if key in self._checks:
                return
            self._checks.add(key)
        types = getattr(fn, "argtypes", None)
        if types and len(types) == len(args):  # converted once: ctypes then passes them as they are (~2x faster)
            args = tuple(a if isinstance(a, t) else t(a) for t, a in zip(types, args))
        self.calls.append((fn, args))

    def replay(self) -> None:
        for fn, args in self.calls:
            rc = fn(*args)
            if rc:
                raise NativeKernelError(f"{fn.__name__} returned {rc} in a replayed step")
        self.replays += 1


class _OnlyViews(TorchDispatchMode):
    def __init__(self, rec: Recording) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.rec.tensors.append(out)
        elif not func.is_view and func not in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            raise NotReplayable(f"{func} runs in torch, outside the recorded C calls")
        return out


def record(fn: Callable[[], object]) -> tuple[Recording, object]:
    """Run ``fn()`` once, recording its C calls; (the recording, what ``fn`` returned). ``NotReplayable`` if
    ``fn`` runs a torch operator other than an allocation or a view."""
    lib = load()
    rec = Recording()
    originals = {name: getattr(lib, name) for name in _loaded_names(lib)}
    for name, original in originals.items():
        setattr(lib, name, _recorder(rec, name, original))
    _state.active = True
    try:
        with _OnlyViews(rec):
            result = fn()
    finally:
        _state.active = False
        for name, original in originals.items():
            setattr(lib, name, original)
    unseen = sorted(set(_loaded_names(lib)) - set(originals))
    if unseen:  # ctypes looked them up during the recording: called, but not recorded
        raise NotReplayable(f"{', '.join(unseen)} first called while recording (run the function once before)")
    return rec, result


def _loaded_names(lib: ctypes.CDLL) -> list[str]:
    """The library's functions ctypes has looked up so far (ctypes caches each in the instance's dict at its
    first lookup: a function never called before a recording is not there to be swapped)."""
    return [n for n, v in vars(lib).items() if n.startswith("duet_") and isinstance(v, ctypes._CFuncPtr)]


def _recorder(rec: Recording, name: str, fn: Callable) -> Callable:
    def call(*args):
        rec.note(name, fn, args)
        return fn(*args)
    call.__name__ = name
    return call
