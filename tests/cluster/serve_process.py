"""`duet serve` (or `make run`) as a user starts it: a real subprocess attached to the test session's Ray,
waited on until /health answers, stopped with a signal like a terminal's, and its workers inspected over Ray."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVE_NAMESPACE = "duet"  # the Ray namespace `duet serve` puts its actors in


def wait_http(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = 240) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # a connection refused costs nothing; each serve test waits on this
    raise AssertionError(f"server did not become healthy:\n{log_path.read_text()[-4000:]}")


@contextmanager
def serving(argv: list[str], log_path: Path, port: int, stop_signal: int = signal.SIGTERM,
            env: dict[str, str] | None = None):
    """Run ``argv`` (in its own process group, with this process's environment and ``env``) until /health is up;
    on exit signal the whole group and wait. Yields the process; ``proc.returncode`` is set after the block."""
    log = open(log_path, "w+")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})})
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, log_path)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, stop_signal)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise AssertionError(f"server did not stop within 90 s:\n{log_path.read_text()[-3000:]}")
        log.close()


def serve_worker_stats(ray) -> dict[str, dict]:
    """stats() of every worker actor a `duet serve` process started, by role ("prefill-0", "decode-0", ...)."""
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] == SERVE_NAMESPACE and name.startswith(("duet-prefill-", "duet-decode-")):
            role, index = name.split("-")[1:3]
            try:
                out[f"{role}-{index}"] = ray.get(ray.get_actor(name, namespace=SERVE_NAMESPACE).stats.remote(),
                                                 timeout=30)
            except (ValueError, ray.exceptions.RayActorError):  # an actor of an earlier server, going away
                continue
    return out
