"""The CPU path's batched LoRA shrink / expand (kernels/cpu/lora.c), fp32 activations, one C call per projection.

``PackedLoraSlots``: one projection's adapter slots in the C kernel's packed layout (the C file's docstring draws
it): per slot one contiguous region holding each shard's A in 4-row tiles and its B in 16-column blocks (grouped by
4), at the adapter's own rank, so a decode step reads exactly each adapter's bytes front to back (no zero blocks of
a fused projection, no padding to ``max_lora_rank``, nothing for a projection the adapter does not target). The
weights are stored fp32, or bf16 / fp16 (``lora_dtype``: half the bytes read, widened exactly on load).
engine/lora/pool.py holds one per projection on the ``cpu`` kernel backend (``KernelOps.lora_slots``); ``add_`` is
the per-step call.

``lora_add``: kernels/lora.py's signature and semantics (its reference ``lora_add_ref``) over the logical layout
(``a`` [slots, S*R, K], ``bt`` [slots, S*R, N] block-diagonal), packing into a ``PackedLoraSlots`` on every call: for
tests and one-off calls, not the engine.

The C kernel groups the step's tokens by slot itself (each adapter's weights read once per call for all its
tokens, nothing grouped on the host) and checks every slot, rank and the geometry on every call (a replayed step,
kernels/cpu_graph.py, included). AVX-512 / AVX2 / portable C chosen per call as for the quantized kernels
(kernels/cpu_quant_isa.py: the best this CPU takes unless ``isa`` or DUET_QUANT_ISA forces a lower level); OpenMP
over (slot, tokens) tasks, ``torch.get_num_threads()`` threads. A token's result does not depend on the rest of the
batch or on the thread count (the C file's docstring says why), so a padded, recorded decode step gives the eager
step's bits.

Measured with ``python -m bench.kernels.lora_cpu`` (2026-11-28 23:06 UTC, the 2-vCPU dev VM: a decode step's 120
projections of SmolLM2-135M, batch 16, 8 adapters of rank 16, each call after its oneDNN GEMM): LoRA adds 10.7 ms a
step in fp32 (156 MB read) and 5.7-8.1 ms in bf16 (78 MB) to 39 ms of GEMMs; AVX2 14.8 ms, the portable C 43.4 ms.
The first kernel over the logical zero-padded slots (a shrink phase, a barrier, an expand phase; 21:0x): 11.7 / 10.1
ms. A plain read of the same bytes in the same place: 6-7.5 ms fp32. Per call ~4.8 us of Python (checks, ctypes).
The engine-level figures (``make bench-lora``) are in bench/engine/lora.py.
"""
from __future__ import annotations

import ctypes

import torch

from kernels.cpu_build import NativeKernelError
from kernels.cpu_quant_isa import isa_level, lib
from kernels.lora import check_lora_args

_I64, _INT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
MAX_SHARDS = 8  # kernels/cpu/lora.c LORA_MAX_SHARDS
_GROUP = 4  # kernels/cpu/lora.c GROUP: B's blocks interleaved row by row in groups of 4
_declared: ctypes.CDLL | None = None
_ERRORS = {2: "a geometry the packed layout does not hold", 3: "no scratch memory", 4: "an unknown weight type",
           5: "a slot's rank outside [0, max_rank]"}
_WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # kernels/cpu/lora.c's W_F32, W_BF16, W_F16


class _Geometry(ctypes.Structure):  # kernels/cpu/lora.c LoraGeom
    _fields_ = [("K", _I64), ("N", _I64), ("S", _I64), ("R", _I64), ("n_slots", _I64), ("slot_len", _I64),
                ("w_type", _I64), ("cols", _I64 * (MAX_SHARDS + 1))]


def _lib() -> ctypes.CDLL:
    global _declared
    if _declared is None:
        cdll = lib()
        cdll.duet_lora_packed_f32.restype = _INT
        cdll.duet_lora_packed_f32.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _INT, _INT]
        _declared = cdll
    return _declared


def _a_elems(rank: int, k: int) -> int:
    return (rank + 3) // 4 * ((k + 15) // 16) * 64


def _b_elems(rank: int, cols: int) -> int:
    return (cols + 15) // 16 * rank * 16


def pack_a(a: torch.Tensor) -> torch.Tensor:
    """A [r, K] as the layout's 4-row tiles of 16-wide k chunks, flat, zero padded (rows to 4, k to 16)."""
    r, k = a.shape
    kc = (k + 15) // 16
    tiles = a.new_zeros((r + 3) // 4 * 4, kc * 16)
    tiles[:r, :k] = a
    return tiles.reshape(-1, 4, kc, 16).permute(0, 2, 1, 3).reshape(-1)


def pack_b(b: torch.Tensor) -> torch.Tensor:
    """B [n, r] (PEFT's lora_B) as the layout's 16-column blocks in groups of 4 (the last group what is left), each
    group [r][its blocks][16], flat, columns zero padded to 16."""
    n, r = b.shape
    blocks = b.new_zeros(r, (n + 15) // 16 * 16)
    blocks[:, :n] = b.T
    blocks = blocks.reshape(r, -1, 16)
    return torch.cat([blocks[:, g:g + _GROUP].reshape(-1) for g in range(0, blocks.shape[1], _GROUP)])


class PackedLoraSlots:
    """``n_slots`` adapter slots of one projection (``in_features`` → the shards' columns) at rank <= ``max_rank``,
    stored in ``dtype``, packed for the C kernel. ``write`` fills a slot between steps; ``add_`` adds the step's
    deltas. The buffers are allocated once and written in place (a recorded step keeps their addresses)."""

    def __init__(self, n_slots: int, in_features: int, shard_sizes: list[int], max_rank: int,
                 dtype: torch.dtype = torch.float32) -> None:
        if dtype not in _WEIGHT_TYPES:
            raise TypeError(f"LoRA weights are stored as {', '.join(map(str, _WEIGHT_TYPES))}, not {dtype}")
        if not 1 <= len(shard_sizes) <= MAX_SHARDS or min(shard_sizes) < 0 or n_slots < 1 or max_rank < 1 \
                or in_features < 1:
            raise ValueError(f"a LoRA projection of {n_slots} slots, {in_features} inputs, shards {shard_sizes}, "
                             f"rank {max_rank}: 1 to {MAX_SHARDS} shards and positive sizes")
        self.shard_sizes, self.in_features, self.max_rank = list(shard_sizes), in_features, max_rank
        self.slot_len = sum(_a_elems(max_rank, in_features) + _b_elems(max_rank, n) for n in shard_sizes)
        self.w = torch.zeros(n_slots, self.slot_len, dtype=dtype)
        self.ranks = torch.zeros(n_slots, len(shard_sizes), dtype=torch.int64)
        cols = [sum(shard_sizes[:i]) for i in range(len(shard_sizes) + 1)]
        self._geometry = _Geometry(in_features, cols[-1], len(shard_sizes), max_rank, n_slots, self.slot_len,
                                   _WEIGHT_TYPES[dtype], (_I64 * (MAX_SHARDS + 1))(*cols))
        self._args = (ctypes.addressof(self._geometry), self.w.data_ptr(), self.ranks.data_ptr())

    @property
    def dtype(self) -> torch.dtype:
        return self.w.dtype

    @property
    def out_features(self) -> int:
        return self._geometry.N

    def write(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put one adapter in ``slot``: per shard (A [r, in], B [shard size, r]) or None (not targeted), rounded once
        to the storage dtype; whatever the slot held before is gone."""
        if len(shards) != len(self.shard_sizes):
            raise ValueError(f"{len(shards)} shards given for a projection of {len(self.shard_sizes)}")
        parts, ranks = [], []
        for size, ab in zip(self.shard_sizes, shards):
            if ab is None:
                ranks.append(0)
                continue
            a, b = ab
            r = a.shape[0]
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != self.in_features or b.shape != (size, r) \
                    or not 0 < r <= self.max_rank:
                raise ValueError(f"LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a projection of "
                                 f"{self.in_features} → {size} at rank <= {self.max_rank}")
            parts += [pack_a(a.to(self.dtype)), pack_b(b.to(self.dtype))]
            ranks.append(r)
        region = torch.zeros(self.slot_len, dtype=self.dtype)
        if parts:
            packed = torch.cat(parts)
            region[:packed.numel()] = packed
        self.w[slot].copy_(region)
        self.ranks[slot].copy_(torch.tensor(ranks, dtype=torch.int64))

    def add_(self, out: torch.Tensor, x: torch.Tensor, scaling: torch.Tensor, token_slots: torch.Tensor, *,
             isa: str | None = None) -> torch.Tensor:
        """``out`` [T, N] += each token's adapter delta, in place; returns ``out``. x [T, in] and out fp32 with unit
        column strides; ``scaling`` fp32 [slots]; ``token_slots`` int64 [T] (-1: the base alone)."""
        t = x.shape[0]
        if not (x.dtype == out.dtype == scaling.dtype == torch.float32 and token_slots.dtype == torch.int64
                and x.dim() == out.dim() == 2 and x.shape[1] == self.in_features and out.shape == (t, self.out_features)
                and (x.shape[1] <= 1 or x.stride(1) == 1) and (out.shape[1] <= 1 or out.stride(1) == 1)
                and token_slots.shape == (t,) and token_slots.is_contiguous() and scaling.shape == (self.w.shape[0],)
                and scaling.is_contiguous() and x.is_cpu and out.is_cpu and token_slots.is_cpu and scaling.is_cpu):
            raise ValueError(f"PackedLoraSlots.add_: out {tuple(out.shape)} {out.dtype}, x {tuple(x.shape)} {x.dtype}, "
                             f"scaling {tuple(scaling.shape)} {scaling.dtype}, token_slots {tuple(token_slots.shape)} "
                             f"{token_slots.dtype} do not fit {self.w.shape[0]} slots of {self.in_features} → "
                             f"{self.out_features} (CPU fp32 activations and scaling, int64 slots)")
        if t == 0 or self.out_features == 0:
            return out
        geometry, w, ranks = self._args
        rc = _lib().duet_lora_packed_f32(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), t, geometry, w,
                                         ranks, scaling.data_ptr(), token_slots.data_ptr(), isa_level(isa),
                                         torch.get_num_threads())
        if rc == 1:
            raise ValueError(f"token_slots must be in [-1, {self.w.shape[0]})")
        if rc:
            raise NativeKernelError(f"duet_lora_packed_f32: {_ERRORS.get(rc, rc)}")
        return out


def lora_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scaling: torch.Tensor,
             token_slots: torch.Tensor, shard_cols: torch.Tensor, *, isa: str | None = None) -> torch.Tensor:
    """``out`` [T, N] += each token's adapter delta, in place (kernels/lora.py ``lora_add``, the logical layout);
    returns ``out``. x / out fp32, a / bt fp32, bf16 or fp16. Packs every slot on every call (tests, one-off calls).
    ``isa``: scalar | avx2 | avx512 | vnni (avx512's kernels), None: kernels/cpu_quant_isa.py's default."""
    check_lora_args(out, x, a, bt, scaling, token_slots, shard_cols, (torch.float32,))
    if not all(t.is_cpu for t in (out, x, a, bt, scaling, token_slots, shard_cols)):
        raise ValueError("the C kernels take CPU tensors, got "
                         f"{[t.device.type for t in (out, x, a, bt, scaling, token_slots, shard_cols)]}")
    n_slots, sr, k = a.shape
    n, shards = out.shape[1], shard_cols.shape[0] - 1
    cols = shard_cols.tolist()
    if cols[0] != 0 or cols[-1] != n or any(hi < lo for lo, hi in zip(cols, cols[1:])) or shards > MAX_SHARDS:
        raise ValueError(f"shard_cols must rise from 0 to out's {n} columns in at most {MAX_SHARDS} shards, got {cols}")
    r = sr // shards
    slots = PackedLoraSlots(n_slots, k, [hi - lo for lo, hi in zip(cols, cols[1:])], r, a.dtype)
    for s in range(n_slots):
        slots.write(s, [(a[s, i * r:(i + 1) * r], bt[s, i * r:(i + 1) * r, lo:hi].T)
                        for i, (lo, hi) in enumerate(zip(cols, cols[1:]))])
    return slots.add_(out, x, scaling.float(), token_slots, isa=isa)
