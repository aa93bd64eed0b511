"""The batched LoRA shrink / expand over a per-token adapter slot, SGMV's semantics (Punica, S-LoRA), in torch:
``out[t] += scaling[s] * (x[t] @ A[s]^T) @ B[s]^T`` for every token ``t`` whose slot ``s`` is not -1 (-1: the base
model alone). The base GEMM that produced ``out`` is untouched; the delta is added in place.

The step's tokens are grouped once by slot (``LoraBatch``, shared by every linear of the step). Two forms:
- grouped: two small GEMMs per distinct adapter in the batch (shrink to the rank, expand to the output) on its
  tokens' rows, not one per token;
- masked (steps of at most ``MASKED_MAX_TOKENS`` tokens: decode): one shrink against every slot's ``A`` at once
  ([T, slots*S*R]), multiplied by a per-step mask that keeps each token's own slot's columns (times its scaling) and
  zeroes the rest, then one expand against every slot's ``B``: two GEMMs and a multiply per linear whatever the
  number of adapters, at the price of computing every slot (cheap at decode's few rows). Measured with
  ``make bench-lora`` (bench/engine/lora.py has the figures).
A fused projection (q/k/v, gate/up) holds its shards' ``A`` stacked [S*R, in] and ``B`` block-diagonal, stored
transposed as ``Bt`` [S*R, out], so one shrink and one expand cover every shard (a zero block adds exactly 0). The
scaling is applied to the rank-R intermediate (PEFT applies it after the expand: the same product, rounded apart).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MASKED_MAX_TOKENS = 64


@dataclass(frozen=True)
class LoraBatch:
    """One step's tokens grouped by adapter slot: ``groups`` = (slot, the rows of the step's tokens in that slot);
    ``token_scale`` [T, slots]: token t's scaling in its slot's column, 0 elsewhere (the masked form; None: grouped)."""
    groups: tuple[tuple[int, torch.Tensor], ...]
    token_scale: torch.Tensor | None = None

    @classmethod
    def from_token_slots(cls, token_slots: list[int], device: torch.device | str,
                         scaling: torch.Tensor | None = None) -> LoraBatch:
        """``scaling`` [slots] (on ``device``): given, a step of at most MASKED_MAX_TOKENS tokens takes the masked
        form."""
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

    def column_mask(self, per_slot: int) -> torch.Tensor:
        """[T, slots * per_slot]: each slot's column of ``token_scale`` repeated over its ``per_slot`` ranks."""
        return self.token_scale.repeat_interleave(per_slot, dim=1)

    @property
    def empty(self) -> bool:
        return not self.groups


def lora_add_(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scaling,
              batch: LoraBatch, mask: torch.Tensor | None = None) -> torch.Tensor:
    """out: [T, N] the base output, updated in place; x: [T, K]; a: [slots, R, K]; bt: [slots, R, N]; scaling: per
    slot; ``mask``: ``batch.column_mask(R)`` for the masked form (None: grouped). Returns ``out``."""
    if mask is not None:
        n, r, k = a.shape
        h = torch.mm(x, a.reshape(n * r, k).T).mul_(mask)
        return out.addmm_(h, bt.reshape(n * r, bt.shape[2]))
    for slot, rows in batch.groups:
        h = (x.index_select(0, rows) @ a[slot].T) * scaling[slot]
        out.index_add_(0, rows, h @ bt[slot])
    return out
