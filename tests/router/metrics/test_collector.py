"""/metrics content (router/metrics/collector.py) parsed by prometheus-client's own parser: vLLM's names, types, help
and buckets where vLLM has the series; request timing counts equal to what was observed."""
from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from engine.histogram import ITL_BUCKETS_S, LATENCY_BUCKETS_S, NIXL_XFER_BUCKETS_S, TTFT_BUCKETS_S, Histogram
from engine.kv.events import WorkerLoad
from engine.outputs import RequestOutput
from router.metrics.collector import ClusterCollector, RouterMetrics
from router.routing.policy import Role
from router.workers.registry import WorkerRegistry

VLLM_TYPES = {  # vLLM 0.32's type per series family (as prometheus-client parses them)
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter", "vllm:request_success": "counter", "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:nixl_xfer_time_seconds": "histogram", "vllm:nixl_bytes_transferred": "histogram",
    "vllm:nixl_num_failed_transfers": "counter",
}


def out(n_tokens: int, finished: bool = False, reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", list(range(n_tokens)), "", finished, finish_reason=reason)


def registry_with_workers() -> WorkerRegistry:
    reg = WorkerRegistry()
    queue = Histogram(LATENCY_BUCKETS_S)
    queue.observe(0.4), queue.observe(2.0)
    xfer = Histogram(NIXL_XFER_BUCKETS_S)
    xfer.observe(0.02)
    for wid, role, stats in (
            ("prefill-0", Role.PREFILL, {"num_prompt_tokens": 300, "num_generated_tokens": 3, "num_preemptions": 1,
                                         "prefix_cache_queried_tokens": 300, "prefix_cache_hit_tokens": 128,
                                         "leases_expired": 2, "queue_time_s": queue.snapshot()}),
            ("decode-0", Role.DECODE, {"num_prompt_tokens": 0, "num_generated_tokens": 40, "transfers_failed": 1,
                                       "num_remote_recomputes": 1, "transfer_time_s": xfer.snapshot()})):
        reg.add(wid, role, 0.0)
        reg.mark_ready(wid, 0.0)
        reg.update_stats(wid, stats, 1.0)
        reg.update_load(WorkerLoad(worker=wid, role=role.value, running=2, waiting=1, kv_blocks_used=25,
                                   kv_blocks_total=100, queued_prefill_tokens=64), 1.0)
    return reg


def scrape(metrics: RouterMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def test_vllm_series_names_types_and_buckets():
    metrics = RouterMetrics("m", 8192)
    metrics.add_collector(ClusterCollector("m", registry_with_workers(), targets=lambda: {"prefill": 1, "decode": 1},
                                           feed_counters=lambda: {"gaps": 3, "resyncs": 4},
                                           pool_counters=lambda: {"replaced": 2},
                                           bounds=lambda: {"prefill": (1, 3), "decode": (2, 5)}))
    timing = metrics.request(10)
    timing.observe("prefill-0", "prefill", out(1))
    timing.observe("decode-0", "decode", out(1, True, "length"))
    families = scrape(metrics)
    for name, kind in VLLM_TYPES.items():
        assert name in families and families[name].type == kind, name
    ttft = families["vllm:time_to_first_token_seconds"]
    bounds = sorted({float(s.labels["le"]) for s in ttft.samples if s.name.endswith("_bucket")})
    assert bounds == [*TTFT_BUCKETS_S, float("inf")]
    itl = families["vllm:inter_token_latency_seconds"]
    assert sorted({float(s.labels["le"]) for s in itl.samples if s.name.endswith("_bucket")}) == [*ITL_BUCKETS_S,
                                                                                                  float("inf")]
    assert ttft.documentation == "Histogram of time to first token in seconds."
    sample = next(s for s in ttft.samples if s.name.endswith("_count"))
    assert sample.labels == {"model_name": "m", "engine": "prefill-0", "worker": "prefill-0", "role": "prefill"}
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}

    def value(name, **labels):
        return values[(name, tuple(sorted(labels.items())))]

    w = dict(model_name="m", engine="prefill-0", worker="prefill-0", role="prefill")
    assert value("vllm:prefix_cache_hits_total", **w) == 128 and value("vllm:num_preemptions_total", **w) == 1
    assert value("vllm:kv_cache_usage_perc", **w) == 0.25 and value("vllm:num_requests_running", **w) == 2
    assert value("vllm:nixl_num_kv_expired_reqs_total", **w) == 2 and value("duet_lease_expiries_total", **w) == 2
    assert value("vllm:request_queue_time_seconds_count", **w) == 2
    assert value("vllm:request_queue_time_seconds_bucket", le="0.5", **w) == 1
    d = dict(w, engine="decode-0", worker="decode-0", role="decode")
    assert value("vllm:nixl_xfer_time_seconds_count", **d) == 1 and value("duet_kv_recomputes_total", **d) == 1
    assert value("vllm:request_success_total", finished_reason="length", **d) == 1
    assert value("duet_workers", role="prefill", state="ready") == 1 and value("duet_workers_target", role="decode") == 1
    assert value("duet_event_gaps_total") == 3 and value("duet_event_resyncs_total") == 4
    assert value("duet_pool_actions_total", action="replaced") == 2
    assert value("duet_workers_min", role="decode") == 2 and value("duet_workers_max", role="prefill") == 3
    assert value("duet_pool_actions_total", action="drain_timeouts") == 0


def test_timing_counts_match_the_requests():
    """TTFT once per request, ITL once per token after the first, e2e and success once per request."""
    metrics = RouterMetrics("m", 1024)
    metrics.take_samples()  # the autoscaler's buffer exists from its first call on
    generated = [1, 5, 12]
    for n in generated:
        timing = metrics.request(20)
        timing.observe("prefill-0", "prefill", out(1))
        for i in range(n - 1):
            time.sleep(0.001)
            timing.observe("decode-0", "decode", out(1, finished=i == n - 2, reason="stop"))
        if n == 1:
            timing.observe("prefill-0", "prefill", out(0, True, "length"))
    aborted = metrics.request(7)
    aborted.observe("prefill-0", "prefill", out(1))
    aborted.finish("abort")
    aborted.finish("stop")  # counted once
    fam = scrape(metrics)
    total = {f: sum(s.value for s in fam[f].samples if s.name == f + "_count")
             for f in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                       "vllm:e2e_request_latency_seconds", "vllm:request_generation_tokens")}
    assert total["vllm:time_to_first_token_seconds"] == len(generated) + 1
    assert total["vllm:inter_token_latency_seconds"] == sum(n - 1 for n in generated)
    assert total["vllm:e2e_request_latency_seconds"] == len(generated) + 1
    reasons = {s.labels["finished_reason"]: s.value for s in fam["vllm:request_success"].samples
               if s.name == "vllm:request_success_total"}
    assert reasons == {"length": 1, "stop": 2, "abort": 1}
    samples = metrics.take_samples()
    assert sum(s.kind == "ttft" for s in samples) == 4 and metrics.take_samples() == []
    assert metrics.take_samples("dashboard") == []  # a new consumer starts from now
    assert metrics.finished == {"length": 1, "stop": 2, "abort": 1} and metrics.num_tokens == sum(generated) + 1


def test_kv_tier_capacity_usage_index_blocks_and_unreported_tiers():
    from engine.kv.events import Tier, TierUsage

    reg = registry_with_workers()
    reg.update_load(WorkerLoad("prefill-0", "prefill", 0, 0, 25, 100, 0,
                               (TierUsage(Tier.HOST, 800, 120), TierUsage(Tier.DISK, 9000, 640))), 2.0)
    metrics = RouterMetrics("m", 8192)
    metrics.add_collector(ClusterCollector(
        "m", reg, feed_counters=lambda: {"unreported_tiers": 7},
        index_blocks=lambda: {("prefill-0", Tier.DEVICE): 20, ("prefill-0", Tier.HOST): 110}))
    families = scrape(metrics)
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    w = dict(model_name="m", engine="prefill-0", worker="prefill-0", role="prefill")

    def value(name, **labels):
        return values[(name, tuple(sorted(labels.items())))]

    assert families["duet_kv_tier_capacity_blocks"].type == "gauge"
    assert [value("duet_kv_tier_capacity_blocks", tier=t, **w) for t in ("device", "host", "disk")] == [100, 800, 9000]
    assert [value("duet_kv_tier_used_blocks", tier=t, **w) for t in ("device", "host", "disk")] == [25, 120, 640]
    d = dict(w, engine="decode-0", worker="decode-0", role="decode")  # reported no lower tier: device only
    assert value("duet_kv_tier_capacity_blocks", tier="device", **d) == 100
    assert ("duet_kv_tier_capacity_blocks", tuple(sorted(dict(d, tier="host").items()))) not in values
    assert families["duet_kv_tier_unreported"].type == "counter"
    assert value("duet_kv_tier_unreported_total") == 7
    assert value("duet_kv_index_blocks", worker="prefill-0", tier="host") == 110


def test_kv_offload_and_hit_source_series_from_worker_stats():
    reg = registry_with_workers()
    tiers = {"bytes": {"device_to_host": 7e6, "host_to_device": 3e6, "host_to_disk": 1e6, "disk_to_host": 5e5},
             "seconds": {"device_to_host": 0.5, "host_to_device": 0.25, "host_to_disk": 0.125, "disk_to_host": 0.0625},
             "stores_skipped": 3, "store_failures": {"host": 0, "disk": 4}, "load_failures": 2}
    reg.update_stats("prefill-0", {**reg.get("prefill-0").stats, "kv_tiers": tiers, "num_peer_import_failures": 1,
                                   "prefix_hit_tokens_by_source": {"device": 128, "host": 64, "disk": 32,
                                                                   "peer": 16}}, 2.0)
    metrics = RouterMetrics("m", 8192)
    metrics.add_collector(ClusterCollector("m", reg, peer_fetches=lambda: {"lent": 5, "gone": 1, "failed": 2}))
    families = scrape(metrics)
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    w = dict(model_name="m", engine="prefill-0", worker="prefill-0", role="prefill")

    def value(name, **labels):
        return values[(name, tuple(sorted(labels.items())))]

    assert families["vllm:kv_offload_total_bytes"].type == "counter"
    assert value("vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU", **w) == 7e6
    assert value("vllm:kv_offload_total_bytes_total", transfer_type="DISK_to_CPU", **w) == 5e5
    assert value("vllm:kv_offload_total_time_total", transfer_type="CPU_to_GPU", **w) == 0.25
    assert value("vllm:kv_offload_stores_skipped_total", **w) == 3
    assert value("duet_kv_tier_store_failures_total", tier="disk", **w) == 4
    assert value("duet_kv_tier_load_failures_total", **w) == 2
    assert [value("duet_prefix_hit_tokens_total", source=s, **w) for s in ("device", "host", "disk", "peer")] == [
        128, 64, 32, 16]
    assert value("duet_peer_import_failures_total", **w) == 1
    assert [value("duet_peer_fetches_total", outcome=o) for o in ("lent", "gone", "failed")] == [5, 1, 2]
    d = dict(w, engine="decode-0", worker="decode-0", role="decode")  # a worker without tiers has none of these
    assert ("vllm:kv_offload_total_bytes_total", tuple(sorted(dict(d, transfer_type="GPU_to_CPU").items()))) \
        not in values


def test_spec_decode_series_from_worker_stats():
    """vLLM's speculative decoding counters (vllm/v1/spec_decode/metrics.py names, per-position label
    ``position``) for a worker that speculates; none for one that does not."""
    reg = registry_with_workers()
    spec = {"method": "ngram", "num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 22,
            "num_accepted_tokens_per_pos": [9, 7, 4, 2]}
    reg.update_stats("decode-0", {**reg.get("decode-0").stats, "spec_decode": spec}, 2.0)
    metrics = RouterMetrics("m", 8192)
    metrics.add_collector(ClusterCollector("m", reg))
    families = scrape(metrics)
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    d = dict(model_name="m", engine="decode-0", worker="decode-0", role="decode")

    def value(name, **labels):
        return values[(name, tuple(sorted(labels.items())))]

    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
        assert families[f"vllm:spec_decode_{name}"].type == "counter"
    assert value("vllm:spec_decode_num_drafts_total", **d) == 10
    assert value("vllm:spec_decode_num_draft_tokens_total", **d) == 40
    assert value("vllm:spec_decode_num_accepted_tokens_total", **d) == 22
    assert [value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(j), **d)
            for j in range(4)] == [9, 7, 4, 2]
    assert not [k for k in values if k[0].startswith("vllm:spec_decode") and ("worker", "prefill-0") in k[1]]


def test_weight_bytes_per_worker_kind_and_format():
    """duet_weight_bytes from each worker's summary (its WorkerInfo, kept in its descriptor): one series per kind and
    format (two kernels of one kind and format summed); a worker without a summary, or not yet answering, has none."""
    from types import SimpleNamespace

    from engine.loading.weights_summary import WeightGroup, WeightsSummary

    summary = WeightsSummary((WeightGroup("embedding", "Q8_0 packed", "C rows", 1000, 1),
                              WeightGroup("mlp down", "Q4_1 packed", "C GEMV", 300, 2),
                              WeightGroup("mlp down", "Q4_1 packed", "torch reference", 200, 1),
                              WeightGroup("lm_head", "Q8_0 packed", "C GEMV", 0, 1, shared_bytes=1000)), "cpu", "eager")
    reg = registry_with_workers()
    reg.get("decode-0").client = SimpleNamespace(descriptor=SimpleNamespace(weights=summary))
    reg.get("prefill-0").client = SimpleNamespace(descriptor=SimpleNamespace(weights=None))
    reg.add("decode-1", Role.DECODE, 0.0)  # starting: no client yet
    metrics = RouterMetrics("m", 8192)
    metrics.add_collector(ClusterCollector("m", reg))
    family = scrape(metrics)["duet_weight_bytes"]
    assert family.type == "gauge"
    got = {(s.labels["worker"], s.labels["kind"], s.labels["format"]): s.value for s in family.samples}
    assert got == {("decode-0", "embedding", "Q8_0 packed"): 1000, ("decode-0", "mlp down", "Q4_1 packed"): 500,
                   ("decode-0", "lm_head", "Q8_0 packed"): 0}
    assert sum(got.values()) == summary.weight_bytes
    assert all(s.labels["role"] == "decode" and s.labels["model_name"] == "m" for s in family.samples)


def test_cache_config_info_per_worker_under_vllms_labels():
    """vllm:cache_config_info: an info gauge (value 1) per worker whose stats carry its KV cache's configuration, the
    facts as vLLM's CacheConfig label names (string values): here a mixed-precision pair, an fp32 prefill worker with a
    host tier and an int8 decode worker."""
    reg = registry_with_workers()
    reg.update_stats("prefill-0", {"kv_cache": {"cache_dtype": "auto", "storage": "float32", "block_size": 16,
                                                "num_gpu_blocks": 100, "num_cpu_blocks": 400,
                                                "enable_prefix_caching": True, "bytes_per_block": 8192}}, 2.0)
    reg.update_stats("decode-0", {"kv_cache": {"cache_dtype": "int8", "storage": "int8", "block_size": 16,
                                               "num_gpu_blocks": 320, "num_cpu_blocks": 0,
                                               "enable_prefix_caching": True, "bytes_per_block": 2560}}, 2.0)
    reg.add("decode-1", Role.DECODE, 0.0)  # starting: no stats, no series
    metrics = RouterMetrics("m", 8192)
    metrics.add_collector(ClusterCollector("m", reg))
    family = scrape(metrics)["vllm:cache_config_info"]
    assert family.type == "gauge" and family.documentation == "Information of the LLMEngine CacheConfig"
    got = {s.labels["worker"]: s for s in family.samples}
    assert sorted(got) == ["decode-0", "prefill-0"] and all(s.value == 1 for s in got.values())
    assert got["decode-0"].labels == {"model_name": "m", "engine": "decode-0", "worker": "decode-0", "role": "decode",
                                      "block_size": "16", "cache_dtype": "int8", "enable_prefix_caching": "True",
                                      "num_cpu_blocks": "0", "num_gpu_blocks": "320"}
    assert (got["prefill-0"].labels["cache_dtype"], got["prefill-0"].labels["num_cpu_blocks"]) == ("auto", "400")
