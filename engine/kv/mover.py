"""The bytes of the lower KV tiers: the host tier's tensor, the disk tier's files, and the thread that copies.

``TierMover`` runs the jobs ``TierManager`` (engine/kv/tiers.py) submits, in submission order, on its own
thread (``kv-mover-<worker>``), so no copy ever runs on the engine thread. Each op copies one whole block —
all layers, K and V, one contiguous range in the block-major layout (0.7 MiB for SmolLM2-135M, 2 MiB for
Llama-3.1-8B at 16 tokens) — so every move is a large contiguous copy.

- Host tier: one tensor ``host[num_slots, num_layers, 2, block_size, kv_heads, head_dim]`` in the cache's
  dtype, the same layout as the device cache, so a slot's bytes are a block's bytes. Pinned memory on a
  CUDA engine (copies on a side stream that first waits for the step that wrote the block); a separate
  budget of ordinary memory on a CPU engine.
- Disk tier: one file per block in a directory of this engine (``<kv_disk_dir>/<worker>-<pid>``, emptied at
  start and removed at close), written to a temporary name and renamed, so a reader never sees half a file.
  A file is a header (magic, format version, the cache layout's hash, the block hash, its token ids, the
  payload's length and xxh3-64 checksum) followed by the block's bytes. A read that finds anything other
  than what was written — short, another layout, another block, other tokens, a checksum mismatch — is a
  failed op: the engine recomputes that block and drops the file. A write that fails (disk full,
  unwritable) is a failed op: the block is simply not on disk. Both are logged and counted.
"""
from __future__ import annotations

import ctypes
import logging
import os
import queue
import shutil
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import xxhash

from engine.errors import ConfigError
from engine.kv.tiers import Completion, Job, Op, TierManager

log = logging.getLogger(__name__)

MAGIC = b"DUETKVB1"
_HEADER = struct.Struct("<8sIQQIQQ")  # magic, format version, layout hash, block hash, tokens, payload bytes, checksum
FORMAT_VERSION = 1


class DiskTierError(RuntimeError):
    """A disk-tier file that cannot be used (bad magic, layout, checksum, truncated): read as a miss."""


def layout_hash(kv: torch.Tensor) -> int:
    """What must match for a file's bytes to be a block of this cache: dtype and block shape."""
    return xxhash.xxh3_64_intdigest(f"{kv.dtype}|{tuple(kv.shape[1:])}".encode())


class DiskFiles:
    """One engine's block files. Every method raises ``OSError`` / ``DiskTierError`` on failure."""

    def __init__(self, root: str | os.PathLike, worker_id: str, layout: int) -> None:
        self.dir = Path(root) / f"{worker_id}-{os.getpid()}"
        shutil.rmtree(self.dir, ignore_errors=True)  # a file from an earlier process is not in our index
        self.dir.mkdir(parents=True, exist_ok=True)
        self.layout = layout

    def path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}.kvb"

    def write(self, block_hash: int, token_ids: tuple[int, ...], payload: np.ndarray) -> None:
        tokens = np.asarray(token_ids, dtype="<u4").tobytes()
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, self.layout, block_hash, len(token_ids), payload.nbytes,
                              xxhash.xxh3_64_intdigest(payload))
        path = self.path(block_hash)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(tokens)
                f.write(memoryview(payload))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def read_into(self, block_hash: int, token_ids: tuple[int, ...], out: np.ndarray) -> None:
        """Read the block's file into ``out`` (a host slot's bytes) and check every field of it."""
        with open(self.path(block_hash), "rb") as f:
            raw = f.read(_HEADER.size)
            if len(raw) != _HEADER.size:
                raise DiskTierError("truncated header")
            magic, version, layout, h, n, nbytes, checksum = _HEADER.unpack(raw)
            if magic != MAGIC or version != FORMAT_VERSION:
                raise DiskTierError(f"not a duet block file (magic {magic!r}, version {version})")
            if layout != self.layout or h != block_hash or nbytes != out.nbytes:
                raise DiskTierError("the file holds another block or another cache layout")
            if f.read(4 * n) != np.asarray(token_ids, dtype="<u4").tobytes():
                raise DiskTierError("the file's token ids differ")
            if f.readinto(memoryview(out)) != out.nbytes or f.read(1):
                raise DiskTierError("truncated or overlong payload")
        if xxhash.xxh3_64_intdigest(out) != checksum:
            raise DiskTierError("payload checksum mismatch")

    def delete(self, block_hash: int) -> None:
        self.path(block_hash).unlink(missing_ok=True)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class TierMover:
    """Copies blocks between the device cache, the host tensor and the disk files on its own thread."""

    def __init__(self, kv: torch.Tensor, host_slots: int, disk_dir: str | None, worker_id: str,
                 mirror: Callable[[Job], Completion] | None = None) -> None:
        """``mirror(job)``: a tensor-parallel engine's other ranks run the same job on their tiers (their KV heads
        of the same blocks and slots); an op that failed on any rank failed."""
        self.kv = kv
        self.mirror = mirror
        cuda = kv.device.type == "cuda"
        self.host = torch.zeros((host_slots, *kv.shape[1:]), dtype=kv.dtype, pin_memory=cuda)
        self._host_bytes = self.host.view(torch.uint8).view(host_slots, -1)
        self._block_bytes = self._host_bytes.shape[1]
        if not kv.is_contiguous():  # a block is one contiguous range of the cache (block-major layout)
            raise ValueError("the KV cache must be contiguous")
        self.disk = DiskFiles(disk_dir, worker_id, layout_hash(kv)) if disk_dir else None
        self._stream = torch.cuda.Stream(kv.device) if cuda else None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self.bytes_moved = {"device_to_host": 0, "host_to_device": 0, "host_to_disk": 0, "disk_to_host": 0}
        self.seconds = {k: 0.0 for k in self.bytes_moved}
        self.op_failures = 0
        self._thread = threading.Thread(target=self._run, name=f"kv-mover-{worker_id}", daemon=True)
        self._thread.start()

    # ---- engine thread --------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        event = None
        if self._stream is not None:  # the copies must see what this step's kernels wrote
            event = torch.cuda.current_stream(self.kv.device).record_event()
        self._jobs.put((job, event))

    def completions(self, wait_s: float = 0.0) -> list[Completion]:
        out = []
        try:
            out.append(self._done.get(timeout=wait_s) if wait_s > 0 else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            return out

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(10)
        if self.disk is not None:
            self.disk.close()

    # ---- mover thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, event = item
            try:
                self._done.put(self._execute(job, event))
            except Exception as e:  # a bug, not an I/O failure: fail the whole job, keep the thread
                log.exception("KV mover job %d failed", job.job_id)
                self._done.put(Completion(job.job_id, frozenset(range(len(job.ops))), f"{type(e).__name__}: {e}"))

    def _execute(self, job: Job, event) -> Completion:
        failed: set[int] = set()
        bad_slots: set[int] = set()  # host slots whose fetch failed in this job: a load from them is skipped
        first_error = None
        if event is not None:
            self._stream.wait_event(event)
        for i, op in enumerate(job.ops):
            if op.kind == "load" and op.host_slot in bad_slots:
                failed.add(i)
                continue
            try:
                self._op(op)
            except (OSError, DiskTierError) as e:
                failed.add(i)
                self.op_failures += 1
                first_error = first_error or f"{op.kind} of block {op.block_hash:016x}: {e}"
                log.warning("KV tier %s of block %016x failed: %s", op.kind, op.block_hash, e)
                if op.kind == "fetch":
                    bad_slots.add(op.host_slot)
        if self._stream is not None:
            self._stream.synchronize()  # a load is complete before the engine may schedule its request
        if self.mirror is not None:
            other = self.mirror(job)
            failed |= other.failed
            first_error = first_error or other.error
        return Completion(job.job_id, frozenset(failed), first_error)

    def run_here(self, job: Job) -> Completion:
        """Run ``job`` on the calling thread (a tensor-parallel rank > 0: rank 0's mover drives, this one copies)."""
        return self._execute(job, None)

    def _op(self, op: Op) -> None:
        t0 = time.perf_counter()
        if op.kind == "store":
            self._copy(self.host, op.host_slot, self.kv, op.device_block)
            direction = "device_to_host"
        elif op.kind == "load":
            self._copy(self.kv, op.device_block, self.host, op.host_slot)
            direction = "host_to_device"
        elif op.kind == "spill":
            self.disk.write(op.block_hash, op.token_ids, self._host_bytes[op.host_slot].numpy())
            direction = "host_to_disk"
        elif op.kind == "fetch":
            self.disk.read_into(op.block_hash, op.token_ids, self._host_bytes[op.host_slot].numpy())
            direction = "disk_to_host"
        elif op.kind == "delete":
            self.disk.delete(op.block_hash)
            return
        else:
            raise ValueError(f"unknown mover op {op.kind!r}")
        self.bytes_moved[direction] += self._block_bytes
        self.seconds[direction] += time.perf_counter() - t0

    def _copy(self, dst: torch.Tensor, dst_block: int, src: torch.Tensor, src_block: int) -> None:
        """Block ``src_block`` of ``src`` → block ``dst_block`` of ``dst`` (the cache or the host tensor)."""
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                dst[dst_block].copy_(src[src_block], non_blocking=True)
            return
        # CPU: one memcpy on this thread (GIL released), not torch's copy_, which splits a block across the
        # OpenMP team: a second team beside the engine's, whose threads its GEMMs are using (measured in
        # bench/kv/tiers_copy.py: copy_ reached 0.4-0.8 of memcpy per 0.7 MiB block; docs/benchmarks.md)
        if not (0 <= dst_block < dst.shape[0] and 0 <= src_block < src.shape[0]):
            raise IndexError(f"block {src_block} -> {dst_block} outside the tensors")
        n = self._block_bytes
        ctypes.memmove(dst.data_ptr() + dst_block * n, src.data_ptr() + src_block * n, n)


def tier_slots(config, bytes_per_block: int) -> tuple[int, int]:
    """(host slots, disk slots) the config's byte budgets hold (every rank of a split holds as many)."""
    host_slots = config.kv_host_bytes // bytes_per_block
    disk_slots = config.kv_disk_bytes // (bytes_per_block + _HEADER.size + 4 * config.block_size)
    if host_slots < 1:
        raise ConfigError(f"kv_host_bytes {config.kv_host_bytes} holds no block of {bytes_per_block} bytes")
    if config.kv_disk_bytes and disk_slots < 1:
        raise ConfigError(f"kv_disk_bytes {config.kv_disk_bytes} holds no block of {bytes_per_block} bytes")
    return host_slots, disk_slots


def build_tiers(config, kv: torch.Tensor, bytes_per_block: int, pool,
                mirror: Callable[[Job], Completion] | None = None) -> TierManager | None:
    """The engine's lower tiers from its config (None without a host tier); logs their sizes."""
    if not config.kv_host_bytes:
        return None
    host_slots, disk_slots = tier_slots(config, bytes_per_block)
    try:
        mover = TierMover(kv, host_slots, config.kv_disk_dir if disk_slots else None, config.worker_id, mirror)
    except OSError as e:
        raise ConfigError(f"kv_disk_dir {config.kv_disk_dir!r} is not usable: {e}") from e
    log.info("KV tiers of %s: host %d blocks (%.1f MiB), disk %d blocks (%.1f MiB)%s", config.worker_id, host_slots,
             host_slots * bytes_per_block / 2**20, disk_slots, disk_slots * bytes_per_block / 2**20,
             f" in {mover.disk.dir}" if mover.disk else "")
    tiers = TierManager(host_slots, disk_slots, mover, pool.record, config.worker_id)
    pool.track_new_cached = True
    return tiers
