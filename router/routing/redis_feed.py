"""RedisEventSource: a router's reader of the shared KV-event stream (design note: router/routing/feed.py,
"Shared index (Redis)" and "Snapshots and trimming")."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import redis
import redis.asyncio as aioredis

from proto.kv_codec import DEFAULT_STREAM, STREAM_FIELD
from router.routing.feed import (
    DEFAULT_SNAPSHOT_INTERVAL_S,
    DEFAULT_SNAPSHOT_KEY,
    SNAPSHOT_FORMAT,
    IndexFeed,
    parse_stream_id,
)

log = logging.getLogger(__name__)


# ---- Redis consumer ------------------------------------------------------------------------------------
# Write the snapshot unless the stored one is newer. "stream_id" is the JSON's first field, so its first
# bytes suffice and the (large) snapshot is never parsed in Lua.
_SAVE_IF_NEWER = """
local head = redis.call('GETRANGE', KEYS[1], 0, 63)
local ms, n = string.match(head, '^{"stream_id": "(%d+)%-(%d+)"')
if ms then
  local new_ms, new_n = string.match(ARGV[2], '^(%d+)%-(%d+)$')
  ms, n, new_ms, new_n = tonumber(ms), tonumber(n), tonumber(new_ms), tonumber(new_n)
  if ms > new_ms or (ms == new_ms and n > new_n) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""


RESET_CHECK_INTERVAL_S = 1.0  # while the stream is quiet, look this often whether it started over
MAX_RETRY_S = 2.0  # backoff ceiling while Redis is unreachable


class RedisEventSource:
    """Reads the shared stream into an ``IndexFeed`` (asyncio task ``run()``; sync ``poll_once()``).

    Redis restarts. Without persistence a restarted Redis has an empty stream; XADD ids are the server's
    clock, so new entries usually sort after the last id read and are simply read on. If they do not (a
    clock behind ours, a replica promoted with less data), reading after ``last_id`` would wait forever:
    after every failed read, and every ``RESET_CHECK_INTERVAL_S`` while the stream is quiet, the source
    compares the stream's last generated id with ``last_id`` and reads the stream from 0 if it went
    backwards (``stream_resets``). Batches lost while Redis was down are per-worker seq gaps: those
    workers leave the index until their full-state batch, which each worker publishes as soon as its sink
    gets through again (``WorkerBase._publish``).
    """

    def __init__(self, url: str, feed: IndexFeed, stream: str = DEFAULT_STREAM,
                 snapshot_key: str = DEFAULT_SNAPSHOT_KEY, *, block_ms: int = 100, batch_entries: int = 512) -> None:
        self.url, self.feed, self.stream, self.snapshot_key = url, feed, stream, snapshot_key
        self.block_ms, self.batch_entries = block_ms, batch_entries
        self.num_entries = 0  # stream entries consumed (applied or skipped)
        self._last_id = "0-0"
        self._client: redis.Redis | None = None
        self._aclient: aioredis.Redis | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def last_id(self) -> str:
        """Id of the last stream entry applied ("0-0": none)."""
        return self._last_id

    def has_reached(self, stream_id: str | bytes) -> bool:
        return parse_stream_id(self._last_id) >= parse_stream_id(stream_id)

    def _sync(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis.from_url(self.url)
        return self._client

    def _apply(self, response: Any) -> int:
        n = 0
        for _stream, entries in response or ():
            for entry_id, fields in entries:
                self.feed.apply_batch(fields.get(STREAM_FIELD, b""))  # a missing field is just malformed
                self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                n += 1
        self.num_entries += n
        return n

    # ---- sync: start-up, tests, tools ---------------------------------------------------------------
    def poll_once(self, block_ms: int | None = None) -> int:
        """One XREAD after ``last_id`` (waiting up to ``block_ms``; None: not at all); entries consumed."""
        response = self._sync().xread({self.stream: self._last_id}, count=self.batch_entries,
                                      block=block_ms or None)
        return self._apply(response)

    def catch_up(self) -> int:
        """Read until the stream has nothing more after ``last_id``."""
        total = 0
        while n := self.poll_once():
            total += n
        return total

    def restore(self) -> bool:
        """Load the shared snapshot if there is a usable one, then catch up; returns whether one was used."""
        raw = self._sync().get(self.snapshot_key)
        used = False
        if raw is not None:
            try:
                snap = json.loads(raw)
                if snap.get("format") != SNAPSHOT_FORMAT:
                    raise ValueError(f"snapshot format {snap.get('format')!r}")
                stream_id = str(snap["stream_id"])
                parse_stream_id(stream_id)
                self.feed.restore(snap["feed"])
                self._last_id, used = stream_id, True
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                log.warning("ignoring unusable index snapshot %s: %r; reading the stream from 0", self.snapshot_key, e)
        if used and self._trimmed_past(self._last_id):
            log.warning("stream %s was trimmed past snapshot %s: every worker must resync", self.stream, self._last_id)
            self.feed.invalidate_all()
        self.catch_up()
        return used

    def check_stream_reset(self) -> bool:
        """Sync ``_reset_if_behind``: whether the stream started over (then it is read from 0)."""
        try:
            info = self._sync().xinfo_stream(self.stream)
        except redis.ResponseError:  # no such stream
            info = None
        return self._reset_if_behind(info)

    def _reset_if_behind(self, info: dict | None) -> bool:
        if self._last_id == "0-0":
            return False
        newest = info.get("last-generated-id") if info else None
        if newest is not None and parse_stream_id(newest) >= parse_stream_id(self._last_id):
            return False
        log.warning("KV event stream %s at %s started over below %s (Redis lost its data): reading it from 0; "
                    "workers whose batches were lost resync from their next full state", self.stream,
                    newest.decode() if isinstance(newest, bytes) else newest, self._last_id)
        self._last_id = "0-0"
        self.feed.counters.stream_resets += 1
        return True

    def _trimmed_past(self, stream_id: str) -> bool:
        """Whether entries after ``stream_id`` may have been trimmed (its own entry is gone)."""
        try:
            info = self._sync().xinfo_stream(self.stream)
        except redis.ResponseError:  # no such stream
            return stream_id != "0-0"
        if info.get("entries-added") == info["length"]:
            return False  # nothing was ever removed (Redis >= 7 reports entries-added)
        first = info.get("first-entry")
        if not first:
            return parse_stream_id(info["last-generated-id"]) > parse_stream_id(stream_id)
        return parse_stream_id(first[0]) > parse_stream_id(stream_id)

    def _snapshot_json(self) -> str:
        return json.dumps({"stream_id": self._last_id, "format": SNAPSHOT_FORMAT, "saved_at_s": time.time(),
                           "feed": self.feed.snapshot()})

    def save_snapshot(self) -> bool:
        """Store this router's state as the shared snapshot unless a newer one is there; whether it did."""
        return bool(self._sync().eval(_SAVE_IF_NEWER, 1, self.snapshot_key, self._snapshot_json(), self._last_id))

    # ---- asyncio: the router process ---------------------------------------------------------------
    async def run(self, snapshot_interval_s: float | None = DEFAULT_SNAPSHOT_INTERVAL_S) -> None:
        """Follow the stream until cancelled, saving a snapshot every ``snapshot_interval_s`` (None: never)."""
        self._aclient = aioredis.Redis.from_url(self.url, socket_connect_timeout=1.0)
        next_snapshot_s = time.monotonic() + (snapshot_interval_s or 0.0)
        check_at = time.monotonic() + RESET_CHECK_INTERVAL_S
        failures = 0
        try:
            while not self._stopping:
                try:
                    if failures or time.monotonic() >= check_at:  # back after an outage, or quiet for a while
                        await self._check_stream_reset_async()
                        check_at = time.monotonic() + RESET_CHECK_INTERVAL_S
                    response = await self._aclient.xread({self.stream: self._last_id}, count=self.batch_entries,
                                                         block=self.block_ms)
                    if failures:
                        log.info("reading KV events from %s again after %d failed attempts", self.url, failures)
                        failures = 0
                    if self._apply(response):
                        check_at = time.monotonic() + RESET_CHECK_INTERVAL_S  # entries flow: no need to look
                    if snapshot_interval_s and time.monotonic() >= next_snapshot_s:
                        next_snapshot_s = time.monotonic() + snapshot_interval_s
                        await self._aclient.eval(_SAVE_IF_NEWER, 1, self.snapshot_key, self._snapshot_json(),
                                                 self._last_id)
                except redis.RedisError as e:
                    failures += 1
                    self.feed.counters.source_errors += 1
                    if failures == 1 or failures % 30 == 0:  # an outage logs once, then every ~minute
                        log.warning("reading KV events from %s failed (%d in a row): %r; retrying", self.url,
                                    failures, e)
                    await asyncio.sleep(min(MAX_RETRY_S, self.block_ms / 1000 * 2 ** min(failures - 1, 5)))
        finally:
            await self._aclient.aclose()
            self._aclient = None

    async def _check_stream_reset_async(self) -> bool:
        try:
            info = await self._aclient.xinfo_stream(self.stream)
        except redis.ResponseError:  # no such stream (yet)
            info = None
        return self._reset_if_behind(info)

    def start(self, snapshot_interval_s: float | None = DEFAULT_SNAPSHOT_INTERVAL_S) -> asyncio.Task:
        """Run ``run()`` as a task of the current event loop."""
        if self._task is not None and not self._task.done():
            raise RuntimeError("event source already running")
        self._task = asyncio.get_running_loop().create_task(self.run(snapshot_interval_s), name="kv-event-source")
        return self._task

    async def stop(self) -> None:
        """Cancel the task and wait for it. A cancellation can be lost inside redis-py (on Python 3.11 a read
        timeout firing with it turns it into a ``TimeoutError``, which the retry loop takes for an outage), so
        the loop also checks ``_stopping`` and the cancel is repeated until the task is done."""
        task, self._stopping = self._task, True
        try:
            while task is not None and not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)
            if task is not None and not task.cancelled() and task.exception() is not None:
                log.warning("KV event source ended with %r", task.exception())
        finally:
            self._task, self._stopping = None, False

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
