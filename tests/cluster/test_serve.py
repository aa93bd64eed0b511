"""`duet serve` as a user runs it: the real CLI in a subprocess, attached to the session's Ray, then
`curl` for a streaming completion, then SIGTERM for a graceful stop."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"duet serve exited with {proc.returncode}:\n{proc.stderr.read()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("duet serve did not become healthy")


def test_serve_then_curl_streaming_completion_then_sigterm(ray_session, tiny_model, tmp_path):
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    model = tiny_model()
    port, grpc_port = free_port(), free_port()
    address = ray_session.get_runtime_context().gcs_address
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--model", str(model), "--prefill", "1", "--decode", "1",
         "--port", str(port), "--grpc-port", str(grpc_port), "--address", address, "--num-blocks", "128",
         "--local-prefill-max-tokens", "0"],
        cwd=ROOT, stdout=log, stderr=subprocess.PIPE, text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc)
        body = {"model": Path(model).name, "prompt": "the river and the mountain", "max_tokens": 12,
                "temperature": 0, "stream": True}
        curl = subprocess.run(["curl", "-sN", f"http://127.0.0.1:{port}/v1/completions", "-H",
                               "Content-Type: application/json", "-d", json.dumps(body)],
                              capture_output=True, text=True, timeout=120)
        events = [line[len("data: "):] for line in curl.stdout.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", curl.stdout
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert len(chunks) >= 2  # streamed, not one blob
        engine = Engine(EngineConfig(model=str(model), num_blocks=128))
        want = engine.generate(["the river and the mountain"], SamplingParams(max_tokens=12, temperature=0))[0]
        assert text == want["text"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("duet serve did not stop within 60 s of SIGTERM")
    assert rc == 0, proc.stderr.read()[-3000:]
