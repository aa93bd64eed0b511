"""`duet serve` as a user runs it: the real CLI in a subprocess, attached to the session's Ray, then
`curl` for a streaming completion, then SIGTERM for a graceful stop."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.serve_process import serving
from tests.ports import free_port

pytestmark = pytest.mark.slow


def test_serve_then_curl_streaming_completion_then_sigterm(ray_session, tiny_model, tmp_path):
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    model = tiny_model()
    port, grpc_port = free_port(), free_port()
    address = ray_session.get_runtime_context().gcs_address
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(model), "--prefill", "1", "--decode", "1",
            "--port", str(port), "--grpc-port", str(grpc_port), "--address", address, "--num-blocks", "128",
            "--local-prefill-max-tokens", "0"]
    with serving(argv, tmp_path / "serve.log", port) as proc:
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
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
