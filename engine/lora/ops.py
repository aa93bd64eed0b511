"""The batched LoRA shrink / expand over a per-token adapter slot, SGMV's semantics (Punica, S-LoRA), in torch:
``out[t] += scaling[s] * (x[t] @ A[s]^T) @ B[s]^T`` for every token ``t`` whose slot ``s`` is not -1 (-1: the base
model alone). The base GEMM that produced ``out`` is untouched; the delta is added in place.

The step's tokens are grouped once by slot (``LoraBatch``, shared by every linear of the step), so each linear runs
two small GEMMs per distinct adapter in the batch (shrink to the rank, expand to the output), not one per token.
A fused projection (q/k/v, gate/up) holds its shards' ``A`` stacked [S*R, in] and ``B`` block-diagonal
[out, S*R], so one shrink and one expand cover every shard (a zero block adds exactly 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraBatch:
    """One step's tokens grouped by adapter slot: ``groups`` = (slot, the rows of the step's tokens in that slot)."""
    groups: tuple[tuple[int, torch.Tensor], ...]

    @classmethod
    def from_token_slots(cls, token_slots: list[int], device: torch.device | str) -> LoraBatch:
        rows: dict[int, list[int]] = {}
        for t, s in enumerate(token_slots):
            if s >= 0:
                rows.setdefault(s, []).append(t)
        return cls(tuple((s, torch.tensor(r, dtype=torch.long, device=device)) for s, r in sorted(rows.items())))

    @property
    def empty(self) -> bool:
        return not self.groups


def lora_add_(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor | list,
              batch: LoraBatch) -> torch.Tensor:
    """out: [T, N] the base output, updated in place; x: [T, K]; a: [slots, R, K]; b: [slots, N, R];
    scaling: per slot. Returns ``out``."""
    for slot, rows in batch.groups:
        xs = x.index_select(0, rows)
        delta = (xs @ a[slot].T) @ b[slot].T
        out.index_add_(0, rows, delta * scaling[slot])
    return out
