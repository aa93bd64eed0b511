"""The dashboard's time series: one point per second, the last ten minutes, computed from the same sources as
/metrics (the worker registry, the workers' stats, the router's own request timing) — never a second
bookkeeping of its own.

A point holds rates over the second before it (requests, tokens, errors, transfer bytes, fallbacks,
speculative decoding's acceptance), the latency percentiles of the requests and tokens seen in that second,
and the state at its end (pool sizes and targets, queues, KV use). Cumulative worker counters become rates
per worker, counted from the second point a worker reports each one, so a worker that joins (with counters
already large) or leaves never shows up as a spike, up or down.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from cluster.autoscaler import percentile
from router.routing.policy import Role
from router.workers.registry import WorkerState

log = logging.getLogger(__name__)

POINTS_KEPT = 600
_WORKER_COUNTERS = ("transfer_bytes", "transfers_failed", "num_remote_recomputes", "num_remote_failures",
                    "leases_expired", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens")
_SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")  # in stats["spec_decode"]


def _counters(stats: dict[str, Any]) -> dict[str, float]:
    """The cumulative counters a worker's stats() reports, those of speculative decoding as ``spec_<name>``;
    a counter it does not report is left out (not read as 0, which would make its first report a spike)."""
    spec = stats.get("spec_decode") or {}
    counts = {k: stats.get(k) for k in _WORKER_COUNTERS} | {f"spec_{k}": spec.get(k) for k in _SPEC_COUNTERS}
    return {k: float(v) for k, v in counts.items() if v is not None}


class Timeline:
    def __init__(self, pools, metrics, interval_s: float = 1.0, keep: int = POINTS_KEPT) -> None:
        self.pools = pools  # cluster.pools.PoolManager: registry, targets, backend
        self.metrics = metrics  # router.metrics.collector.RouterMetrics
        self.interval_s = interval_s
        self.points: deque[dict[str, Any]] = deque(maxlen=keep)
        self._worker_last: dict[str, dict[str, float]] = {}
        self._router_last: dict[str, float] | None = None
        self._last_s: float | None = None
        metrics.take_samples("dashboard")  # open this consumer's buffer now

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.points.append(self.sample(time.time(), time.monotonic()))
            except Exception:  # a bad point must not stop the page
                log.exception("dashboard sample failed")

    def since(self, t: float) -> list[dict[str, Any]]:
        return [p for p in self.points if p["t"] > t]

    def sample(self, now: float, now_mono: float) -> dict[str, Any]:
        dt = max(1e-3, now_mono - self._last_s) if self._last_s is not None else self.interval_s
        self._last_s = now_mono
        registry, m = self.pools.registry, self.metrics
        point: dict[str, Any] = {"t": round(now, 3)}

        router = {"finished": float(sum(m.finished.values())), "errors": float(m.finished.get("error", 0)),
                  "tokens": float(m.num_tokens), "placed_again": float(self.pools.backend.counters["replaced"])}
        last = self._router_last or router
        self._router_last = router
        point["req_s"] = (router["finished"] - last["finished"]) / dt
        point["tok_s"] = (router["tokens"] - last["tokens"]) / dt
        point["errors_s"] = (router["errors"] - last["errors"]) / dt
        point["placed_again"] = router["placed_again"] - last["placed_again"]

        samples = m.take_samples("dashboard")
        for kind in ("ttft", "itl"):
            values = [s.value_s for s in samples if s.kind == kind]
            for q in (50, 90, 99):
                point[f"{kind}_p{q}"] = percentile(values, q) if values else None

        for role in (Role.PREFILL, Role.DECODE):
            live = registry.records(role, (WorkerState.READY, WorkerState.DRAINING))
            loads = [r.load for r in live if r.load is not None]
            total = sum(ld.kv_blocks_total for ld in loads)
            point[f"running_{role.value}"] = sum(ld.running for ld in loads)
            point[f"waiting_{role.value}"] = sum(ld.waiting for ld in loads)
            point[f"kv_{role.value}"] = sum(ld.kv_blocks_used for ld in loads) / total if total else None
            point[f"ready_{role.value}"] = len(registry.ready(role))
            point[f"target_{role.value}"] = self.pools.targets[role]
        point["queued_prefill_tokens"] = sum(r.load.queued_prefill_tokens for r in registry.live() if r.load)

        live, last, self._worker_last = registry.live(), self._worker_last, {}
        deltas = dict.fromkeys((*_WORKER_COUNTERS, *(f"spec_{k}" for k in _SPEC_COUNTERS)), 0.0)
        for rec in live:
            prev = last.get(rec.worker_id, {})
            now_counts = self._worker_last[rec.worker_id] = _counters(rec.stats)
            for k, v in now_counts.items():
                deltas[k] += max(0.0, v - prev.get(k, v))
        point["xfer_bytes_s"] = deltas["transfer_bytes"] / dt
        point["xfer_failures"] = deltas["transfers_failed"]
        point["recomputes"] = deltas["num_remote_recomputes"] + deltas["num_remote_failures"]
        point["lease_expiries"] = deltas["leases_expired"]
        queried = deltas["prefix_cache_queried_tokens"]
        point["prefix_hit"] = deltas["prefix_cache_hit_tokens"] / queried if queried else None
        drafts, draft_tokens, accepted = (deltas[f"spec_{k}"] for k in _SPEC_COUNTERS)
        point["spec_on"] = any(rec.stats.get("spec_decode") for rec in live)
        point["spec_accept_rate"] = accepted / draft_tokens if draft_tokens else None
        point["spec_accept_len"] = 1 + accepted / drafts if drafts else None
        point["spec_draft_tok_s"] = draft_tokens / dt
        return point


def mount_dashboard(app) -> None:
    """GET /dashboard (the page) and its assets under /dashboard/static (served from this package)."""
    from pathlib import Path

    from fastapi.responses import FileResponse
    from starlette.staticfiles import StaticFiles

    static = Path(__file__).parent / "static"

    async def page() -> FileResponse:
        return FileResponse(static / "index.html", media_type="text/html")

    app.add_api_route("/dashboard", page, methods=["GET"], include_in_schema=False)
    app.mount("/dashboard/static", StaticFiles(directory=static), name="dashboard-static")
