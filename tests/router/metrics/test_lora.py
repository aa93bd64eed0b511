"""vllm:lora_requests_info as vLLM writes it (router/metrics/lora.py), parsed by prometheus-client's own parser: one
series per worker with LoRA, its value the time the worker took the figures, the adapters joined by commas."""
from __future__ import annotations

from router.metrics.collector import ClusterCollector, RouterMetrics
from router.routing.policy import Role
from tests.router.metrics.test_collector import registry_with_workers, scrape


def _lora(running, waiting, at):
    return {"lora": {"max_loras": 2, "max_cpu_loras": 4, "loaded": ["a", "b", "c"], "slots": {"a": 0, "b": 1},
                     "pinned": [], "slot_writes": 5, "evictions": 3, "running_adapters": running,
                     "waiting_adapters": waiting, "updated_unix_s": at}}


def test_lora_requests_info_per_worker():
    reg = registry_with_workers()
    reg.update_stats("decode-0", _lora(["a", "b"], ["c"], 1_700_000_123.5), 2.0)
    reg.update_stats("prefill-0", _lora([], [], 1_700_000_100.0), 2.0)
    reg.add("decode-1", Role.DECODE, 0.0)  # starting: no stats, no series
    metrics = RouterMetrics("m", 8192)
    metrics.add_collector(ClusterCollector("m", reg))
    families = scrape(metrics)
    info = families["vllm:lora_requests_info"]
    assert info.type == "gauge" and info.documentation == "Running stats on lora requests."
    got = {s.labels["worker"]: s for s in info.samples}
    assert sorted(got) == ["decode-0", "prefill-0"]
    assert got["decode-0"].labels == {"model_name": "m", "engine": "decode-0", "worker": "decode-0", "role": "decode",
                                      "max_lora": "2", "waiting_lora_adapters": "c", "running_lora_adapters": "a,b"}
    assert got["decode-0"].value == 1_700_000_123.5
    idle = got["prefill-0"].labels
    assert (idle["running_lora_adapters"], idle["waiting_lora_adapters"]) == ("", "")
    assert {s.labels["worker"]: s.value for s in families["duet_lora_adapters_loaded"].samples} == {
        "decode-0": 3, "prefill-0": 3}
    assert [s.value for s in families["duet_lora_slot_evictions"].samples if s.name.endswith("_total")] == [3, 3]
