"""Ports for the servers a test starts as a subprocess (``duet serve``, redis-server): chosen here, then bound
there — so the port is free for a moment only, and anything may take it in between.

The kernel's ``bind(0)`` hands out ports from the ephemeral range, the same range every outgoing connection
(Ray's, the clients') takes its own from: with ``make test``'s two processes, each with its own Ray, a `duet
serve` lost its port that way ("address already in use"). So these come from below that range, from a slice of
it for each pytest-xdist process, and are checked free by binding them.
"""
from __future__ import annotations

import itertools
import os
import random
import socket

LOW, HIGH = 20000, 32000  # below Linux's default ephemeral range (32768-60999)
SLICE = 1000  # ports per xdist process (gw0: 20000-20999, gw1: 21000-21999, ...)
_next = itertools.count(random.randrange(SLICE))


def free_port(host: str = "127.0.0.1") -> int:
    """A port that binds now, from this test process's slice."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    base = LOW + (index * SLICE) % (HIGH - LOW)
    for _ in range(SLICE):
        port = base + next(_next) % SLICE
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}-{base + SLICE - 1}")
