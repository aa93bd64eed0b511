"""The admin API's auth matrix and its bad-input answers, on a real uvicorn server (router/http/admin.py).

The operator behind it is a recording stand-in (the live cluster's PoolManager is exercised in
tests/cluster/test_operating.py); the registry is the real one.
"""
from __future__ import annotations

import time

import httpx
import pytest

from engine.errors import InvalidRequestError
from engine.kv.events import Tier, TierUsage, WorkerLoad
from engine.text.tokenizer import Tokenizer
from router.http.admin import Operator, is_loopback
from router.http.app import create_app
from router.routing.policy import Role
from router.workers.registry import WorkerRegistry
from tests.router.http.http_harness import ServerThread, assert_error_shape
from tests.router.http.test_backend_faults import ScriptedBackend


class RecordingOperator(Operator):
    def __init__(self) -> None:
        self.registry = WorkerRegistry()
        self.registry.add("prefill-0", Role.PREFILL, time.monotonic(), pid=11)
        self.registry.mark_ready("prefill-0", time.monotonic())
        self.registry.add("decode-0", Role.DECODE, time.monotonic(), pid=12)
        self.calls: list[tuple] = []

    def autoscaler_view(self):
        return {"enabled": False, "decisions": []}

    def set_target(self, role, target=None, pin=None):
        if target is not None and not 1 <= target <= 3:
            raise InvalidRequestError(f"{role.value} target must be an integer in [1, 3], got {target!r}")
        self.calls.append((role, target, pin))
        return {"role": role.value, "target": target, "pinned": bool(pin)}


def serve(tiny_model, **kw):
    op = RecordingOperator()
    app = create_app(ScriptedBackend(Tokenizer.from_dir(tiny_model())), operator=op, metrics=None, **kw)
    return op, ServerThread(app)


def call(server, method, path, key=None, json=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, server.url + path, headers=headers, json=json, timeout=10)


READ, WRITE = ("GET", "/admin/workers"), ("POST", "/admin/pools/prefill")
# (api keys, admin key, bind host) -> {(request, key sent): status}
MATRIX = {
    "open-loopback": ((), None, "127.0.0.1", {(READ, None): 200, (WRITE, None): 200, (WRITE, "x"): 200}),
    "open-public": ((), None, "0.0.0.0", {(READ, None): 200, (WRITE, None): 403, (WRITE, "x"): 403}),
    "keys-loopback-no-admin": (("k",), None, "127.0.0.1", {(READ, None): 401, (READ, "k"): 200, (READ, "x"): 401,
                                                           (WRITE, None): 401, (WRITE, "k"): 200}),
    "keys-public-no-admin": (("k",), None, "::", {(READ, "k"): 200, (WRITE, "k"): 403, (WRITE, None): 403}),
    "keys-and-admin": (("k",), "adm", "0.0.0.0", {(READ, None): 401, (READ, "k"): 200, (READ, "adm"): 200,
                                                  (READ, "x"): 401, (WRITE, None): 401, (WRITE, "k"): 403,
                                                  (WRITE, "x"): 403, (WRITE, "adm"): 200}),
    "admin-only-loopback": ((), "adm", "127.0.0.1", {(READ, None): 200, (WRITE, None): 401, (WRITE, "k"): 403,
                                                     (WRITE, "adm"): 200}),
}


@pytest.mark.parametrize("case", list(MATRIX))
def test_auth_matrix(tiny_model, case):
    api_keys, admin_key, host, expected = MATRIX[case]
    op, server = serve(tiny_model, api_keys=api_keys, admin_key=admin_key, bind_host=host)
    with server:
        for ((method, path), key), status in expected.items():
            r = call(server, method, path, key, json={"target": 2} if method == "POST" else None)
            assert r.status_code == status, (case, method, key, r.text)
            if status >= 400:
                err = assert_error_shape(r.json(), "authentication_error" if status == 401 else "permission_error")
                assert err["code"]
        assert call(server, "GET", "/metrics").status_code == 200  # open, like vLLM's
        assert call(server, "GET", "/health").status_code == 200
    writes_ok = sum(1 for ((m, _), _), st in expected.items() if m == "POST" and st == 200)
    assert len(op.calls) == writes_ok  # nothing reached the operator without permission


def test_reads_show_the_registry(tiny_model):
    op, server = serve(tiny_model)
    with server:
        workers = call(server, "GET", "/admin/workers").json()["data"]
        assert [(w["worker_id"], w["role"], w["state"], w["pid"]) for w in workers] == [
            ("prefill-0", "prefill", "ready", 11), ("decode-0", "decode", "starting", 12)]
        assert [w["kv_tiers"] for w in workers] == [None, None]  # no load report yet
        op.registry.update_load(WorkerLoad("prefill-0", "prefill", 0, 0, 3, 64, 0, (TierUsage(Tier.HOST, 256, 9),)),
                                time.monotonic())
        workers = call(server, "GET", "/admin/workers").json()["data"]
        assert workers[0]["kv_tiers"] == {"device": {"blocks_total": 64, "blocks_used": 3},
                                          "host": {"blocks_total": 256, "blocks_used": 9}}
        assert call(server, "GET", "/admin/autoscaler").json() == {"enabled": False, "decisions": []}


@pytest.mark.parametrize("path, body, status, param", [
    ("/admin/pools/prefill", {"target": 9}, 400, "target"),
    ("/admin/pools/prefill", {"target": "two"}, 400, "target"),
    ("/admin/pools/prefill", {"pin": "yes"}, 400, "pin"),
    ("/admin/pools/prefill", {"target": None}, 400, "target"),  # found by schemathesis: was accepted as a no-op
    ("/admin/pools/prefill", {"pin": None, "target": 2}, 400, "pin"),
    ("/admin/pools/prefill", {"size": 2}, 400, "size"),
    ("/admin/pools/prefill", {}, 400, None),
    ("/admin/pools/router", {"target": 1}, 404, "role"),
])
def test_bad_writes_are_clear_4xx(tiny_model, path, body, status, param):
    op, server = serve(tiny_model)
    with server:
        r = call(server, "POST", path, json=body)
        assert r.status_code == status, r.text
        assert assert_error_shape(r.json())["param"] == param
        r = httpx.post(server.url + "/admin/pools/decode", content=b"{not json", timeout=10)
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert op.calls == []


def test_pin_and_target_reach_the_operator(tiny_model):
    op, server = serve(tiny_model)
    with server:
        assert call(server, "POST", "/admin/pools/decode", json={"target": 2, "pin": True}).status_code == 200
        assert call(server, "POST", "/admin/pools/decode", json={"pin": False}).status_code == 200
    assert op.calls == [(Role.DECODE, 2, True), (Role.DECODE, None, False)]


def test_loopback_hosts():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com"))


def test_colocated_server_has_no_pools(tiny_model):
    app = create_app(ScriptedBackend(Tokenizer.from_dir(tiny_model())))
    with ServerThread(app) as server:
        r = call(server, "GET", "/admin/workers")
        assert r.status_code == 404 and assert_error_shape(r.json())["code"] == "no_pools"


def test_health_readiness_and_liveness(tiny_model):
    backend = ScriptedBackend(Tokenizer.from_dir(tiny_model()))
    with ServerThread(create_app(backend)) as server:
        assert call(server, "GET", "/health").status_code == 200
        backend.healthy = False  # e.g. no decode worker ready: not ready, but alive
        assert call(server, "GET", "/health").status_code == 503
        r = call(server, "GET", "/health?probe=liveness")
        assert r.status_code == 200 and r.json() == {"status": "alive"}
        assert call(server, "GET", "/health?probe=startup").status_code == 400
