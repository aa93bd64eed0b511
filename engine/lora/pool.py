"""LoraPool: the adapters' weights on the model's device, ``max_loras`` slots of rank up to ``max_lora_rank`` in
every projection of the dense decoder layers (q/k/v, o, gate/up, down), and the step's ``LoraBatch``.

Each such ``Linear`` gets a ``LoraWeights`` (``Linear.lora``) holding its S shards' (1 unless fused) slots in one of
two layouts:
- the kernel backend's own (``KernelOps.lora_slots``; the ``cpu`` backend's kernels/cpu_lora.py
  ``PackedLoraSlots``): each slot packed at its adapter's own rank, nothing stored for a shard the adapter does not
  target, so an adapter costs its own bytes;
- else the logical one for ``KernelOps.lora_add`` (Triton) and the torch forms: ``a`` [max_loras, S*R, in] and
  ``bt`` [max_loras, S*R, out] (B transposed) at R = ``max_lora_rank``, zero where an adapter has a smaller rank or
  does not target a shard, so an adapter of rank r < R costs the same as one of rank R.
Loading an adapter writes its slot (the previous occupant's values overwritten, the rest zeroed); the base weights
are never touched. The model runner sets the step's token slots (``set_batch``) before the forward pass. Which
adapter is in which slot, and when one is written, is engine/lora/manager.py's (between steps, on the engine
thread).

Tensor parallelism (vLLM's split): each rank holds its part of a slot, cut as the base weight is (``Linear.tp_split``):
a column-parallel projection (q/k/v, gate/up) the rows of B its output columns are, with A whole; a row-parallel one
(o, down) the columns of A its input features are, with B whole, so its delta is a partial sum like the base output
and the projection's all-reduce adds the ranks' (``Linear.forward`` adds the delta before it). Rank 0's manager decides
what goes where; once the other ranks follow its steps (``mirror``), each ``write`` / ``clear`` is sent to them
(``TensorParallel.send``) and the step's token slots travel with the step (engine/model_runner.py).
"""
from __future__ import annotations

import logging

import torch

from engine.errors import LoraAdapterError
from engine.lora.adapter import LoraAdapter, LoraShard
from engine.lora.ops import LoraBatch, lora_add_, lora_kernel, weight_dtype
from engine.models.layers import Linear

log = logging.getLogger(__name__)
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class LoraWeights:
    """One linear's slots. ``add_(x, out)`` adds the step's adapters' deltas to the base output ``out``."""

    def __init__(self, pool: LoraPool, in_features: int, shard_sizes: list[int], dtype, device,
                 tp_split: tuple | None = None) -> None:
        self.pool = pool
        self.shard_sizes, self.in_features = shard_sizes, in_features
        self.tp_split = tp_split  # the base weight's (dim, splits) under tensor parallelism (Linear.tp_split)
        n, r, out = pool.max_loras, pool.max_lora_rank, sum(shard_sizes)
        self.slots = None  # the kernel backend's layout (KernelOps.lora_slots), or None: a / bt below
        factory = getattr(pool, "slots_factory", None)
        if factory is not None:
            self.slots = factory(n, in_features, shard_sizes, r, dtype)
            return
        self.a = torch.zeros(n, len(shard_sizes) * r, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(n, len(shard_sizes) * r, out, dtype=dtype, device=device)
        # the shards' column offsets in the output, for the kernels (they read bt's diagonal blocks only)
        self.shard_cols = torch.tensor([sum(shard_sizes[:i]) for i in range(len(shard_sizes) + 1)], dtype=torch.int64,
                                       device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.slots.dtype if self.slots is not None else self.a.dtype

    def write(self, slot: int, shards: dict) -> None:
        parts = [shards.get(s if len(self.shard_sizes) > 1 else None) for s in range(len(self.shard_sizes))]
        parts = [w if w is None or self.tp_split is None else self._local(s, w) for s, w in enumerate(parts)]
        for s, (size, w) in enumerate(zip(self.shard_sizes, parts)):
            if w is not None and (w.b.shape[0] != size or w.a.shape[1] != self.in_features):
                raise LoraAdapterError(f"LoRA shard {s}: A {tuple(w.a.shape)} / B {tuple(w.b.shape)} do not fit "
                                       f"a projection of {self.in_features} → {size}")
        if self.slots is not None:
            self.slots.write(slot, [None if w is None else (w.a, w.b) for w in parts])
            return
        self.a[slot].zero_()
        self.bt[slot].zero_()
        r_max, row0 = self.pool.max_lora_rank, 0
        for s, (size, w) in enumerate(zip(self.shard_sizes, parts)):
            if w is not None:
                r = w.a.shape[0]
                self.a[slot, s * r_max:s * r_max + r] = w.a
                self.bt[slot, s * r_max:s * r_max + r, row0:row0 + size] = w.b.T
            row0 += size

    def _local(self, s: int, w: LoraShard) -> LoraShard:
        """This rank's part of shard ``s``: B's rows of a column-parallel projection, A's columns of a row-parallel
        one (engine/models/tensor_parallel.py ``Split``)."""
        dim, splits = self.tp_split
        split = splits[s] if dim == 0 else splits[0]
        full = w.b.shape[0] if dim == 0 else w.a.shape[1]
        if full != split.total:
            raise LoraAdapterError(f"LoRA shard {s}: A {tuple(w.a.shape)} / B {tuple(w.b.shape)} do not fit a "
                                   f"projection of {split.total} {'outputs' if dim == 0 else 'inputs'}")
        if dim == 0:
            return LoraShard(w.a, split.narrow(w.b, 0).contiguous())
        return LoraShard(split.narrow(w.a, 1).contiguous(), w.b)

    def add_(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        batch = self.pool.batch
        if batch is None or batch.empty:
            return out
        if self.slots is not None:
            return self.slots.add_(out, x, self.pool.scaling, batch.token_slots)
        if batch.token_slots is not None:  # the kernel backend's (engine/lora/ops.py)
            return self.pool.kernel(out, x, self.a, self.bt, self.pool.scaling, batch.token_slots, self.shard_cols)
        mask = None if batch.token_scale is None else self.pool.column_mask(batch, self.a.shape[1])
        return lora_add_(out, x, self.a, self.bt, self.pool.scaling, batch, mask)


class LoraPool:
    def __init__(self, model, max_loras: int, max_lora_rank: int, dtype: torch.dtype, device,
                 lora_dtype: str = "auto") -> None:
        self.model, self.max_loras, self.max_lora_rank = model, max_loras, max_lora_rank
        self.num_layers = len(model.layers)
        self.scaling = torch.zeros(max_loras, dtype=dtype, device=device)
        self.batch: LoraBatch | None = None
        self.kernel = lora_kernel(model)  # KernelOps.lora_add, or None: the torch forms
        self.slots_factory = model.ops.lora_slots  # the kernel's own layout of the slots, or None: a / bt
        weights = weight_dtype(lora_dtype, dtype, self.kernel)  # the slots' storage (EngineConfig.lora_dtype)
        self._masks: dict[int, torch.Tensor] = {}  # the step's column masks by ranks per slot (S*R)
        self.device = device
        tp = getattr(model, "tp", None)
        self.tp = tp if tp is not None and tp.enabled else None
        self.mirror = False  # rank 0, once the other ranks follow its steps: writes are sent to them
        self.linears: dict[tuple[int, str], Linear] = {}  # (layer, projection) -> the Linear that takes a delta
        for i, layer in enumerate(model.layers):
            for name in LINEARS:
                lin = _linear(layer, name)
                if lin is None:  # a mixture-of-experts layer's MLP: experts, no gate_up_proj / down_proj
                    continue
                lin.lora = LoraWeights(self, lin.in_features, lin.shards or [lin.out_features], weights, device,
                                       getattr(lin, "tp_split", None) if self.tp is not None else None)
                self.linears[(i, name)] = lin
        log.info("LoRA pool: %d slots of rank <= %d on %d linears", max_loras, max_lora_rank, len(self.linears))

    def check(self, adapter: LoraAdapter) -> None:
        """Refuse an adapter this pool cannot hold (its rank, or a layer the base lacks)."""
        if adapter.rank > self.max_lora_rank:
            raise LoraAdapterError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank} > max_lora_rank "
                                   f"{self.max_lora_rank}")
        last = max(layer for layer, _ in adapter.weights)
        if last >= self.num_layers:
            raise LoraAdapterError(f"LoRA adapter {adapter.name!r} names layer {last}; the base has {self.num_layers}")
        experts = sorted(key for key in adapter.weights if key not in self.linears)
        if experts:
            layer, name = experts[0]
            raise LoraAdapterError(f"LoRA adapter {adapter.name!r} has weights for {name} of layer {layer}, a "
                                   "mixture-of-experts layer (LoRA on experts is not implemented; on its attention "
                                   "projections and on dense layers it is)")

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` in ``slot`` of every linear (zero where it has no weights); on every rank when mirrored."""
        self.check(adapter)
        if self.mirror:
            self.tp.send(("lora_write", (slot, adapter)))
        for key, lin in self.linears.items():
            lin.lora.write(slot, adapter.weights.get(key, {}))
        self.scaling[slot] = adapter.scaling

    def clear(self, slot: int) -> None:
        """``slot`` holds nothing now: its scaling is 0, so the masked form adds exactly 0 for it (its weights stay
        until the next ``write``; no token names a free slot)."""
        if self.mirror:
            self.tp.send(("lora_clear", slot))
        self.scaling[slot] = 0.0

    def set_batch(self, token_slots: list[int] | None) -> None:
        """The step's slot per token (-1: base only); None or all -1: no LoRA work this step."""
        self.batch = None if token_slots is None else LoraBatch.from_token_slots(
            token_slots, self.device, self.scaling, kernel=self.kernel is not None)
        self._masks = {}

    def column_mask(self, batch: LoraBatch, per_slot: int) -> torch.Tensor:
        """The step's mask for linears of ``per_slot`` ranks per slot, built once per step for all of them."""
        if per_slot not in self._masks:
            self._masks[per_slot] = batch.column_mask(per_slot)
        return self._masks[per_slot]


def _linear(layer, name: str):
    """The ``Linear`` at ``name`` in ``layer``, or None (a sparse MoE layer's MLP has no such projection)."""
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None
