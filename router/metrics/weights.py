"""``duet_weight_bytes``: each live worker's resident model weights by layer kind and storage format, from the summary
its engine made after load (engine/loading/resident.py) and announced in its ``WorkerInfo`` (the router keeps it in the
worker's ``WorkerDescriptor``). Static per worker: it changes only when a worker is replaced or reloaded."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import GaugeMetricFamily


def weight_family(live, labels: Callable, worker_labels: tuple[str, ...]) -> GaugeMetricFamily:
    """One series per worker, kind and format (``labels(rec)``: a record's worker label values); groups of one kind
    and format run by different kernels are summed. A worker whose client carries no summary has no series."""
    family = GaugeMetricFamily("duet_weight_bytes", "Bytes of model weights a worker holds, by layer kind "
                               "(embedding, attention qkv, mlp down, ...) and storage format (Q4_1 packed, float32 "
                               "dense, ...); a tensor two kinds share (a tied LM head) is counted once.",
                               labels=(*worker_labels, "kind", "format"))
    for rec in live:
        weights = rec.client.descriptor.weights if rec.client is not None else None
        if weights is None:
            continue
        by_kind: dict[tuple[str, str], int] = {}
        for g in weights.groups:
            by_kind[(g.kind, g.format)] = by_kind.get((g.kind, g.format), 0) + g.num_bytes
        for (kind, fmt), n in by_kind.items():
            family.add_metric((*labels(rec), kind, fmt), n)
    return family
