"""/metrics: one Prometheus scrape target for the whole cluster, served by the router.

Where vLLM has a series duet uses its exact name, type, help text, buckets and labels (``model_name``,
``engine``), so dashboards, KEDA rules and llm-d's autoscaler written for vLLM work unchanged; duet adds
``worker`` and ``role`` (``engine`` carries the worker id too). duet's own series are named ``duet_*``.

Two sources, one registry per router (never the process-global one):
- what the router measures itself, per request, as the client sees it (``RouterMetrics``): time to first
  token, inter-token latency (one sample per token after the first), end-to-end latency, finished
  requests by reason, tokens per request; routing decisions; autoscaler decisions. Latency samples are
  also kept for the autoscaler, which drains them once per interval (``take_samples``).
- what the workers report (``ClusterCollector``, rendered at scrape time from the worker registry): load
  gauges from the KV event plane, cumulative counters and histograms from each worker's ``stats()``
  (tokens, prefix cache, preemptions, queue time, NIXL transfers, lease expiries, recomputes), pool sizes,
  targets and event-plane gaps.
"""
from __future__ import annotations

import collections
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from engine.histogram import ITL_BUCKETS_S, LATENCY_BUCKETS_S, TTFT_BUCKETS_S, token_buckets
from engine.outputs import RequestOutput
from router.metrics.cache_config import cache_config_family
from router.metrics.lora import adapter_events_family, lora_families
from router.metrics.speculative import spec_families
from router.metrics.tiers import tier_families
from router.metrics.weights import weight_family
from router.workers.registry import LIVE_STATES, WorkerRegistry, tier_usage

WORKER_LABELS = ("model_name", "engine", "worker", "role")
FINISHED_REASONS = ("stop", "length", "abort", "error")
LIFECYCLE_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
SAMPLE_WINDOW = 100_000  # latency samples kept for the autoscaler between two of its intervals


@dataclass(frozen=True)
class LatencySample:
    t_s: float  # time.monotonic() when observed
    kind: str  # "ttft" | "itl" | "ttft_queue" | "ttft_compute" | "ttft_router" (TTFT's parts)
    worker: str
    value_s: float
    prompt_tokens: int = 0  # the request's (a TTFT's target grows with it: autoscaler.ttft_slo_per_token_s)


class RouterMetrics:
    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, labels = self.registry, WORKER_LABELS
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=LATENCY_BUCKETS_S, registry=r)
        tokens = token_buckets(max_model_len)
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                       labels, buckets=tokens, registry=r)
        self.generation_tokens = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           labels, buckets=tokens, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               (*labels, "finished_reason"), registry=r)
        self.routing = Counter("duet_routing_decisions", "Routing decisions by role, policy and outcome "
                               "(disaggregated, local_prefill, placed_again, no_workers).",
                               ("role", "policy", "outcome"), registry=r)
        self.lora_placements = Counter("duet_lora_placements", "Requests for a LoRA adapter placed in a pool, by role "
                                       "and outcome: ready (routed among the workers whose slots can run the adapter "
                                       "now), all_busy (no worker could: routed among all, it waits for a slot).",
                                       ("role", "outcome"), registry=r)
        self.migrations = Counter("duet_migrations", "Requests continued on another worker after theirs died "
                                  "mid-stream, by the role of the worker that died.", ("role",), registry=r)
        self.ttft_parts = Histogram("duet_ttft_part_seconds", "Time to first token split into its parts: the "
                                    "engine's queue (arrival to first scheduled), its compute (to the first token) "
                                    "and the router's rest (admission, dispatch, network).", ("part",),
                                    buckets=TTFT_BUCKETS_S, registry=r)
        self.autoscaler = Counter("duet_autoscaler_decisions", "Autoscaler decisions that changed a target, "
                                  "by role, direction and reason.", ("role", "direction", "reason"), registry=r)
        self.role_flips = Counter("duet_role_flips", "Workers flipped between pools in place, by outcome: ok, failed "
                                  "(stopped; the pool starts one), fallback (drain + start instead, logged with why).",
                                  ("from_role", "to_role", "outcome"), registry=r)
        self.role_flip_time = Histogram("duet_role_flip_seconds", "Role flips, from the worker idle to it ready in "
                                        "its new role.", ("from_role", "to_role"), buckets=LIFECYCLE_BUCKETS_S,
                                        registry=r)
        self.tool_requests = Counter("duet_tool_requests", "Chat requests with tools, by the format their calls are "
                                     "written in (generic: the model's chat template has no tool format and duet's "
                                     "JSON format stands in, a fallback) and tool_choice mode (auto_strict: strict "
                                     "tools enforced by a grammar; auto_strict_parsed: a format duet cannot enforce "
                                     "them in, parsed only, a fallback).", ("format", "mode"),
                                     registry=r)
        self.tool_calls_dropped = Counter("duet_tool_calls_dropped", "Tool calls a chat response did not return, by "
                                          "format and reason: repeat (identical to an earlier call of the turn; in a "
                                          "grammar-held list the grammar ended the list there), unfinished (the output "
                                          "ended inside it, e.g. max_tokens), extra (parallel_tool_calls false).",
                                          ("format", "reason"), registry=r)
        self.cold_start_time = Histogram("duet_worker_cold_start_seconds", "Workers started, from the actor spawned "
                                         "to it ready (model loaded, handshakes done).", ("role",),
                                         buckets=LIFECYCLE_BUCKETS_S, registry=r)
        self._buffers: dict[str, deque[LatencySample]] = {}  # one per consumer (autoscaler, dashboard, ...)
        self.finished: collections.Counter[str] = collections.Counter()  # requests by finish reason
        self.num_tokens = 0  # generated tokens the clients received

    def labels(self, worker: str, role: str) -> tuple[str, ...]:
        return (self.model_name, worker, worker, role)

    def request(self, num_prompt_tokens: int) -> RequestTiming:
        return RequestTiming(self, num_prompt_tokens, time.monotonic())

    def take_samples(self, consumer: str = "autoscaler") -> list[LatencySample]:
        """Latency samples since ``consumer``'s last call (each consumer has its own buffer, made on first use)."""
        buffer = self._buffers.setdefault(consumer, deque(maxlen=SAMPLE_WINDOW))
        out = list(buffer)
        buffer.clear()
        return out

    def _sample(self, sample: LatencySample) -> None:
        for buffer in self._buffers.values():
            buffer.append(sample)

    def add_collector(self, collector) -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTiming:
    """One request's timeline as the router sees it; ``observe`` every output with the worker that sent it."""

    def __init__(self, metrics: RouterMetrics, num_prompt_tokens: int, start_s: float) -> None:
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.start_s = start_s
        self.last_s: float | None = None  # time of the latest token
        self.num_tokens = 0
        self.last_worker: tuple[str, str] = ("", "")
        self.done = False

    def observe(self, worker: str, role: str, out: RequestOutput) -> None:
        if self.done:
            return
        m, now = self.metrics, time.monotonic()
        labels = m.labels(worker, role)
        n = len(out.new_token_ids)
        if n:
            if self.last_s is None:
                m.ttft.labels(*labels).observe(now - self.start_s)
                m._sample(LatencySample(now, "ttft", worker, now - self.start_s, self.num_prompt_tokens))
                if out.ttft_parts:
                    queue, compute = out.ttft_parts.get("queue_s", 0.0), out.ttft_parts.get("compute_s", 0.0)
                    for part, value in (("queue", queue), ("compute", compute),
                                        ("router", max(0.0, now - self.start_s - queue - compute))):
                        m.ttft_parts.labels(part).observe(value)
                        m._sample(LatencySample(now, f"ttft_{part}", worker, value))
                gaps = [0.0] * (n - 1)
            else:
                gaps = [(now - self.last_s) / n] * n
            for gap in gaps:
                m.itl.labels(*labels).observe(gap)
                m._sample(LatencySample(now, "itl", worker, gap))
            self.last_s = now
            self.num_tokens += n
            m.num_tokens += n
        self.last_worker = (worker, role)
        if out.finished:
            self.finish(out.finish_reason or "stop", now)

    def finish(self, reason: str, now_s: float | None = None) -> None:
        """Count the request once: at its last output, or as an abort when the stream was left early."""
        if self.done:
            return
        self.done = True
        m = self.metrics
        labels = m.labels(*self.last_worker)
        now_s = time.monotonic() if now_s is None else now_s
        reason = reason if reason in FINISHED_REASONS else "stop"
        m.success.labels(*labels, reason).inc()
        m.finished[reason] += 1
        m.e2e.labels(*labels).observe(now_s - self.start_s)
        m.prompt_tokens.labels(*labels).observe(self.num_prompt_tokens)
        m.generation_tokens.labels(*labels).observe(self.num_tokens)


# ---------------------------------------------------------------------------------------------- workers

# vLLM name (without the _total a counter gets), help text, stats key
_WORKER_COUNTERS = (
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "num_prompt_tokens"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "num_generated_tokens"),
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queried_tokens"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hit_tokens"),
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
    ("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers, including handshake and "
     "notification failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
     "transfers_failed"),
    ("vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire. NOTE: This metric is tracked "
     "on the P instance.", "leases_expired"),
    ("duet_lease_expiries", "Prefill KV leases that expired before a decode worker pulled the blocks.",
     "leases_expired"),
    ("duet_kv_recomputes", "Requests whose KV transfer failed and whose prompt the decode worker recomputed.",
     "num_remote_recomputes"),
    ("duet_kv_transfers_past_lease", "Decode workers' KV pulls not started, or whose bytes were discarded, because "
     "the prefill worker's lease ran out first (its blocks may have been reused): the prompt is recomputed.",
     "transfers_past_lease"),
    ("duet_kv_transfer_errors", "Requests ended with an error because their KV transfer failed "
     "(transfer.recompute_on_failure: false).", "num_remote_failures"),
    ("duet_kv_transfers_skipped", "Handoffs the decode worker already held completely (nothing pulled).",
     "transfers_skipped_full_hit"),
    ("duet_kernel_fallbacks", "Slower kernel paths an engine took because a faster one failed: the torch reference "
     "kernels because the C ones could not be built or loaded, or eager decode because a CUDA graph capture "
     "failed (the worker's log says why).", "kernel_fallbacks"),
    ("duet_event_batches_undelivered", "KV event batches a worker could not publish to every sink (Redis down); "
     "it republishes its full cached set once the sink is back.", "events_undelivered"),
)
_WORKER_HISTOGRAMS = (
    ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", "queue_time_s"),
    ("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.", "transfer_time_s"),
    ("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.",
     "transfer_size_bytes"),
)


class ClusterCollector:
    """Renders the worker registry at scrape time (a prometheus_client custom collector)."""

    def __init__(self, model_name: str, registry: WorkerRegistry, *,
                 targets: Callable[[], Mapping[str, int]] = dict,
                 bounds: Callable[[], Mapping[str, tuple[int, int]]] = dict,
                 feed_counters: Callable[[], Mapping[str, int]] = dict,
                 pool_counters: Callable[[], Mapping[str, int]] = dict,
                 index_blocks: Callable[[], Mapping[tuple[str, str], int]] = dict,
                 peer_fetches: Callable[[], Mapping[str, int]] = dict,
                 lora_counters: Callable[[], Mapping[str, int]] = dict) -> None:
        self.model_name = model_name
        self.workers = registry
        self.targets = targets
        self.bounds = bounds
        self.feed_counters = feed_counters
        self.pool_counters = pool_counters
        self.index_blocks = index_blocks  # {(worker, tier): blocks}: PrefixIndex.block_counts
        self.peer_fetches = peer_fetches  # ClusterBackend.peer_fetches
        self.lora_counters = lora_counters  # LoraAdapters.counters

    def describe(self) -> list:
        return []  # families vary with the workers; nothing to pre-declare

    def collect(self) -> Iterator:
        live = self.workers.records(states=LIVE_STATES)
        yield from self._load_gauges(live)
        for name, doc, key in _WORKER_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=WORKER_LABELS)
            for rec in live:
                if key in rec.stats:
                    family.add_metric(self._labels(rec), float(rec.stats[key]))
            yield family
        for name, doc, key in _WORKER_HISTOGRAMS:
            family = HistogramMetricFamily(name, doc, labels=WORKER_LABELS)
            for rec in live:
                snap = rec.stats.get(key)
                if snap:
                    family.add_metric(self._labels(rec), cumulative_buckets(snap), sum_value=snap["sum"])
            yield family
        yield weight_family(live, self._labels, WORKER_LABELS)
        yield cache_config_family(live, self._labels, WORKER_LABELS)
        yield from tier_families(live, self._labels, WORKER_LABELS, self.peer_fetches())
        yield from spec_families(live, self._labels, WORKER_LABELS)
        yield from lora_families(live, self._labels, WORKER_LABELS)
        yield adapter_events_family(self.lora_counters())
        pools = GaugeMetricFamily("duet_workers", "Workers by role and lifecycle state.", labels=("role", "state"))
        for (role, state), n in sorted(self.workers.counts().items()):
            pools.add_metric((role.value, state.value), n)
        yield pools
        targets = GaugeMetricFamily("duet_workers_target", "Target pool size per role.", labels=("role",))
        for role, n in sorted(self.targets().items()):
            targets.add_metric((str(role),), n)
        yield targets
        low = GaugeMetricFamily("duet_workers_min", "Smallest size a pool may have (autoscaler bound).", labels=("role",))
        high = GaugeMetricFamily("duet_workers_max", "Largest size a pool may have (autoscaler bound).", labels=("role",))
        for role, (lo, hi) in sorted(self.bounds().items()):
            low.add_metric((str(role),), lo)
            high.add_metric((str(role),), hi)
        yield low
        yield high
        actions = CounterMetricFamily("duet_pool_actions", "Pool manager actions by kind: started, start_failures, "
                                      "start_waits_for_room (a start Ray had not placed after 20 s), "
                                      "drained, drain_timeouts, replaced (a dead worker), probe_misses (a failed "
                                      "health probe short of lifecycle.health_misses in a row), flipped, "
                                      "flip_failures, flip_fallbacks, drain_pull_first (decode workers told to "
                                      "admit a draining prefill worker's handoffs first).", labels=("action",))
        counts = self.pool_counters()
        for action in ("started", "start_failures", "start_waits_for_room", "drained", "drain_timeouts", "replaced",
                       "probe_misses", "flipped", "flip_failures", "flip_fallbacks", "drain_pull_first"):
            actions.add_metric((action,), float(counts.get(action, 0)))
        yield actions
        feed = self.feed_counters()
        for key, doc in (("gaps", "KV event-plane gaps (a worker's batch sequence skipped)."),
                         ("resyncs", "KV event-plane full-state resyncs applied."),
                         ("source_errors", "Failed reads of the shared Redis event stream (retried)."),
                         ("stream_resets", "Times the shared Redis event stream started over below the last "
                          "entry read (Redis lost its data); the router read it from 0.")):
            family = CounterMetricFamily(f"duet_event_{key}", doc)
            family.add_metric((), float(feed.get(key, 0)))
            yield family
        unreported = CounterMetricFamily("duet_kv_tier_unreported", "KV events applied for a lower tier whose "
                                         "capacity the worker never reported in its load (logged once per "
                                         "worker and tier).")
        unreported.add_metric((), float(feed.get("unreported_tiers", 0)))
        yield unreported
        indexed = GaugeMetricFamily("duet_kv_index_blocks", "Blocks the router's prefix index holds, per worker "
                                    "and KV tier.", labels=("worker", "tier"))
        for (worker, tier), n in sorted(self.index_blocks().items()):
            indexed.add_metric((worker, str(tier)), n)
        yield indexed

    def _load_gauges(self, live) -> Iterator:
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                    labels=WORKER_LABELS)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                    labels=WORKER_LABELS)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  labels=WORKER_LABELS)
        queued = GaugeMetricFamily("duet_queued_prefill_tokens", "Prompt tokens waiting to be prefilled.",
                                   labels=WORKER_LABELS)
        tier_labels = (*WORKER_LABELS, "tier")
        capacity = GaugeMetricFamily("duet_kv_tier_capacity_blocks", "KV blocks a worker's tier can hold (device: "
                                     "the paged cache; host, disk: as the worker reports them).", labels=tier_labels)
        used = GaugeMetricFamily("duet_kv_tier_used_blocks", "KV blocks in use on a worker's tier.",
                                 labels=tier_labels)
        for rec in live:
            load, labels = rec.load, self._labels(rec)
            if load is None:
                continue
            running.add_metric(labels, load.running)
            waiting.add_metric(labels, load.waiting)
            usage.add_metric(labels, load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0)
            queued.add_metric(labels, load.queued_prefill_tokens)
            for tier, blocks in tier_usage(load).items():
                capacity.add_metric((*labels, tier), blocks["blocks_total"])
                used.add_metric((*labels, tier), blocks["blocks_used"])
        yield from (running, waiting, usage, queued, capacity, used)

    def _labels(self, rec) -> tuple[str, ...]:
        return (self.model_name, rec.worker_id, rec.worker_id, rec.role.value)


def cumulative_buckets(snapshot: Mapping[str, Any]) -> list[tuple[str, float]]:
    """An engine.histogram snapshot as Prometheus buckets: ``[(le, cumulative count), ..., ("+Inf", count)]``."""
    out, running = [], 0
    for bound, n in zip([*snapshot["buckets"], float("inf")], snapshot["counts"]):
        running += n
        out.append((floatToGoString(bound), float(running)))
    return out



class AdmissionCollector:
    """The router's admission control (router/admission.py) on /metrics."""

    def __init__(self, admitted) -> None:
        self.admitted = admitted

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator:
        a = self.admitted
        running = GaugeMetricFamily("duet_requests_running", "Sequences admitted and generating.")
        running.add_metric((), a.running)
        queued = GaugeMetricFamily("duet_requests_queued", "Sequences waiting for an admission slot.")
        queued.add_metric((), a.queued)
        rejected = CounterMetricFamily("duet_admission_rejections", "Requests refused or cut short by admission "
                                       "control: overloaded (429), queue_timeouts (408), deadlines (504).",
                                       labels=("reason",))
        for reason in ("overloaded", "queue_timeouts", "deadlines"):
            rejected.add_metric((reason,), float(a.counters.get(reason, 0)))
        yield from (running, queued, rejected)
