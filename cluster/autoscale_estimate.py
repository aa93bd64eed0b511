"""How many workers each role needs: demand over capacity, both measured from the observation history.

    est = estimate(history, config)      # Estimate(prefill=RoleNeed, decode=RoleNeed)

Pure (no clock, no I/O): the autoscaler's policy (cluster/autoscaler.py) calls it on the same history it
judges, so a replayed history gives the same estimates.

Prefill (compute-bound): demand = uncached prompt tokens that arrived needing a prefill, per second (the
router counts them as it routes, whether or not a prefill worker exists), plus the prefill workers' queued
tokens over the TTFT target or the estimate's window if longer (``backlog_horizon_s``); capacity = prompt tokens a
prefill worker computes per busy second, learned from the history (``prefill_tokens_per_s`` is the prior
until a prefill worker has been busy), derated to ``prefill_target_utilization`` so bursts still meet the
TTFT target. Demand is the *largest* of the last ``estimate_window`` intervals: the trace's arrivals come in
bursts, and a pool sized for the mean misses the TTFT target on every burst.

Decode (memory-bound): its load is every sequence that decodes or waits to — running and waiting on the
decode workers, handoffs waiting there for free blocks, *and* the requests whose prompt KV prefill workers
hold under a lease on decode's behalf (their blocks stay pinned there until decode pulls them: the decode
backlog shows up on prefill workers, which is where the old policy mistook it for prefill pressure).
Two capacities per decode worker, the tighter one binds:
- sequences at the ITL target: a line ``step_s = a + b * batch`` fitted to the decode workers' (mean batch,
  mean step time) per interval over the history, solved for ``itl_slo_s * itl_target_fraction``; the prior
  ``decode_running_high`` until the points span enough batch sizes to fit;
- KV blocks: ``decode_kv_target_usage`` (0.95) of a worker's blocks, against the blocks the load holds (decode's
  used blocks + the blocks prefill workers hold for decode while decode backs up: ``kv_blocks_needed``). Not
  ``decode_kv_usage_high`` (0.8, the reactive threshold): KV is room, not throughput — a cache at 0.9 serves as
  fast as one at 0.5 — and sized at 0.8 a decode worker at 91 % read as 1.14 workers of load, so the H100 model
  at budget 4 moved 3P+1D → 2P+2D on a short KV peak and starved prefill (docs/simulator.md e).
Both loads are weighed with the forecast from the arrivals (cluster/autoscale_forecast.py) when the observer
reports them: the steady state the arrivals ask for, plus the measured backlog beyond it only as far as it must
be worked off within ``backlog_horizon_s`` — the forecast leads the backlog when outputs grow, and a KV peak
that decode works off in seconds no longer reads as a worker of load.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.autoscale_forecast import decode_forecast, fit_line

LEARN_INTERVALS = 32  # capacities are learned from the last this many observations


BASIS_SIGNALS = {"prefill_tokens": ("prefill_demand_tokens_per_s", "prefill_capacity_tokens_per_s"),
                 "decode_seqs": ("decode_backlog_seqs", "decode_seq_capacity"),
                 "decode_kv_blocks": ("decode_kv_blocks_needed", "decode_kv_capacity_blocks")}
WEIGHED = {"decode_seqs": ("decode_seqs_load", "decode_forecast_seqs"),  # the backlog with the forecast
           "decode_kv_blocks": ("decode_kv_blocks_load", "decode_forecast_blocks")}  # (autoscale_forecast.py)


@dataclass(frozen=True)
class RoleNeed:
    """One role's load in worker units: ``load`` = demand / per-worker capacity (None: not measurable yet)."""

    load: float | None
    demand: float | None
    capacity: float | None
    basis: str  # what bound it ("prefill_tokens", "decode_seqs", "decode_kv_blocks", "unknown")
    signals: dict[str, float | None] = field(default_factory=dict)

    @property
    def workers(self) -> int | None:
        """Whole workers that carry ``load`` (0 for no load)."""
        return None if self.load is None else math.ceil(self.load - 1e-9)

    def explain(self) -> str:
        """The load as the signals it was computed from, by their names: a decision's reason quotes it."""
        if self.load is None or self.capacity is None:
            return "not measured yet"
        demand, capacity = BASIS_SIGNALS[self.basis]
        learned = {"prefill_tokens": "prefill_capacity_learned"}.get(self.basis, "decode_seq_capacity_learned")
        prior = "" if self.basis == "decode_kv_blocks" or self.signals.get(learned) else " (the prior)"
        derated = " x prefill_target_utilization" if self.basis == "prefill_tokens" else ""
        measured = self.signals.get(demand, self.demand)
        if self.basis in WEIGHED and self.signals.get(WEIGHED[self.basis][1]) is not None:
            load, steady = WEIGHED[self.basis]
            return (f"{load} {self.demand:.3g} ({demand} {measured:.3g}, {steady} {self.signals[steady]:.3g}, "
                    f"decode_backlog_share {self.signals['decode_backlog_share']:.2f}) over {capacity} "
                    f"{self.capacity:.3g}{prior}")
        return f"{demand} {self.demand:.3g} over {capacity} {self.capacity:.3g}{prior}{derated}"


@dataclass(frozen=True)
class Estimate:
    prefill: RoleNeed
    decode: RoleNeed


def interval_of(history: Sequence, i: int, default_s: float) -> float:
    return history[i].t_s - history[i - 1].t_s if i > 0 and history[i].t_s > history[i - 1].t_s else default_s


def estimate(history: Sequence, cfg, *, upto: int | None = None) -> Estimate:
    """The estimate as of observation ``upto`` (default: the latest), from the observations up to it."""
    hist = list(history)[: (len(history) if upto is None else upto + 1)][-LEARN_INTERVALS:]
    return Estimate(_prefill(hist, cfg), _decode(hist, cfg))


def backlog_horizon_s(cfg) -> float:
    """Seconds a prefill backlog is sized to be worked off in: the TTFT target, but no less than the estimate's
    window — the pools change no faster than that, and a backlog over the TTFT target alone sizes the pool for a
    queue that is gone by the time its new workers are ready (an overshoot that the other role pays for)."""
    return max(cfg.ttft_slo_s, cfg.interval_s * cfg.estimate_window)


def _prefill(hist: Sequence, cfg) -> RoleNeed:
    if not hist:
        return RoleNeed(None, None, None, "unknown")
    window = range(max(0, len(hist) - cfg.estimate_window), len(hist))
    arriving = max(hist[i].prefill_tokens_arrived / interval_of(hist, i, cfg.interval_s) for i in window)
    backlog = sum(s.queued_prefill_tokens for s in hist[-1].prefill) / backlog_horizon_s(cfg)
    demand = arriving + backlog
    tokens = sum(s.prefill_tokens for o in hist for s in o.prefill if s.warm)
    busy = sum(s.busy_s for o in hist for s in o.prefill if s.warm)
    learned = tokens / busy if busy >= cfg.interval_s * 0.5 and tokens > 0 else None
    capacity = learned if learned is not None else cfg.prefill_tokens_per_s
    signals = {"prefill_demand_tokens_per_s": demand, "prefill_backlog_tokens_per_s": backlog,
               "prefill_capacity_tokens_per_s": capacity,
               "prefill_capacity_learned": float(learned is not None)}
    if capacity is None:
        return RoleNeed(None if demand > 0 else 0.0, demand, None, "unknown", signals)
    load = demand / (capacity * cfg.prefill_target_utilization)
    signals["prefill_load_workers"] = load
    return RoleNeed(load, demand, capacity, "prefill_tokens", signals)


def _decode(hist: Sequence, cfg) -> RoleNeed:
    if not hist:
        return RoleNeed(None, None, None, "unknown")
    window = hist[-cfg.estimate_window:]
    seqs = max(decode_backlog(o) for o in window)
    blocks = max(kv_blocks_needed(o, cfg) for o in window)
    totals = [s.kv_blocks_total for o in window for s in o.decode if s.kv_blocks_total]
    kv_cap = (sum(totals) / len(totals)) * cfg.decode_kv_target_usage if totals else None
    fit = fit_step_time(hist)
    target = cfg.itl_slo_s * cfg.itl_target_fraction
    seq_cap = float(cfg.decode_running_high)
    if fit is not None and fit[1] > 0:
        seq_cap = max(1.0, (target - fit[0]) / fit[1])
    fc = decode_forecast(hist, cfg, backlog_horizon_s(cfg), lambda i: interval_of(hist, i, cfg.interval_s))
    if fc is not None:  # the steady state from the arrivals, and the backlog beyond it as work to be done once
        seqs_load, blocks_load = fc.weigh(seqs, fc.seqs), fc.weigh(blocks, fc.blocks)
    else:
        seqs_load, blocks_load = float(seqs), float(blocks)
    by_seqs = seqs_load / seq_cap
    by_kv = blocks_load / kv_cap if kv_cap else 0.0
    signals = {"decode_backlog_seqs": float(seqs), "decode_seq_capacity": seq_cap,
               "decode_seq_capacity_learned": float(fit is not None and fit[1] > 0),
               "decode_kv_blocks_needed": float(blocks), "decode_kv_capacity_blocks": kv_cap,
               "decode_seqs_load": seqs_load, "decode_kv_blocks_load": blocks_load,
               "decode_load_workers": max(by_seqs, by_kv), **(fc.signals() if fc is not None else {})}
    if by_kv > by_seqs:
        return RoleNeed(by_kv, blocks_load, kv_cap, "decode_kv_blocks", signals)
    return RoleNeed(by_seqs, seqs_load, seq_cap, "decode_seqs", signals)


def kv_blocks_needed(obs, cfg) -> int:
    """Decode KV blocks the load holds: decode's used blocks, plus the blocks prefill workers hold for decode
    while decode backs up (handoffs wait there for blocks, or its warm cache is at ``decode_kv_usage_high``).
    With room on decode those blocks are in transit, not a standing need: a pull reserves its blocks on decode
    (already in decode's used blocks) while prefill still holds the source, and a queued pull starts as soon as
    the transfer thread frees. Counted always, they held a decode worker the prefill pool needed (docs/simulator.md
    e: the CPU shift's window 1 ran 6P+2D where 7P+1D met the SLOs). Not the pressure rule's
    ``autoscale_signals.decode_backs_up``: that one reads the held blocks as a share of prefill's cache, which
    says nothing of whether decode has room for them."""
    used = sum(s.kv_blocks_used for s in obs.decode)
    total = sum(s.kv_blocks_total or 0 for s in obs.decode)
    backs_up = any(s.handoffs_waiting for s in obs.decode) or (total > 0 and used >= cfg.decode_kv_usage_high * total)
    return used + (sum(s.held_blocks for s in obs.prefill) if backs_up else 0)


def decode_backlog(obs) -> int:
    """Sequences that decode or wait to: on decode workers, waiting there for blocks, or held on prefill — at
    most the requests the router has committed to decode workers, when it says (live, a prompt held on a
    prefill worker whose stats() snapshot is a second old is already running on the decode worker whose load
    is fresh: counted twice, a burst of 16 looked like 32)."""
    counted = (sum(s.running + s.waiting + s.handoffs_waiting for s in obs.decode)
               + sum(s.held_requests for s in obs.prefill))
    bound = getattr(obs, "decode_requests_inflight", None)
    return counted if bound is None else min(counted, bound)


def fit_step_time(hist: Sequence) -> tuple[float, float] | None:
    """Least-squares ``step_s = a + b * batch`` over warm decode workers' intervals with decode steps."""
    return fit_line([(s.decode_tokens / s.decode_steps, s.busy_s / s.decode_steps)
                     for o in hist for s in o.decode if s.warm and s.decode_steps > 0 and s.busy_s > 0])
