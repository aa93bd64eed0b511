"""Waiting for a started worker, and saying why a start is slow: Ray has not placed it (no node has room for
what it asks), or it is placed and still loading its model.

A worker actor Ray cannot place is not an error to Ray: it stays queued until a node with room appears (a Ray
autoscaler's or KubeRay's new node, or another actor ending). On a fixed cluster that is a silent wait until
``lifecycle.start_timeout_s``. So after ``SLOW_START_S`` the pool manager asks Ray's actor table where the
worker is, logs it once (with what it asks and what is free), and counts an unplaced start
(``duet_pool_actions{action="start_waits_for_room"}``); the start goes on waiting until its timeout.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import ray

log = logging.getLogger(__name__)

SLOW_START_S = 20.0


def placed(handle) -> bool | None:
    """Whether Ray has given the actor a process (its constructor runs or ran); None if the table does not say.
    Ray's state is PENDING_CREATION both while it waits for room and while its constructor runs; the process id
    tells the two apart (0 until it is placed)."""
    try:
        entry = ray._private.state.actors(handle._actor_id.hex())
    except Exception as e:  # an internal API: never let it fail a start
        log.debug("actor table: %r", e)
        return None
    if not isinstance(entry, dict) or "State" not in entry:
        return None
    return entry["State"] != "PENDING_CREATION" or bool(entry.get("Pid"))


async def await_info(worker_id: str, handle, timeout_s: float, asks: dict[str, float] | None,
                     on_unplaced: Callable[[], None], slow_s: float = SLOW_START_S) -> Any:
    """``handle.info()`` within ``timeout_s`` (asyncio.TimeoutError past it); a start not done after ``slow_s`` is
    logged once, and ``on_unplaced()`` called if Ray has not placed the worker by then."""
    t0 = time.monotonic()
    info = asyncio.ensure_future(handle.info.remote())
    try:
        done, _ = await asyncio.wait({info}, timeout=min(slow_s, timeout_s))
        if not done:
            where = placed(handle)
            if where is False:
                on_unplaced()
                log.warning("worker %s is not placed after %.0f s: no Ray node has room for what it asks (%s; free "
                            "now: %s). It waits for room (a node a Ray autoscaler adds, or another actor ending) "
                            "until lifecycle.start_timeout_s (%.0f s)", worker_id, slow_s, asks or "?",
                            _free(asks), timeout_s)
            else:
                log.warning("worker %s is not ready after %.0f s (%s); it has until lifecycle.start_timeout_s "
                            "(%.0f s)", worker_id, slow_s,
                            "placed, still starting" if where else "Ray's actor table does not say where", timeout_s)
        return await asyncio.wait_for(info, max(0.0, timeout_s - (time.monotonic() - t0)))
    finally:
        if not info.done():
            info.cancel()


def _free(asks: dict[str, float] | None) -> dict[str, float]:
    try:
        free = ray.available_resources()
    except Exception:  # noqa: BLE001 - only for the message
        return {}
    return {k: round(free.get(k, 0.0), 3) for k in (asks or free)}
