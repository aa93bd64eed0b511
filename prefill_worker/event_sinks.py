"""The event plane, worker side: where a worker's encoded KV-event batches go (router/routing/feed.py applies them).

A sink per destination (the cluster builds them; they are pickled into the worker process and
connect on first use). The worker encodes one batch per engine step that had events, and a load-only batch
at least every ~100 ms, with ``seq`` = 1, 2, 3, … per worker (proto/kv_codec.py), and hands it to each sink:

  * ``MemoryEventLog`` (embedded default): a bounded ring in the worker process. A router long-polls
    ``worker.read_events(after_seq)``; ``truncated`` says it fell behind the ring (or the log restarted)
    and must resync from ``worker.snapshot()`` — a full-state batch, see router/routing/feed.py.
  * ``RedisEventSink`` (``--index redis://…``): XADD to one stream, field ``b``, approximate MAXLEN.
    After a failed XADD it drops batches for ``retry_interval_s`` instead of stalling the engine thread;
    a dropped batch is a seq gap that every router sees. The worker then publishes its full state as the
    first batch that gets through (``WorkerBase._publish``), so routers resync in-band right away.
"""
from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from itertools import islice
from typing import Any

import redis

from proto.kv_codec import DEFAULT_STREAM, DEFAULT_STREAM_MAXLEN, STREAM_FIELD

log = logging.getLogger(__name__)


class EventSink(ABC):
    """Where a worker's encoded batches go. Picklable; connects lazily on the first publish."""

    @abstractmethod
    def publish(self, worker: str, seq: int, data: bytes) -> bool:
        """Hand one batch on; False when it was dropped (the destination is down)."""

    def available(self) -> bool:
        """Whether a publish now would be attempted (False while a sink waits to retry after a failure)."""
        return True

    def close(self) -> None:
        """Release connections; a sink without any has nothing to do."""


class MemoryEventLog(EventSink):
    """The last ``capacity_batches`` batches of one worker, as a contiguous run of seqs."""

    def __init__(self, capacity_batches: int = 4096) -> None:
        if capacity_batches <= 0:
            raise ValueError("capacity_batches must be positive")
        self.capacity_batches = capacity_batches
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=capacity_batches)
        self._head_seq = 0  # last seq published (0: none)
        self._worker: str | None = None
        self._lock = threading.Lock()

    def publish(self, worker: str, seq: int, data: bytes) -> bool:
        with self._lock:
            if self._worker is None:
                self._worker = worker
            elif worker != self._worker:
                raise ValueError(f"log of worker {self._worker!r} got a batch of {worker!r}")
            if self._ring and seq != self._head_seq + 1:
                self._ring.clear()  # a restart (or a skipped seq): readers behind it are truncated
            self._ring.append((seq, data))
            self._head_seq = seq
        return True

    def restart(self) -> None:
        """The worker starts over under a new id at seq 1 (a role flip): the old id's batches are dropped."""
        with self._lock:
            self._ring.clear()
            self._head_seq = 0
            self._worker = None

    def read(self, after_seq: int, max_batches: int = 256) -> tuple[list[bytes], int, bool]:
        """``(batches with seq > after_seq, seq to pass next time, truncated)``.

        ``truncated``: batches after ``after_seq`` are gone (the reader fell behind the ring) or the log
        restarted below it; the oldest batches still held are returned and the reader must resync.
        """
        with self._lock:
            first_seq = self._ring[0][0] if self._ring else self._head_seq + 1
            truncated = after_seq < first_seq - 1 or after_seq > self._head_seq
            start = 0 if truncated else after_seq + 1 - first_seq
            taken = list(islice(self._ring, start, start + max_batches))
            head_seq = self._head_seq
        if not taken:
            return [], head_seq if truncated else after_seq, truncated
        return [data for _, data in taken], taken[-1][0], truncated

    def __getstate__(self) -> dict[str, Any]:
        with self._lock:
            state = dict(self.__dict__, _ring=list(self._ring))
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _ring=deque(state["_ring"], maxlen=state["capacity_batches"]))
        self._lock = threading.Lock()


class RedisEventSink(EventSink):
    """XADD each batch to ``stream`` (field ``b``), trimmed to about ``maxlen`` entries."""

    def __init__(self, url: str, stream: str = DEFAULT_STREAM, maxlen: int = DEFAULT_STREAM_MAXLEN,
                 retry_interval_s: float = 1.0) -> None:
        self.url, self.stream, self.maxlen = url, stream, maxlen
        self.retry_interval_s = retry_interval_s
        self.num_dropped = 0
        self._client: redis.Redis | None = None
        self._retry_at = 0.0

    def publish(self, worker: str, seq: int, data: bytes) -> bool:
        if not self.available():
            self.num_dropped += 1  # Redis was down a moment ago: routers will see the seq gap and resync
            return False
        if self._client is None:
            self._client = redis.Redis.from_url(self.url, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            self._client.xadd(self.stream, {STREAM_FIELD: data}, maxlen=self.maxlen, approximate=True)
        except redis.RedisError as e:
            self.num_dropped += 1
            self._retry_at = time.monotonic() + self.retry_interval_s
            log.warning("KV events of %s not published to %s (%r): dropping batches for %.1f s", worker, self.url,
                        e, self.retry_interval_s)
            return False
        return True

    def available(self) -> bool:
        return time.monotonic() >= self._retry_at

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _client=None)
