"""Fixtures shared by the benchmark tests that run a real cluster."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_up(ray_session):
    """The session's Ray (tests/conftest.py: room for 32 workers, more than the 4 these benchmarks need), which
    the cluster tests use after them: one Ray start for the session instead of one per benchmark module."""
    yield
