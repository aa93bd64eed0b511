"""Placing a request for a LoRA adapter by the workers' slot budgets (issue 50; Dynamo's router places adapters by
each worker's slot budget).

Every worker holds every served adapter in host memory (router/lora_adapters.py), but only ``max_loras`` of them
in device slots, and a batch mixes at most that many: a request whose adapter finds every slot held by other
adapters' running requests (or pinned) waits in that worker's queue (engine/lora/manager.py). So among a pool's
workers, those that can run the adapter now come first:

    ready(w, a) = a holds a slot on w (running there, pinned, or idle in its slot)
                  or the adapters w's slots cannot give up (running or pinned, other than a) < max_loras(w)

read from each worker's latest ``stats()["lora"]`` (``slots``, ``running_adapters``, ``pinned``, ``max_loras``;
polled every ``lifecycle.stats_interval_s``, 1 s by default: a placement can be that stale). ``ready_workers``
keeps the ready ones when there are any, else every worker (the request waits for a slot wherever the policy puts
it: outcome ``all_busy``); the routing policy then chooses among them by prefix and load as for any request, so an
adapter's cached blocks (its own hash namespace) still draw it to the worker that holds them. A worker without
stats yet counts as ready (it just joined, or stats are off). Outcomes, counted by the router in
``duet_lora_placements{role, outcome}``: ``ready`` (some workers could run it now), ``all_busy``.
"""
from __future__ import annotations

from collections.abc import Mapping


def ready(lora: Mapping | None, adapter: str) -> bool:
    """Whether a worker whose ``stats()["lora"]`` is ``lora`` can run ``adapter`` without waiting for a slot."""
    if not lora:
        return True
    if adapter in lora.get("slots", {}):
        return True
    held = (set(lora.get("running_adapters", ())) | set(lora.get("pinned", ()))) - {adapter}
    return len(held) < int(lora.get("max_loras", 1))


def ready_workers(stats: Mapping[str, Mapping], adapter: str | None) -> tuple[list[str], str | None]:
    """(the workers of ``stats`` (worker id -> its latest stats) to route ``adapter``'s request among, the outcome):
    the ready ones, or all of them when none is (outcome ``all_busy``). No adapter: all, outcome None."""
    workers = list(stats)
    if adapter is None:
        return workers, None
    chosen = [w for w in workers if ready(stats[w].get("lora"), adapter)]
    return (chosen, "ready") if chosen else (workers, "all_busy")
