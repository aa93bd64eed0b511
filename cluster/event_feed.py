"""Feeding the router's prefix index and load tracker from the workers (embedded `memory` index).

One asyncio task per worker long-polls `read_events(after_seq, wait_s=1)` over Ray and applies each
batch through `router.routing.feed.IndexFeed` (which checks per-worker sequence numbers). When the worker's
log was truncated under us, or the feed saw a gap, the task fetches `snapshot()` (AllCleared + every
cached hash, stamped with the worker's current seq) and continues after it: the index converges to
the worker's real cache whatever was lost. A worker that stops answering is dropped from the index
(its hashes would only attract requests it cannot serve) and polled again with backoff.
"""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

POLL_WAIT_S = 1.0
SNAPSHOT_INTERVAL_S = 30.0


async def poll_worker_events(client, feed) -> None:
    worker = client.worker_id
    cursor = 0
    backoff_s = 0.1
    while True:
        try:
            batches, last_seq, truncated = await client.handle.read_events.remote(cursor, 256, POLL_WAIT_S)
            if truncated or worker in feed.needs_resync:
                cursor = await _resync(client, feed)
                continue
            for data in batches:
                feed.apply_batch(data)
            cursor = last_seq
            backoff_s = 0.1
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("event feed of %s failed (%s); dropping it from the index, retrying", worker, e)
            feed.remove_worker(worker)
            cursor = 0
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 5.0)


async def _resync(client, feed) -> int:
    seq, data = await client.handle.snapshot.remote()
    feed.apply_batch(data)  # AllCleared + every cached hash: the feed resets the worker to it
    return seq


def start_redis_feed(url: str, backend, on_load=None):
    """(task, feed) reading the shared Redis stream into the backend's index and load tracker."""
    from router.routing.feed import IndexFeed
    from router.routing.redis_feed import RedisEventSource

    feed = IndexFeed(backend.index, backend.tracker, on_load=on_load)
    source = RedisEventSource(url, feed)
    source.restore()  # snapshot + stream: a restarting router rebuilds the same view
    return source.start(snapshot_interval_s=SNAPSHOT_INTERVAL_S), feed
