"""The batched LoRA shrink / expand over a per-token adapter slot, SGMV's semantics (Punica, S-LoRA):
``out[t] += scaling[s] * (x[t] @ A[s]^T) @ B[s]^T`` for every token ``t`` whose slot ``s`` is not -1 (-1: the base
model alone). The base GEMM that produced ``out`` is untouched; the delta is added in place.

Which code runs it: the model's kernel backend's ``KernelOps.lora_add`` where it has one (``cpu``: the C kernel of
kernels/cpu_lora.py; ``triton``: kernels/lora.py), given the step's slots as one [T] int64 tensor on the device and
doing the grouping itself, so nothing is grouped on the host; the ``torch`` backend (a bf16 model on a CPU, or
``kernels=torch``) runs the two torch forms below. ``LoraBatch`` is the step's view, built once per step and shared
by every linear:
- kernel: ``token_slots`` alone. A recorded CPU decode step (engine/decode_graphs.py) hands the kernels a static
  buffer instead (``LoraBatch.of_buffer``), refilled every step, so its slots are an input of the replay;
- torch, grouped: two small GEMMs per distinct adapter in the batch (shrink to the rank, expand to the output) on
  its tokens' rows, not one per token (kernels/lora.py ``add_groups_``, the reference's arithmetic);
- torch, masked (steps of at most ``MASKED_MAX_TOKENS`` tokens: decode): one shrink against every slot's ``A`` at
  once ([T, slots*S*R]), multiplied by a per-step mask that keeps each token's own slot's columns (times its
  scaling) and zeroes the rest, then one expand against every slot's ``B``: two GEMMs and a multiply per linear
  whatever the number of adapters, at the price of computing every slot.
A fused projection (q/k/v, gate/up) holds its shards' ``A`` stacked [S*R, in] and ``B`` block-diagonal, stored
transposed as ``Bt`` [S*R, out], so one shrink and one expand cover every shard (the torch forms multiply the zero
blocks, adding exactly 0; the kernels read the diagonal blocks only, told the shards' columns). The scaling is
applied to the rank-R intermediate (PEFT applies it after the expand: the same product, rounded apart).
Measured with ``make bench-lora`` (bench/engine/lora.py has the figures and where the time went).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import ConfigError
from kernels.lora import add_groups_

log = logging.getLogger(__name__)
MASKED_MAX_TOKENS = 64


@dataclass(frozen=True)
class LoraBatch:
    """One step's tokens by adapter slot. ``token_slots`` [T] int64 on the device: the kernels' input (None: the
    torch forms). ``groups`` = (slot, the rows of the step's tokens in that slot); ``token_scale`` [T, slots]: token
    t's scaling in its slot's column, 0 elsewhere (the masked torch form; None: grouped)."""
    groups: tuple[tuple[int, torch.Tensor], ...]
    token_scale: torch.Tensor | None = None
    token_slots: torch.Tensor | None = None

    @classmethod
    def from_token_slots(cls, token_slots: list[int], device: torch.device | str,
                         scaling: torch.Tensor | None = None, kernel: bool = False) -> LoraBatch:
        """``kernel``: the slots as one tensor for ``KernelOps.lora_add``. Else the torch forms: ``scaling`` [slots]
        (on ``device``) given, a step of at most MASKED_MAX_TOKENS tokens takes the masked form."""
        if kernel:
            if all(s < 0 for s in token_slots):
                return cls(())
            return cls((), token_slots=torch.tensor(token_slots, dtype=torch.int64, device=device))
        rows: dict[int, list[int]] = {}
        for t, s in enumerate(token_slots):
            if s >= 0:
                rows.setdefault(s, []).append(t)
        groups = tuple((s, torch.tensor(r, dtype=torch.long, device=device)) for s, r in sorted(rows.items()))
        if scaling is None or not rows or len(token_slots) > MASKED_MAX_TOKENS:
            return cls(groups)
        slots = torch.tensor(token_slots, dtype=torch.long, device=device)
        onehot = torch.zeros(len(token_slots), scaling.shape[0] + 1, dtype=scaling.dtype, device=device)
        onehot.scatter_(1, (slots % (scaling.shape[0] + 1))[:, None], 1.0)  # -1: the extra last column
        return cls(groups, onehot[:, :-1] * scaling)

    @classmethod
    def of_buffer(cls, token_slots: torch.Tensor) -> LoraBatch:
        """The kernels' batch over a static slots buffer, its values set by the caller before each run: never empty,
        so a recorded step holds its LoRA calls whatever the batch it was recorded on."""
        return cls((), token_slots=token_slots)

    def column_mask(self, per_slot: int) -> torch.Tensor:
        """[T, slots * per_slot]: each slot's column of ``token_scale`` repeated over its ``per_slot`` ranks."""
        return self.token_scale.repeat_interleave(per_slot, dim=1)

    @property
    def empty(self) -> bool:
        return not self.groups and self.token_slots is None


def lora_kernel(model) -> Callable | None:
    """The model's kernel backend's ``lora_add`` (None: the torch forms of this module, said once here)."""
    kernel = model.ops.lora_add
    if kernel is None:
        log.info("LoRA shrink / expand: the torch forms (the %s kernel backend has no LoRA kernel)", model.ops.name)
    return kernel


def weight_dtype(lora_dtype: str, model_dtype: torch.dtype, kernel: Callable | None) -> torch.dtype:
    """The slots' storage dtype for EngineConfig.lora_dtype: "auto" the model's; another one needs a kernel (they
    widen the weights on load; the torch forms multiply in the model's dtype)."""
    if lora_dtype == "auto":
        return model_dtype
    dtype = getattr(torch, lora_dtype)
    if dtype != model_dtype and kernel is None:
        raise ConfigError(f"lora_dtype {lora_dtype} on a {str(model_dtype).removeprefix('torch.')} model needs a "
                          "LoRA kernel (the cpu or triton kernel backend), not the torch forms")
    return dtype


def lora_add_(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scaling,
              batch: LoraBatch, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The torch forms. out: [T, N] the base output, updated in place; x: [T, K]; a: [slots, R, K]; bt: [slots, R,
    N]; scaling: per slot; ``mask``: ``batch.column_mask(R)`` for the masked form (None: grouped). Returns ``out``."""
    if mask is not None:
        n, r, k = a.shape
        h = torch.mm(x, a.reshape(n * r, k).T).mul_(mask)
        return out.addmm_(h, bt.reshape(n * r, bt.shape[2]))
    return add_groups_(out, x, a, bt, scaling, batch.groups)
