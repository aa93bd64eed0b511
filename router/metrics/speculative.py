"""/metrics families of speculative decoding, under vLLM's names (its ``vllm/v1/spec_decode/metrics.py``), rendered
from the workers' ``stats()`` snapshots (prefill_worker/engine_facts.py ``spec_stats``): drafts verified (one per
sequence and step with at least one draft), draft tokens, accepted tokens, and accepted tokens per draft position
(label ``position``, 0-based). The mean acceptance length is 1 + accepted / drafts; the acceptance rate is
accepted / draft tokens."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily

_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "num_accepted_tokens"),
)


def spec_families(live, labels: Callable, worker_labels: tuple[str, ...]) -> Iterator:
    """Counter families for the ``live`` worker records that speculate (``labels(rec)``: each one's values)."""
    speculating = [(rec, rec.stats["spec_decode"]) for rec in live if rec.stats.get("spec_decode")]
    for name, doc, key in _COUNTERS:
        family = CounterMetricFamily(name, doc, labels=worker_labels)
        for rec, st in speculating:
            family.add_metric(labels(rec), float(st[key]))
        yield family
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft's position.", labels=(*worker_labels, "position"))
    for rec, st in speculating:
        for position, n in enumerate(st["num_accepted_tokens_per_pos"]):
            per_pos.add_metric((*labels(rec), str(position)), float(n))
    yield per_pos
