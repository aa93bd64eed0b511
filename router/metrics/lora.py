"""LoRA adapters on /metrics, from each worker's ``stats()["lora"]`` (prefill_worker/engine_facts.py ``lora_stats``):

- ``vllm:lora_requests_info`` (gauge), vLLM's exactly: labels ``max_lora`` (the slots: adapters one batch may mix),
  ``running_lora_adapters`` and ``waiting_lora_adapters`` (the adapters of the running / waiting requests, names
  joined by commas, sorted; "" for none), value the wall-clock time (Unix seconds) the worker took them, so a scraper
  (llm-d's endpoint picker, KServe) keeps the latest series; duet adds its worker labels (``engine`` = the worker);
- ``duet_lora_adapters_loaded`` (gauge): adapters loaded per worker (at most its max_cpu_loras);
- ``duet_lora_slot_evictions`` (counter): idle adapters a worker's slots gave up for another (LRU).
A worker without LoRA has no series. And the router's own (router/lora_adapters.py ``LoraAdapters.counters``):
- ``duet_lora_adapter_events`` (counter, label ``event``): loads, unloads and their failures, workers that joined,
  and the resolver's (``--lora-resolver-dir``): resolved (loaded on first use), resolve_misses (a name it did not
  find: 404), resolve_failures (found, not servable: 400), resolve_evictions (an idle resolved adapter unloaded for
  room), resolve_busy (no room: 429)."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

ADAPTER_EVENTS = ("loads", "load_failures", "unloads", "unload_failures", "joins", "resolved", "resolve_misses",
                  "resolve_failures", "resolve_evictions", "resolve_busy")


def adapter_events_family(counters: Mapping[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily("duet_lora_adapter_events", "LoRA adapters loaded and unloaded by the router, by "
                                 "event (the resolver's included: resolved on first use, misses, failures, idle "
                                 "adapters unloaded for room, requests refused for want of room).", labels=("event",))
    for event in ADAPTER_EVENTS:
        family.add_metric((event,), float(counters.get(event, 0)))
    return family


def lora_families(live, labels: Callable, worker_labels: tuple[str, ...]) -> Iterator:
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                             labels=(*worker_labels, "max_lora", "waiting_lora_adapters", "running_lora_adapters"))
    loaded = GaugeMetricFamily("duet_lora_adapters_loaded", "LoRA adapters a worker holds in host memory (at most "
                               "its max_cpu_loras).", labels=worker_labels)
    evictions = CounterMetricFamily("duet_lora_slot_evictions", "Idle LoRA adapters a worker's device slots gave "
                                    "up (least recently used first) for an adapter a batch needed.",
                                    labels=worker_labels)
    for rec in live:
        lora = rec.stats.get("lora")
        if not lora:
            continue
        info.add_metric((*labels(rec), str(lora["max_loras"]), ",".join(lora["waiting_adapters"]),
                         ",".join(lora["running_adapters"])), lora["updated_unix_s"])
        loaded.add_metric(labels(rec), len(lora["loaded"]))
        evictions.add_metric(labels(rec), float(lora["evictions"]))
    yield from (info, loaded, evictions)
