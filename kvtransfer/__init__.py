"""kvtransfer: moving paged KV-cache blocks between worker processes over NIXL.

Pieces (each module's docstring is its design note):
- layout.py          KVCompat / KVLayout, protocol VERSION, block ids -> merged byte runs (pure)
- wire.py            typed values that cross processes: PeerInfo, TransferRequest, ReleaseNotice (pure)
- leases.py          LeaseTable: blocks pinned on the owner until the puller's notice or a timeout (pure)
- nixl_transport.py  NixlTransport: one NIXL agent per worker, registered cache, pull by READ
- nixl_agent.py      creating a NIXL agent and naming memory for it
- tp_split.py        handoffs between workers of different tensor-parallel splits: which heads come from which rank
- split_reader.py    reading a handoff from a worker of another tensor-parallel split
- convert_reader.py  reading a handoff from a worker of another KV dtype: model-dtype blocks quantized, or quantized ones dequantized, on the pull
- errors.py          KVTransferError and its subclasses

Sits low in the dependency DAG: imports only torch, nixl, numpy and the stdlib, never the rest of duet.
`NixlTransport` is imported lazily so that bookkeeping users (block pool, tests) do not load torch/nixl.
"""

from kvtransfer.errors import KVBlockIdError, KVCompatError, KVConfigError, KVTimeoutError, KVTransferError
from kvtransfer.layout import BLOCK_MAJOR, VERSION, BlockRun, KVCompat, KVLayout, merge_block_runs
from kvtransfer.leases import Lease, LeaseCounters, LeaseTable
from kvtransfer.wire import PeerInfo, PeerMessage, ReleaseNotice, TransferRequest, TransferResult

__all__ = [
    "BLOCK_MAJOR",
    "VERSION",
    "BlockRun",
    "KVBlockIdError",
    "KVCompat",
    "KVCompatError",
    "KVConfigError",
    "KVLayout",
    "KVTimeoutError",
    "KVTransferError",
    "Lease",
    "LeaseCounters",
    "LeaseTable",
    "NixlTransport",
    "PeerInfo",
    "PeerMessage",
    "ReleaseNotice",
    "TransferRequest",
    "TransferResult",
    "merge_block_runs",
]


def __getattr__(name: str):
    if name == "NixlTransport":
        from kvtransfer.nixl_transport import NixlTransport

        return NixlTransport
    raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
