"""LoraAdapters: the LoRA adapters a server serves, the same set on every worker, changed at run time.

    adapters = LoraAdapters(lambda: live_workers, startup)      # startup: the --lora-modules adapters
    await adapters.load("sql", "/adapters/sql")                 # on every worker, or on none
    await adapters.unload("sql")                                # new requests 404 at once; running ones finish first
    async with adapters.joining(worker): activate(worker)       # a worker that joins gets the current set
    await adapters.admit("sql"); ...; adapters.end("sql")       # a request of an adapter (resolved if evicted)

The front doors' runtime endpoints (vLLM's ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``, gRPC
``LoadLoraAdapter`` / ``UnloadLoraAdapter``) call ``load`` / ``unload``; ``names()`` is what ``/v1/models`` lists and
what a request may name in ``model``. A target is anything with the worker's three LoRA verbs (``load_lora``,
``unload_lora``, ``lora_adapters``): a Ray worker's client, or the one in-process engine of a colocated server.

- Load: on every live worker (ready or draining) at once; if any worker refuses, those that loaded it unload it again
  and the first refusal is raised, naming the worker (``LoraAdapterNotFoundError``: no directory at the path there;
  ``LoraAdapterError``: an adapter duet cannot serve, or a limit; anything else: the worker failed). The adapter is
  served (listed, routable) only once every worker holds it, with the same digest (the same bytes; a name is never
  reused for other bytes: blocks cached under the name would be reused). Loading a name already served is refused
  (vLLM's 400).
- Unload (vLLM's behaviour for requests, stated): the name leaves ``names()`` at once, so new requests naming it are
  refused (404 / NOT_FOUND) from then on; requests admitted before run to their end with it, nothing is cut; then
  every worker drops it, and the call returns. So the call waits for the adapter's running requests (vLLM answers at
  once and frees the adapter later). A worker that fails to drop it is reported (the name stays unserved; a later
  load of the same bytes under it succeeds there too, since a worker's load is idempotent).
- Joining (scale-up, a replacement, a role flip's new id): ``joining(worker)`` gives it the served set (loads what it
  lacks, drops what is not served) and holds the set still until the block returns, inside which the caller makes
  it routable: a load can never miss a worker that is becoming ready.
- Resolve (``--lora-resolver-dir``, router/lora_resolver.py): a request naming an adapter nobody loaded, found in the
  resolver's directory, loads it on first use (one load however many requests name it at once; then it is served
  like any other). Adapters the resolver loaded are a cache: when the workers hold ``max_cpu_loras`` adapters, a load
  (a resolve, or an admin's) unloads the least recently used of them with no running request first (counted
  ``resolve_evictions``); adapters loaded by name (``--lora-modules``, the endpoints) are never unloaded for room.
  With no such adapter idle the request is refused with 429 (``LoraAdaptersBusyError``; retry). A request whose
  adapter was unloaded for room between its front door's check and its admission (it may wait in the admission
  queue) resolves it again there (``admit``).
A ``lora_path`` that reads as a Hub id is pinned to its commit here, before any worker is asked (``pin_hub_adapter``).
Per name, loads and unloads are serialized (vLLM's per-name lock); the worker calls of all of them and joins
are serialized by one lock. Torch-free (router process).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from engine.errors import (
    DuetError,
    LoraAdapterError,
    LoraAdapterNotFoundError,
    LoraAdaptersBusyError,
    LoraCapacityError,
)
from router.lora_resolver import LoraResolver

log = logging.getLogger(__name__)
MAX_EVICTIONS = 4  # a load that found no room unloads at most this many idle resolved adapters (others race for it)


class LoraTarget(Protocol):
    """A worker's LoRA verbs (prefill_worker's ``Worker.load_lora`` ...; router/workers/client.py ``WorkerClient``)."""

    worker_id: str

    async def load_lora(self, name: str, path: str, pinned: bool = False) -> str: ...

    async def unload_lora(self, name: str) -> None: ...

    async def lora_adapters(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class ServedAdapter:
    name: str
    path: str
    pinned: bool = False
    digest: str | None = None  # the bytes every worker holds (None: not yet seen, the start-up set until a sync)


async def pin_hub_adapter(path: str) -> str:
    """``path`` as it is, or, a Hub id (``org/name[@revision]``, no such local path), resolved once here and pinned to
    its commit (engine/hub/resolve.py ``pin_adapter``, off the event loop: it may fetch), so that every worker, and
    every worker that joins later, reads the same bytes; what the Hub refuses is a ``LoraAdapterError``."""
    from engine.hub.ref import is_hub_id

    if not is_hub_id(path):
        return path
    from engine.errors import ModelLoadError
    from engine.hub.resolve import pin_adapter

    try:
        return await asyncio.to_thread(pin_adapter, path)
    except ModelLoadError as e:
        raise LoraAdapterError(f"LoRA adapter {path}: {e}") from None


class LoraAdapters:
    def __init__(self, targets: Callable[[], Sequence[LoraTarget]], served: Iterable[ServedAdapter] = (),
                 resolver: LoraResolver | None = None) -> None:
        self._targets = targets
        self.served: dict[str, ServedAdapter] = {a.name: a for a in served}
        self.resolver = resolver
        self.resolved: set[str] = set()  # served names the resolver loaded: unloaded for room when idle
        self.last_named: dict[str, float] = {}  # served name -> when a request last named it (monotonic)
        self.inflight: collections.Counter[str] = collections.Counter()  # requests admitted per adapter, not ended
        self.digests: dict[str, str] = {}  # every name ever served -> its digest (kept after unload)
        # loads, unloads, load_failures, unload_failures, joins; resolved, resolve_misses, resolve_failures,
        # resolve_evictions, resolve_busy
        self.counters = collections.Counter()
        self._apply = asyncio.Lock()  # worker calls of loads, unloads and joins, one at a time
        self._names: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._idle = asyncio.Condition()

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.served))

    # ---- requests --------------------------------------------------------------------------------
    def begin(self, name: str | None) -> None:
        """A request naming ``name`` is admitted (no-op for the base model); LoraAdapterNotFoundError if it is not
        served (any more)."""
        if name is None:
            return
        if name not in self.served:
            raise LoraAdapterNotFoundError(f"LoRA adapter {name!r} is not served (unloaded?)")
        self.inflight[name] += 1
        self.last_named[name] = time.monotonic()

    async def admit(self, name: str | None) -> None:
        """``begin`` for a request about to run: an adapter its front door found served (or resolved) but that was
        unloaded for room since, while the request waited for admission, is resolved again first (a resolver's
        adapter; anything else not served is the 404 ``begin`` raises)."""
        if name is not None and name not in self.served and self.resolver is not None:
            await self.resolve(name)
        self.begin(name)

    def end(self, name: str | None) -> None:
        if name is None:
            return
        self.inflight[name] -= 1
        if self.inflight[name] <= 0:
            del self.inflight[name]
            with contextlib.suppress(RuntimeError):  # no loop running (a stream closed at exit): nobody waits
                asyncio.get_running_loop().create_task(self._wake())

    async def _wake(self) -> None:
        async with self._idle:
            self._idle.notify_all()

    # ---- load / unload ---------------------------------------------------------------------------
    async def load(self, name: str, path: str, pinned: bool = False) -> ServedAdapter:
        if not name or not path:
            raise LoraAdapterError("both 'lora_name' and 'lora_path' must be given")
        path = await pin_hub_adapter(path)
        async with self._names[name]:
            if name in self.served:
                raise LoraAdapterError(f"the LoRA adapter {name!r} has already been loaded")
            return await self._load_making_room(name, path, pinned)

    async def resolve(self, name: str) -> bool:
        """Whether ``name`` is served now: one already served (its use noted), or one the resolver finds, loaded here
        (the module's docstring). False: no resolver, or none by that name. Raises what a load raises
        (``LoraAdapterError``: an adapter duet cannot serve, 400) and ``LoraAdaptersBusyError`` (429) when no
        room can be made."""
        if name in self.served:
            self.last_named[name] = time.monotonic()
            return True
        if self.resolver is None:
            return False
        try:
            path = self.resolver.find(name)
        except LoraAdapterError:
            self.counters["resolve_failures"] += 1
            raise
        if path is None:
            self.counters["resolve_misses"] += 1
            return False
        try:
            path = await pin_hub_adapter(path)  # a Hub id the resolver allows: pinned and fetched once, here
        except LoraAdapterError:
            self.counters["resolve_failures"] += 1
            raise
        async with self._names[name]:
            if name not in self.served:  # else another request's resolve loaded it meanwhile
                try:
                    await self._load_making_room(name, path, False)
                except LoraCapacityError as e:
                    self.counters["resolve_busy"] += 1
                    raise LoraAdaptersBusyError(f"LoRA adapter {name!r} cannot be loaded now: {e}; every adapter "
                                                "loaded by the resolver has running requests") from None
                except LoraAdapterError:
                    self.counters["resolve_failures"] += 1
                    raise
                self.resolved.add(name)
                self.counters["resolved"] += 1
                log.info("LoRA adapter %r resolved to %s on first use", name, path)
            self.last_named[name] = time.monotonic()
        return True

    async def _load_making_room(self, name: str, path: str, pinned: bool) -> ServedAdapter:
        """``_load`` (under ``name``'s lock); when the workers are full, the least recently named idle adapter the
        resolver loaded is unloaded and the load tried again (the last refusal raised when none is left)."""
        for _ in range(MAX_EVICTIONS):
            try:
                return await self._load(name, path, pinned)
            except LoraCapacityError:
                victim = min((n for n in self.resolved if not self.inflight[n] and n in self.served),
                             key=lambda n: self.last_named.get(n, 0.0), default=None)
                if victim is None:
                    raise
                log.info("LoRA adapter %r unloaded to make room for %r (resolved, least recently named, idle)",
                         victim, name)
                with contextlib.suppress(LoraAdapterNotFoundError):  # another load unloaded it first
                    await self.unload(victim)
                    self.counters["resolve_evictions"] += 1
        return await self._load(name, path, pinned)

    async def _load(self, name: str, path: str, pinned: bool) -> ServedAdapter:
        """Load on every live worker, or on none (the caller holds ``name``'s lock)."""
        async with self._apply:
            targets = list(self._targets())
            results = await asyncio.gather(*(t.load_lora(name, path, pinned) for t in targets),
                                           return_exceptions=True)
            loaded = [t for t, r in zip(targets, results) if isinstance(r, str)]
            error = next((_named(t, r) for t, r in zip(targets, results) if isinstance(r, BaseException)), None)
            digests = {r for r in results if isinstance(r, str)}
            seen = self.digests.get(name)
            if error is None and len(digests) > 1:
                error = LoraAdapterError(f"the workers read different bytes at {path} for {name!r}")
            if error is None and seen is not None and digests and digests != {seen}:
                error = LoraAdapterError(f"LoRA adapter name {name!r} was served with other weights before: "
                                         f"blocks cached under that name would be reused; load {path} under a "
                                         "new name")
            if error is not None:
                self.counters["load_failures"] += 1
                await asyncio.gather(*(t.unload_lora(name) for t in loaded), return_exceptions=True)
                raise error
            digest = digests.pop() if digests else seen
            adapter = ServedAdapter(name, path, pinned, digest)
            if digest is not None:
                self.digests[name] = digest
            self.served[name] = adapter
            self.counters["loads"] += 1
        log.info("LoRA adapter %r loaded on %d workers from %s%s", name, len(targets), path,
                 " (pinned)" if pinned else "")
        return adapter

    async def unload(self, name: str) -> None:
        if not name:
            raise LoraAdapterError("'lora_name' must be given")
        async with self._names[name]:
            if name not in self.served:
                raise LoraAdapterNotFoundError(f"the LoRA adapter {name!r} cannot be found")
            del self.served[name]  # new requests naming it are refused from here on
            self.resolved.discard(name)
            self.last_named.pop(name, None)
            if self.inflight[name]:
                log.info("LoRA adapter %r unloads after its %d running requests", name, self.inflight[name])
            async with self._idle:
                await self._idle.wait_for(lambda: not self.inflight[name])
            async with self._apply:
                targets = list(self._targets())
                results = await asyncio.gather(*(t.unload_lora(name) for t in targets), return_exceptions=True)
            failed = [_named(t, r) for t, r in zip(targets, results)
                      if isinstance(r, BaseException) and not isinstance(r, LoraAdapterNotFoundError)]
            if failed:
                self.counters["unload_failures"] += 1
                log.error("LoRA adapter %r: %d workers failed to drop it: %s", name, len(failed), failed)
                raise failed[0]
            self.counters["unloads"] += 1
        log.info("LoRA adapter %r unloaded from %d workers", name, len(targets))

    # ---- workers that join -----------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def joining(self, target: LoraTarget):
        """Give ``target`` the served set; the set stays as it is until the block (which makes it routable) ends.
        A worker that cannot load an adapter, or holds other bytes under a served name, fails to join (raised)."""
        async with self._apply:
            await self._sync(target)
            self.counters["joins"] += 1
            yield

    async def join(self, target: LoraTarget) -> None:
        """``joining`` for a worker that is made routable elsewhere (the launcher's start-up set): the served set
        given, the digests recorded."""
        async with self.joining(target):
            return

    async def _sync(self, target: LoraTarget) -> None:
        held = await target.lora_adapters()
        for name in sorted(set(held) - set(self.served)):
            await target.unload_lora(name)
        for name, adapter in sorted(self.served.items()):
            digest = held.get(name) or await target.load_lora(name, adapter.path, adapter.pinned)
            if adapter.digest is None:
                self.served[name] = replace(adapter, digest=digest)
                self.digests[name] = digest
            elif digest != adapter.digest:
                raise LoraAdapterError(f"worker {target.worker_id} holds other bytes for LoRA adapter {name!r} "
                                       f"(from {adapter.path})")


def _named(target: LoraTarget, error: BaseException) -> BaseException:
    """``error`` with the worker's id in its message, of the same class when it is one of duet's (so the front door
    answers the same status)."""
    if isinstance(error, DuetError):
        try:
            return type(error)(f"worker {target.worker_id}: {error}")
        except TypeError:  # a DuetError whose constructor takes more than a message
            return error
    return RuntimeError(f"worker {target.worker_id} failed: {type(error).__name__}: {error}")
