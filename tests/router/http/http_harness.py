"""Front-door test harness: a real uvicorn server on 127.0.0.1 (a free port) in a background thread, and
the OpenAI error-body check."""
from __future__ import annotations

import socket
import threading
import time

import uvicorn


class ServerThread:
    """``with ServerThread(app) as server: httpx.get(server.url + "/health")``."""

    def __init__(self, app, start_timeout_s: float = 10.0) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="uvicorn-test", daemon=True)
        self._start_timeout_s = start_timeout_s

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()


def assert_error_shape(body: dict, type: str = "invalid_request_error") -> dict:
    """``body`` is exactly ``{"error": {message, type, param, code}}``; returns the inner dict."""
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and error["type"] == type, error
    return error
