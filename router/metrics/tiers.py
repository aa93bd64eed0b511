"""/metrics families of the KV tiers and the cluster pool, rendered from the workers' ``stats()`` snapshots
(prefill_worker/engine_facts.py ``tier_stats``) and the router's peer-borrowing counters. vLLM's offload names where
vLLM has the series (``vllm:kv_offload_*``, its ``transfer_type`` label), ``duet_`` for the rest; docs/operating.md
"KV tiers and the cluster pool" lists them."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily

# our mover's directions -> vLLM's transfer_type values (its CPU offloading says GPU for the device tier, CPU for
# host memory; the device tier of a CPU engine is named GPU_ too, so one board reads both)
TRANSFER_TYPES = {"device_to_host": "GPU_to_CPU", "host_to_device": "CPU_to_GPU", "host_to_disk": "CPU_to_DISK",
                  "disk_to_host": "DISK_to_CPU"}
HIT_SOURCES = ("device", "host", "disk", "peer")


def tier_families(live, labels: Callable, worker_labels: tuple[str, ...],
                  peer_fetches: Mapping[str, int]) -> Iterator:
    """Counter families for ``live`` worker records (``labels(rec)`` gives each one's label values)."""
    moved = CounterMetricFamily("vllm:kv_offload_total_bytes", "Bytes of KV blocks moved between tiers.",
                                labels=(*worker_labels, "transfer_type"))
    seconds = CounterMetricFamily("vllm:kv_offload_total_time", "Seconds spent moving KV blocks between tiers.",
                                  labels=(*worker_labels, "transfer_type"))
    skipped = CounterMetricFamily("vllm:kv_offload_stores_skipped", "Blocks not written through to the host tier "
                                  "because every host slot was pinned or being written.", labels=worker_labels)
    store_failures = CounterMetricFamily("duet_kv_tier_store_failures", "Copies to a lower tier that failed (a full "
                                         "or unwritable disk): the block is not on that tier.",
                                         labels=(*worker_labels, "tier"))
    load_failures = CounterMetricFamily("duet_kv_tier_load_failures", "Blocks whose load from a lower tier failed or "
                                        "whose disk file did not check out: recomputed, the copy dropped.",
                                        labels=worker_labels)
    hits = CounterMetricFamily("duet_prefix_hit_tokens", "Prompt tokens whose KV was not computed, by where it "
                               "came from: the device tier, a lower tier, or a peer worker.",
                               labels=(*worker_labels, "source"))
    import_failures = CounterMetricFamily("duet_peer_import_failures", "Prefix blocks lent by a peer that could not "
                                          "be read (peer gone, timeout): recomputed.", labels=worker_labels)
    for rec in live:
        values = labels(rec)
        for source, n in rec.stats.get("prefix_hit_tokens_by_source", {}).items():
            hits.add_metric((*values, source), float(n))
        if "num_peer_import_failures" in rec.stats:
            import_failures.add_metric(values, float(rec.stats["num_peer_import_failures"]))
        tiers = rec.stats.get("kv_tiers")
        if not tiers:
            continue
        for direction, n in tiers["bytes"].items():
            moved.add_metric((*values, TRANSFER_TYPES[direction]), float(n))
            seconds.add_metric((*values, TRANSFER_TYPES[direction]), float(tiers["seconds"][direction]))
        skipped.add_metric(values, float(tiers["stores_skipped"]))
        for tier, n in tiers["store_failures"].items():
            store_failures.add_metric((*values, tier), float(n))
        load_failures.add_metric(values, float(tiers["load_failures"]))
    yield from (moved, seconds, skipped, store_failures, load_failures, hits, import_failures)
    fetches = CounterMetricFamily("duet_peer_fetches", "Prefix blocks the router asked a peer prefill worker to "
                                  "lend, by outcome: lent, gone (it no longer held them), failed (no answer in "
                                  "time, or it died): then the prompt is computed.", labels=("outcome",))
    for outcome in ("lent", "gone", "failed"):
        fetches.add_metric((outcome,), float(peer_fetches.get(outcome, 0)))
    yield fetches
