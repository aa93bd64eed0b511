"""Exceptions raised by kvtransfer.

Every failure of a KV move is an explicit exception, never a silent fallback: the caller (the decode
worker) decides between recomputing locally and failing the request, and counts it. All of them derive
from `KVTransferError`, so a caller that only wants "did the transfer happen" catches one type.
"""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """A KV block transfer did not complete.

    `local_blocks_safe` tells the owner whether the destination blocks may be reused at once. It is
    False only when a timed-out transfer could not be cancelled: NIXL may still write into those blocks,
    so the owner must keep them out of its free list (the transport retries the release on `close()`).
    """

    def __init__(self, message: str, *, local_blocks_safe: bool = True) -> None:
        super().__init__(message)
        self.local_blocks_safe = local_blocks_safe


class KVTimeoutError(KVTransferError):
    """The transfer was still in progress when its deadline passed."""


class KVCompatError(KVTransferError):
    """Handshake refused: the peer speaks another protocol version or has an incompatible KV layout
    (model, dtype, layout name, block size, layer/head geometry)."""


class KVBlockIdError(KVTransferError, ValueError):
    """Block ids rejected before anything was posted: out of range, duplicated, or mismatched lengths."""


class KVConfigError(KVTransferError):
    """The local transport could not be set up (cache tensor shape, NIXL/UCX backend creation)."""
