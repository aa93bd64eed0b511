"""The health loop of the PoolManager (a mixin of cluster/pools.py, split by responsibility): every
``lifecycle.health_interval_s`` each live worker is probed; one that fails ``lifecycle.health_misses`` probes in a
row is dead (one slow answer on a loaded machine is not a death) and is ended, and so is a worker the router
retired after a fault; the reconcile then replaces it."""
from __future__ import annotations

import asyncio
import logging

from router.workers.registry import WorkerState

log = logging.getLogger("cluster.pools")

PROBE_TIMEOUT_S = 5.0  # a worker that does not answer its liveness probe within this is dead


class HealthChecks:
    """Needs the PoolManager's ``registry``, ``feeds``, ``handles``, ``counters``, ``config``, ``_probe_misses``,
    ``_end`` and ``reconcile``."""

    async def check_health(self) -> None:
        for rec in self.registry.records(states=(WorkerState.DEAD,)):  # retired by dispatch after a fault
            if rec.worker_id in self.feeds or rec.worker_id in self.handles:
                self.counters["replaced"] += rec.fault
                self._end(rec.worker_id, rec.reason, fault=rec.fault)
        live = [r for r in self.registry.records(states=(WorkerState.READY, WorkerState.DRAINING))]
        problems = await asyncio.gather(*(probe(r.client) for r in live))
        misses = self.config.lifecycle.health_misses
        for rec, problem in zip(live, problems):
            if problem is None:
                self._probe_misses.pop(rec.worker_id, None)
                continue
            self._probe_misses[rec.worker_id] += 1
            if self._probe_misses[rec.worker_id] < misses:  # one slow answer on a loaded machine is not a death
                log.warning("worker %s failed a health probe (%d of %d before it is replaced): %s", rec.worker_id,
                            self._probe_misses[rec.worker_id], misses, problem)
                self.counters["probe_misses"] += 1
                continue
            if rec.state != WorkerState.DEAD:
                log.error("worker %s is gone (%s): replacing it", rec.worker_id, problem)
                self.counters["replaced"] += 1
                self._end(rec.worker_id, f"died: {problem}", fault=True)
        for worker_id in set(self._probe_misses) - {r.worker_id for r in live}:
            del self._probe_misses[worker_id]
        self.reconcile()


async def probe(client, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None if the worker answers its liveness probe in time; else what the probe found, for the record an
    operator reads: no answer (a frozen process, or a node cut off or hung), the error Ray gave (a process or
    node gone), or an engine thread that stopped."""
    try:
        ok = await asyncio.wait_for(client.alive(), timeout_s)
    except TimeoutError:
        return f"no answer to its health probe within {timeout_s:g} s"
    except Exception as e:  # noqa: BLE001 - any failure to answer is a dead worker; what it was is the reason
        first_line = (str(e).splitlines() or [""])[0][:200]
        return f"health probe failed: {type(e).__name__}: {first_line}"
    if ok:
        return None
    why = getattr(client, "why_not", None)
    return f"health probe: {why}" if why else "health probe: its engine thread has stopped"
