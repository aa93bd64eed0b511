"""``vllm:cache_config_info``: each live worker's KV cache configuration as an info gauge (value 1, the facts in its
labels), as vLLM's PrometheusStatLogger renders its ``CacheConfig.metrics_info()`` — same name, help text and label
names where duet has the setting: ``block_size``, ``cache_dtype`` (the ``kv_cache_dtype`` name: ``auto``, ``int8``,
``fp8_e4m3``, ``fp8_e5m2``), ``enable_prefix_caching``, ``num_gpu_blocks`` (the device cache's blocks, on a CPU
engine too), ``num_cpu_blocks`` (the host KV tier's slots; 0 without one), and ``engine`` (duet: the worker id),
all strings as in vLLM; plus duet's ``worker`` / ``role`` / ``model_name``. From the ``kv_cache`` entry of the worker's
stats() (prefill_worker/engine_facts.py ``cache_config``); a worker that has not reported one yet has no series."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import GaugeMetricFamily

CACHE_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "num_cpu_blocks", "num_gpu_blocks")


def cache_config_family(live, labels: Callable, worker_labels: tuple[str, ...]) -> GaugeMetricFamily:
    """One series per worker (``labels(rec)``: a record's worker label values), value 1."""
    family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                               labels=(*worker_labels, *CACHE_LABELS))
    for rec in live:
        kv = rec.stats.get("kv_cache")
        if kv is not None:
            family.add_metric((*labels(rec), *(str(kv[k]) for k in CACHE_LABELS)), 1.0)
    return family
