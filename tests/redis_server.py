"""A real redis-server for the event-plane tests: one per session, on a free port, no persistence.

`make test` installs redis-server (`make system-deps`). A machine without it fails these tests with a message
saying so — the shared index is part of the product, so its tests are never skipped.
"""
from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis

from tests.ports import free_port


def _start(binary: str, workdir, port: int | None = None) -> tuple[subprocess.Popen, str]:
    port = port or free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if client.ping():
                client.close()
                return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    client.close()
    proc.kill()
    proc.wait()
    raise RuntimeError(f"redis-server did not come up on port {port} (exit code {proc.returncode})")


class RedisProcess:
    """A private redis-server that a test may stop and start again on the same port (fault injection)."""

    def __init__(self, workdir) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.fail("redis-server is not installed: run `make system-deps` (apt-get install -y redis-server)",
                        pytrace=False)
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.url = ""

    def start(self) -> str:
        for attempt in range(3):
            try:
                self.proc, self.url = _start(self.binary, self.workdir, self.port)
                break
            except RuntimeError:
                if attempt == 2 or self.port is not None:  # the same port must come back; do not pick another
                    raise
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])
        return self.url

    def stop(self) -> None:
        """SIGKILL: no shutdown save, like a crashed or evicted pod (persistence is off anyway)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """URL of a private redis-server started for this test session."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run `make system-deps` (apt-get install -y redis-server)", pytrace=False)
    workdir = tmp_path_factory.mktemp("redis")
    for attempt in range(3):  # the free port can be taken between choosing and binding it
        try:
            proc, url = _start(binary, workdir)
            break
        except RuntimeError:
            if attempt == 2:
                raise
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def redis_url(redis_server):
    """The session's redis-server, emptied for this test."""
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    client.close()
    return redis_server
