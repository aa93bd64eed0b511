"""Fixtures shared by the benchmark tests that run a real cluster."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_up():
    """The session's Ray if a cluster test started one, else one for this module (room for 4 workers)."""
    import ray

    from bench.cluster_run import init_ray

    if ray.is_initialized():
        yield
        return
    init_ray(4)
    yield
    ray.shutdown()
