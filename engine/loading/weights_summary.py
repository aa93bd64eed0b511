"""What a loaded model holds, as plain values (issue 48): per layer kind, the storage format of its weights, the
bytes resident, how many weight tensors, and the kernel that runs them; plus the totals against the checkpoint.

Torch-free: the worker announces it (``WorkerInfo.weights``), the router's ``ModelCard`` and ``WorkerDescriptor``
carry it, ``/v1/models`` lists it (the ``duet`` extension object), ``/metrics`` renders it
(``duet_weight_bytes``) and the dashboard draws it. engine/loading/resident.py computes it from the model's
objects once after load (the formats and bytes are what the tensors hold, the kernels what the backend calls).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# the layer kinds, in the order a summary lists them
KINDS = ("embedding", "attention qkv", "attention output", "mlp gate_up", "mlp down", "moe router", "experts",
         "norms", "lm_head", "other")


@dataclass(frozen=True)
class WeightGroup:
    """The weights of one layer kind held in one format and run by one kernel."""

    kind: str  # one of KINDS
    format: str  # e.g. "Q4_1 packed", "float32 dense", "float32 oneDNN-packed", "int8 w8a16"
    kernel: str  # what runs them, e.g. "C GEMV AVX2, fp32 activations", "oneDNN", "cuBLAS"
    num_bytes: int  # resident bytes counted here (a tensor shared with an earlier group is counted there)
    num_tensors: int  # the model's weight tensors (a packed weight is one, whatever arrays hold it; a bias one)
    shared_bytes: int = 0  # bytes these weights use that an earlier group counts (a tied LM head: the table's)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "format": self.format, "kernel": self.kernel, "bytes": self.num_bytes,
                "tensors": self.num_tensors, "shared_bytes": self.shared_bytes}


@dataclass(frozen=True)
class WeightsSummary:
    """One engine's (one tensor-parallel rank's) resident weights."""

    groups: tuple[WeightGroup, ...]
    kernels: str  # the kernel backend: cpu | torch | triton
    decode_graphs: str  # how decode steps run: "CUDA graphs, batch <= 16", "CPU recordings ...", "eager: <why>"
    checkpoint_bytes: int | None = None  # the checkpoint's tensor bytes (a GGUF file's tensor data), None: unknown

    @property
    def weight_bytes(self) -> int:
        return sum(g.num_bytes for g in self.groups)

    def to_json(self) -> dict[str, Any]:
        """The ``duet`` object of a ``/v1/models`` entry."""
        return {"weights": [g.to_json() for g in self.groups], "weight_bytes": self.weight_bytes,
                "checkpoint_bytes": self.checkpoint_bytes, "kernels": self.kernels,
                "decode_graphs": self.decode_graphs}

    def log_block(self, name: str) -> str:
        """A readable block for the worker's log: a headline with the totals, then one row per group."""
        ratio = ""
        if self.checkpoint_bytes:
            ratio = (f" (the checkpoint's tensors: {format_bytes(self.checkpoint_bytes)}, "
                     f"{self.weight_bytes / self.checkpoint_bytes:.2f}x)")
        head = (f"weights of {name}: {format_bytes(self.weight_bytes)} resident{ratio}; kernels {self.kernels}; "
                f"decode steps: {self.decode_graphs}")
        kind_w = max([len("kind")] + [len(g.kind) for g in self.groups])
        fmt_w = max([len("format")] + [len(g.format) for g in self.groups])
        rows = [f"  {'kind':<{kind_w}}  {'format':<{fmt_w}}  {'bytes':>10}  {'tensors':>7}  kernel"]
        for g in self.groups:
            shared = f" (+{format_bytes(g.shared_bytes)} shared)" if g.shared_bytes else ""
            rows.append(f"  {g.kind:<{kind_w}}  {g.format:<{fmt_w}}  {format_bytes(g.num_bytes):>10}  "
                        f"{g.num_tensors:>7}  {g.kernel}{shared}")
        return "\n".join([head, *rows])


def format_bytes(n: int) -> str:
    """``n`` bytes for a person: B, KiB, MiB or GiB with one decimal."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
