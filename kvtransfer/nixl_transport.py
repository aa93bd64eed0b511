"""NIXL transport: one agent per worker process, one registered cache tensor, pull by READ.

Lifecycle
- `NixlTransport(kv, compat)` creates a NIXL agent with the UCX backend and registers the whole cache
  tensor ONCE (DRAM for a CPU tensor, VRAM for a CUDA tensor; the memory type and device id come from
  `kv.device`). Registration is the expensive part (pinning / IPC handles), so it never happens per
  request. The tensor must outlive the transport: NIXL holds raw addresses.
- `peer_info()` is the worker's published identity: agent metadata bytes + base address + `KVLayout`
  + protocol `VERSION`. The cluster carries it (Ray) to the other pool.
- `add_peer(peer_info)` is the handshake on the pulling side: refuse (`KVCompatError`) unless VERSION,
  compat hash and bytes per block agree, then load the peer's metadata into our agent and open the
  connection eagerly, so the first pull of a request does not pay the connection wire-up.
  The owner side never needs the puller's metadata: NIXL delivers a READ's notification to the target.
- `read_blocks(peer, remote_ids, local_ids, notif=...)` validates ids against both layouts BEFORE
  posting (out of range / duplicates -> `KVBlockIdError`), merges (remote, local) pairs into contiguous
  runs (one descriptor per run, see layout.merge_block_runs), posts one NIXL READ carrying `notif`,
  and polls until DONE, ERR (-> `KVTransferError`) or the deadline (-> `KVTimeoutError`, after trying
  to cancel). NIXL delivers `notif` to the owner only after the data has landed, which is what makes
  "release the lease on notification" safe. `pull(TransferRequest)` wraps it with the lease protocol:
  ok notice on success; on failure a standalone fail notice (best effort: the peer may be dead).

Pull (READ) vs push (WRITE) — measured with bench/kv/transfer.py: 64 MiB as 256 blocks of
256 KiB, two processes on one host (2 vCPUs shared with other jobs, so runs vary 2x), READ, WRITE and
an in-process torch copy of the same runs interleaved in one run, median of 10:
    UCX defaults (cma for get/put): READ 1.3-5.2 GB/s, WRITE 1.3-4.6 GB/s, READ/WRITE 0.93-1.12
    UCX_TLS=tcp:                    READ 0.5-0.9 GB/s, WRITE 0.9-1.7 GB/s, READ/WRITE 0.55-0.71
On a host (cma, like RDMA, is one-sided) the direction does not matter; over plain TCP a READ is
emulated by UCX as request + reply served by the owner's progress thread and is ~1.5x slower. We
pull anyway, because the protocol matters more than the wire: the decode side allocates when it is
ready, skips the blocks its own prefix cache already has, and needs no round trip telling the
prefill side where to write (push needs the destination block ids before it can start, one more hop
on the TTFT path); the owner only holds a lease. Same choice as vLLM's NixlConnector. Revisit with
numbers if a deployment runs KV over TCP between nodes. `write_blocks` stays for that comparison.

UCX environment (nixl 1.5.1's bundled UCX): unset `UCX_TLS` (= all) works and is fastest here
(cma zero-copy for get/put, tcp/lo for notifications); `tcp` alone, or `tcp,self,sm`, work at a third to
half the bandwidth; `sm,self` fails at agent creation ("no active messages transport ... no peer
failure handler"): NIXL's UCX backend needs an AM transport with peer-failure handling (tcp or RDMA).
We leave UCX's defaults alone (an explicit list would also drop cuda_ipc / rc on GPU hosts) and turn
a backend-creation failure into a `KVConfigError` naming the UCX_TLS in effect. What we DO change is
the progress thread's poll delay (see `_create_agent`): nixl's default spins a core per worker.

Threading: one thread owns a transport (NIXL agents are created in the no-sync mode); the agent's
own progress thread serves peers' READs of our memory (needed over TCP, and for connection setup)
without us polling. CUDA: the owner must have finished writing a block (stream synchronized) before
it publishes the handoff; a READ into VRAM is complete when `read_blocks` returns.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence

import numpy as np
import torch

from kvtransfer.errors import KVBlockIdError, KVCompatError, KVConfigError, KVTimeoutError, KVTransferError
from kvtransfer.layout import VERSION, KVCompat, KVLayout, merge_block_runs, run_byte_ranges, validate_block_ids
from kvtransfer.nixl_agent import DEFAULT_PROGRESS_DELAY_US, _create_agent, _memory_location, _ucx_env_summary
from kvtransfer.wire import PeerInfo, PeerMessage, ReleaseNotice, TransferRequest, TransferResult

logger = logging.getLogger(__name__)

DEFAULT_TRANSFER_TIMEOUT_S = 30.0  # keep below the owner's lease timeout (leases.DEFAULT_LEASE_TIMEOUT_S)
_MAX_POLL_SLEEP_S = 1e-3


def _split_regions(peer: PeerInfo, remote_block_ids: Sequence[int], local_block_ids: Sequence[int]):
    """The (remote id, local id) pairs grouped by the peer's memory region they read from: its cache (ids below
    ``layout.num_blocks``) and its host tier (the ids after, as slot numbers). Each group is
    ``(base address, mem type, device id, remote ids, local ids)``; empty groups are left out."""
    n = peer.layout.num_blocks
    cache = [(r, l) for r, l in zip(remote_block_ids, local_block_ids) if r < n]
    host = [(r - n, l) for r, l in zip(remote_block_ids, local_block_ids) if r >= n]
    groups = []
    for pairs, base, mem, dev in ((cache, peer.base_addr, peer.mem_type, peer.device_id),
                                  (host, peer.host_base_addr, "DRAM", 0)):
        if pairs:
            groups.append((base, mem, dev, tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)))
    return groups


class NixlTransport:
    """This worker's NIXL agent and registered KV cache; pulls blocks from added peers."""

    def __init__(
        self,
        kv: torch.Tensor,
        compat: KVCompat,
        *,
        agent_name: str | None = None,
        backends: Sequence[str] = ("UCX",),
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
        host: torch.Tensor | None = None,
    ) -> None:
        self.layout = KVLayout.from_tensor(kv, compat)
        self._host = None  # the host KV tier, registered too so peers can READ its slots (never written)
        if host is not None:
            host_layout = KVLayout.from_tensor(host, compat)
            if host.device.type != "cpu" or host_layout.bytes_per_block != self.layout.bytes_per_block:
                raise KVConfigError("the host tier must be a host tensor with the cache's block size in bytes")
            self._host = host
        self.agent_name = agent_name or f"duet-kv-{uuid.uuid4().hex[:12]}"
        self._kv = kv  # keeps the registered memory alive
        self._mem_type, self._device_id = _memory_location(kv.device)
        self._base_addr = kv.data_ptr()
        try:
            self._agent = _create_agent(self.agent_name, list(backends), progress_delay_us)
        except Exception as exc:  # nixl raises its own binding exception types
            raise KVConfigError(
                f"cannot create NIXL agent {self.agent_name!r} with backends {list(backends)}"
                f" ({_ucx_env_summary()}; NIXL's UCX backend needs tcp or an RDMA transport, and "
                f"cuda_copy too where NVIDIA GPUs are present): {exc}"
            ) from exc
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise KVConfigError(f"NIXL backends {missing} unavailable; plugins: {self._agent.get_plugin_list()}")
        region = [(self._base_addr, self.layout.total_bytes, self._device_id, "")]
        self._registration = self._agent.register_memory(region, self._mem_type)
        self._host_registration = None
        if self._host is not None:
            host_region = [(self._host.data_ptr(), self._host.numel() * self._host.element_size(), 0, "")]
            self._host_registration = self._agent.register_memory(host_region, "DRAM")
        self._peers: dict[str, PeerInfo] = {}
        self._stuck_handles: list = []  # timed-out transfers NIXL refused to cancel
        self._closed = False
        logger.info(
            "kv transport %s: %d blocks x %d B registered as %s:%d",
            self.agent_name, self.layout.num_blocks, self.layout.bytes_per_block,
            self._mem_type, self._device_id,
        )

    # ----------------------------------------------------------------- handshake
    def peer_info(self) -> PeerInfo:
        return PeerInfo(
            version=VERSION,
            agent_name=self.agent_name,
            agent_metadata=self._agent.get_agent_metadata(),
            layout=self.layout,
            base_addr=self._base_addr,
            mem_type=self._mem_type,
            device_id=self._device_id,
            host_base_addr=self._host.data_ptr() if self._host is not None else 0,
            host_num_blocks=int(self._host.shape[0]) if self._host is not None else 0,
        )

    def add_peer(self, peer: PeerInfo, *, connect: bool = True) -> str:
        """Check compatibility, load the peer's NIXL metadata; returns the peer's name."""
        if peer.version != VERSION:
            raise KVCompatError(
                f"peer {peer.agent_name!r} speaks kvtransfer protocol v{peer.version}, we speak v{VERSION}"
            )
        ours, theirs = self.layout, peer.layout
        if theirs.compat_hash() != ours.compat_hash():
            raise KVCompatError(
                f"peer {peer.agent_name!r} has an incompatible KV layout (compat hash"
                f" {theirs.compat_hash()} != ours {ours.compat_hash()}): ours != theirs: "
                + "; ".join(ours.compat.diff(theirs.compat))
            )
        if theirs.bytes_per_block != ours.bytes_per_block:
            raise KVCompatError(
                f"peer {peer.agent_name!r} has {theirs.bytes_per_block} B per block, we have {ours.bytes_per_block}"
            )
        name = self._agent.add_remote_agent(peer.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != peer.agent_name:
            raise KVCompatError(f"peer metadata names agent {name!r}, PeerInfo says {peer.agent_name!r}")
        if connect:
            try:
                self._agent.make_connection(name)
            except Exception as exc:
                self._agent.remove_remote_agent(name)
                raise KVTransferError(f"cannot connect to peer {name!r}: {exc}") from exc
        self._peers[name] = peer
        return name

    def remove_peer(self, peer_name: str) -> None:
        if self._peers.pop(peer_name, None) is not None:
            self._agent.remove_remote_agent(peer_name)

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def has_peer(self, peer_name: str) -> bool:
        return peer_name in self._peers

    def peer_names(self) -> tuple[str, ...]:
        return tuple(self._peers)

    # ----------------------------------------------------------------- transfers
    def pull(self, request: TransferRequest, *, timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S) -> TransferResult:
        """READ the request's blocks, releasing the owner's lease on success or failure."""
        try:
            return self.read_blocks(
                request.peer_name, request.remote_block_ids, request.local_block_ids,
                notif=ReleaseNotice(request.lease_id, ok=True).encode(), timeout_s=timeout_s,
            )
        except KVTransferError:
            self._try_notify(request.peer_name, ReleaseNotice(request.lease_id, ok=False).encode())
            raise

    def read_blocks(
        self,
        peer_name: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        *,
        notif: bytes = b"",
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    ) -> TransferResult:
        """Copy the peer's `remote_block_ids[i]` into our `local_block_ids[i]`; blocks until done."""
        return self._transfer("READ", peer_name, remote_block_ids, local_block_ids, notif, timeout_s)

    def write_blocks(
        self,
        peer_name: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        *,
        notif: bytes = b"",
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    ) -> TransferResult:
        """Push: copy our `local_block_ids[i]` into the peer's `remote_block_ids[i]` (see module doc)."""
        return self._transfer("WRITE", peer_name, remote_block_ids, local_block_ids, notif, timeout_s)

    def _transfer(
        self,
        op: str,
        peer_name: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        notif: bytes,
        timeout_s: float,
    ) -> TransferResult:
        self._check_open()
        peer = self._peers.get(peer_name)
        if peer is None:
            raise KVTransferError(f"unknown peer {peer_name!r}: call add_peer(peer_info) first")
        if len(remote_block_ids) != len(local_block_ids):
            raise KVBlockIdError(f"{len(remote_block_ids)} remote block ids but {len(local_block_ids)} local block ids")
        readable = peer.num_readable_blocks if op == "READ" else peer.layout.num_blocks
        validate_block_ids(remote_block_ids, readable, f"remote ({peer_name})")
        validate_block_ids(local_block_ids, self.layout.num_blocks, "local")
        start_s = time.monotonic()
        regions = _split_regions(peer, remote_block_ids, local_block_ids)
        if not regions:  # nothing to move (e.g. all prefix hits): the owner still needs its notice
            if notif:
                try:
                    self._agent.send_notif(peer_name, notif)
                except Exception as exc:
                    raise KVTransferError(f"cannot notify {peer_name!r}: {exc}") from exc
            return TransferResult(0, 0, 0, time.monotonic() - start_s)
        bpb = self.layout.bytes_per_block
        num_runs = 0
        for i, (base_addr, mem_type, device_id, remote_ids, local_ids) in enumerate(regions):
            runs = merge_block_runs(remote_ids, local_ids)
            num_runs += len(runs)
            last = i == len(regions) - 1  # the notice rides on the last READ: sent once everything landed
            handle, state = self._post(op, peer_name, runs, base_addr, mem_type, device_id, notif if last else b"")
            self._wait(handle, state, op, peer_name, start_s + timeout_s)
        num_blocks = len(local_block_ids)
        return TransferResult(num_blocks, num_runs, num_blocks * bpb, time.monotonic() - start_s)

    def _post(self, op: str, peer_name: str, runs, remote_base: int, remote_mem: str, remote_device: int,
              notif: bytes):
        """Prepare and post one transfer of ``runs``; returns (handle, state)."""
        bpb = self.layout.bytes_per_block
        local = self._descs(run_byte_ranges(runs, self._base_addr, bpb, remote=False), self._mem_type, self._device_id)
        remote = self._descs(run_byte_ranges(runs, remote_base, bpb, remote=True), remote_mem, remote_device)
        try:
            handle = self._agent.initialize_xfer(op, local, remote, peer_name, notif)
        except Exception as exc:  # NIXL rejects descriptors outside registered memory, unknown agents, ...
            raise KVTransferError(f"{op} with {peer_name!r} could not be prepared: {exc}") from exc
        try:
            return handle, self._agent.transfer(handle)
        except Exception as exc:  # e.g. NIXL_ERR_REMOTE_DISCONNECT when the peer died
            safe = self._abort(handle)
            raise KVTransferError(f"{op} with {peer_name!r} could not be posted: {exc}", local_blocks_safe=safe) from exc

    def _descs(self, ranges: list[tuple[int, int]], mem_type: str, device_id: int):
        array = np.array([(addr, length, device_id) for addr, length in ranges], dtype=np.uint64)
        return self._agent.get_xfer_descs(array, mem_type)

    def _wait(self, handle, state: str, op: str, peer_name: str, deadline_s: float) -> None:
        sleep_s = 0.0
        while state == "PROC":
            if time.monotonic() >= deadline_s:
                safe = self._abort(handle)
                raise KVTimeoutError(
                    f"{op} with {peer_name!r} still in progress at its deadline"
                    + ("" if safe else "; NIXL could not cancel it, destination blocks may still change"),
                    local_blocks_safe=safe,
                )
            time.sleep(sleep_s)
            sleep_s = min(max(2 * sleep_s, 1e-5), _MAX_POLL_SLEEP_S)
            state = self._agent.check_xfer_state(handle)
        if state != "DONE":
            safe = self._abort(handle)
            raise KVTransferError(f"{op} with {peer_name!r} failed (NIXL state {state})", local_blocks_safe=safe)
        handle.release()

    def _abort(self, handle) -> bool:
        """Release (cancel) a handle; False if NIXL refused, in which case we retry on close()."""
        try:
            handle.release()
            return True
        except Exception:
            logger.warning("NIXL refused to release a transfer handle; retrying on close()", exc_info=True)
            self._stuck_handles.append(handle)
            return False

    # ----------------------------------------------------------------- notifications
    def send_notif(self, peer_name: str, payload: bytes) -> None:
        self._check_open()
        self._agent.send_notif(peer_name, payload)

    def poll_notifs(self) -> list[PeerMessage]:
        """Notifications received since the last poll, in arrival order per sender."""
        self._check_open()
        return [
            PeerMessage(name, bytes(payload))
            for name, payloads in self._agent.get_new_notifs().items()
            for payload in payloads
        ]

    def poll_release_notices(self) -> list[ReleaseNotice]:
        """Our lease notices among new notifications (others are logged and dropped)."""
        notices = []
        for message in self.poll_notifs():
            notice = ReleaseNotice.decode(message.payload)
            if notice is None:
                logger.warning("ignoring foreign notification from %s: %r", message.peer_name, message.payload[:64])
            else:
                notices.append(notice)
        return notices

    def _try_notify(self, peer_name: str, payload: bytes) -> None:
        try:
            self._agent.send_notif(peer_name, payload)
        except Exception:
            logger.warning("could not notify %s (peer gone?)", peer_name, exc_info=True)

    # ----------------------------------------------------------------- teardown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for handle in self._stuck_handles:
            try:
                handle.release()
            except Exception:
                logger.error("transfer handle still not releasable at close", exc_info=True)
        for peer_name in list(self._peers):
            self.remove_peer(peer_name)
        self._agent.deregister_memory(self._registration)
        if self._host_registration is not None:
            self._agent.deregister_memory(self._host_registration)
        self._agent = None  # destroying the agent stops its progress thread

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"transport {self.agent_name!r} is closed")
