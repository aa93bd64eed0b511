"""What the router does when a worker call fails (a mixin of router/dispatch/cluster_backend.py's ``ClusterBackend``,
split by responsibility): a call that raises is followed by a liveness probe. A dead worker leaves the pools (the
registry's live set, the index and the load tracker) and the request's stream gets a ``_Lost`` marker instead of an
output, so that ``ClusterBackend.generate`` places it again or continues it elsewhere; a live worker's failure is an
error output, never retried blindly. A stream left early (the client gone) is aborted on its worker."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from router.workers.client import WorkerClient

if TYPE_CHECKING:  # the host, for a type checker only
    from router.dispatch.cluster_backend import ClusterBackend

log = logging.getLogger("router.dispatch.cluster_backend")

ALIVE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class _Lost:
    """In a worker's stream instead of an output: that worker died (generate() places or migrates)."""

    worker_id: str
    role: str


class WorkerFaults:
    """Needs ``counters`` and ``retire`` (ClusterBackend's)."""

    async def _call(self: ClusterBackend, coro, rid: str, worker: WorkerClient):
        try:
            return await coro
        except asyncio.CancelledError:
            await _quietly(worker.abort(rid))
            self.counters["aborted"] += 1
            raise
        except InvalidRequestError:
            raise
        except Exception as e:
            return await self._on_fault(rid, worker, e)

    async def _guard(self: ClusterBackend, stream: AsyncIterator[RequestOutput], rid: str, worker: WorkerClient):
        """Yield a worker's stream; on early exit abort there; a worker fault becomes an error output
        (or `_Lost` when the worker is gone)."""
        finished = False
        try:
            async for out in stream:
                finished = out.finished
                yield out
        except InvalidRequestError:
            finished = True
            raise
        except Exception as e:
            finished = True
            yield await self._on_fault(rid, worker, e)
        finally:
            if not finished:
                self.counters["aborted"] += 1
                await _quietly(worker.abort(rid))
            await _quietly(stream.aclose())

    async def _on_fault(self: ClusterBackend, rid: str, worker: WorkerClient, e: BaseException):
        """A worker call failed. A dead worker leaves the pools (its index entry and predicted load with it)
        and the request goes on elsewhere (generate()); a live worker's failure is an error output."""
        alive = await _alive(worker)
        if not alive:
            self._remove_worker(worker, e)
            return _Lost(worker.worker_id, worker.descriptor.role.value)
        return self._error_output(rid, worker, e)

    def _remove_worker(self: ClusterBackend, worker: WorkerClient, e: BaseException) -> None:
        if self.retire(worker.worker_id, f"{type(e).__name__}: {e}", fault=True):
            log.error("worker %s is gone (%s): removed from the %s pool", worker.worker_id, e, worker.descriptor.role)

    def _error_output(self: ClusterBackend, rid: str, worker: WorkerClient | None, e: BaseException) -> RequestOutput:
        self.counters["errors"] += 1
        where = f"worker {worker.worker_id}" if worker is not None else "the cluster"
        log.error("request %s failed on %s: %s", rid, where, e)
        return RequestOutput(request_id=rid, new_token_ids=[], new_text="", finished=True, finish_reason="error",
                             error=f"{where} failed: {type(e).__name__}: {e}")


async def _alive(worker: WorkerClient) -> bool:
    try:
        return bool(await asyncio.wait_for(worker.alive(), ALIVE_TIMEOUT_S))
    except Exception:
        return False


async def _quietly(awaitable) -> None:
    """Best-effort cleanup: a dead worker must not turn a cleanup into a second failure."""
    try:
        await asyncio.shield(asyncio.ensure_future(awaitable))
    except BaseException as e:  # noqa: BLE001 - includes CancelledError of the shielding task
        log.debug("cleanup call failed: %r", e)
