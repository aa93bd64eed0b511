"""A slow worker start says why (cluster/start_wait.py): real Ray actors on the session's Ray — one that asks for
a resource no node has (Ray queues it: unplaced), one whose constructor is slow (placed, still starting)."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest
import ray

from cluster.start_wait import await_info, placed


class Slow:
    def __init__(self, delay_s: float) -> None:
        time.sleep(delay_s)

    def info(self) -> str:
        return "up"


def test_a_start_ray_cannot_place_is_logged_counted_and_times_out(ray_session, caplog):
    handle = ray.remote(Slow).options(num_cpus=0, resources={"no_such_node": 1}).remote(0.0)
    counted = []
    with caplog.at_level(logging.WARNING, logger="cluster.start_wait"), pytest.raises(asyncio.TimeoutError):
        asyncio.run(await_info("decode-7", handle, timeout_s=3.0, asks={"no_such_node": 1.0},
                               on_unplaced=lambda: counted.append(1), slow_s=1.0))
    assert counted == [1]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "decode-7 is not placed after 1 s" in line and "'no_such_node': 1.0" in line, line
    assert placed(handle) is False
    ray.kill(handle)


def test_a_placed_worker_still_loading_is_not_counted_as_unplaced(ray_session, caplog):
    handle = ray.remote(Slow).options(num_cpus=0.5).remote(4.0)
    counted = []
    with caplog.at_level(logging.WARNING, logger="cluster.start_wait"):
        got = asyncio.run(await_info("prefill-3", handle, timeout_s=60.0, asks={"CPU": 0.5},
                                     on_unplaced=lambda: counted.append(1), slow_s=1.0))
    assert got == "up" and counted == []
    (line,) = [r.getMessage() for r in caplog.records]
    assert "prefill-3 is not ready after 1 s (placed, still starting)" in line, line
    assert placed(handle) is True
    ray.kill(handle)
