"""One local Ray per test session, and real clusters (Ray actors + NIXL) on tiny models.

`cluster_factory(**overrides)` starts a `cluster.launcher.Cluster` on the session's Ray and stops it at
the end of the test module that asked for it. Every cluster here is real: worker actors in their own
processes, KV blocks moved by NIXL between them, events fed to the router over Ray.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

# ray_session: the session's one local Ray (tests/conftest.py; the benchmark tests use it too)


class LoopThread:
    """An asyncio loop on a thread, so synchronous tests can drive async clusters (and the loop outlives
    one test: a cluster's event feeds keep running on it)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def cluster_factory(ray_session, tiny_model, loop_thread):
    from cluster.config import ClusterConfig
    from cluster.launcher import Cluster

    started = []

    def start(model=None, **overrides):
        overrides = {"model": str(model or tiny_model()), "engine.num_blocks": 256, "router.grpc_port": None,
                     "prefill.num_cpus": 0.5, "decode.num_cpus": 0.5, "prefill.torch_threads": 1,
                     "decode.torch_threads": 1, **overrides}
        cluster = loop_thread.run(Cluster.start(ClusterConfig.load(None, overrides)))
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        loop_thread.run(cluster.stop())
