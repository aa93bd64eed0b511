"""Decode's load from what arrives (Little's law), and how much of a measured backlog beyond it counts.

    f = decode_forecast(history, config, horizon_s, interval_s)   # DecodeForecast; None: no arrival reported
    load = f.weigh(measured, f.blocks)                           # what the policy sizes decode for

Pure, like the rest of the policy (cluster/autoscaler.py calls it through cluster/autoscale_estimate.py).

**The steady state.** The router counts, per interval, the requests it places and what they ask of decode: their
``max_tokens`` and their KV block-tokens (blocks held at mid-output × ``max_tokens``: router/routing/demand.py). Over
the requests that finished lately, tokens generated / ``max_tokens`` asked scales the asks (a client asking 4,096
and stopping at 100 is not 40× the load; 1.0 until a request has finished: the bound). Then, over the last
``estimate_window`` intervals:
- sequences at the ITL target = output tokens arriving per second (the largest interval's) × the ITL target;
- KV blocks held = block-tokens arriving per second (the window's mean: a request's KV builds up over its whole
  residence, so one interval's peak does not fill the cache) × the step time of a decode worker whose cache is at
  ``decode_kv_target_usage`` (``full_step_s``: a line ``step = a + c × blocks used`` fitted to the warm decode
  workers' intervals; the measured step time until the blocks span enough to fit it), capped at the ITL target.
  A step reads the KV cache, so it slows as the cache fills and a request holds its blocks longer: the pool is
  sized for what it holds once each worker is that full (with d workers at the fixed point B = r × (a + c B / d),
  the smallest d at which B / d fits ``kv`` is r × (a + c kv) / kv). Judged at a light load's step time, the
  H100 model at budget 8 read 1.1 workers of KV at 11-ms steps where the pool then filled 5 at 38 ms, and moved
  4P+4D → 7P+1D into a burst (docs/simulator.md e).
This leads the measured backlog: when the input/output mix turns decode-heavy, the long outputs arrive at once
but their KV grows for a minute (the H100 model, budget 8: the backlog read 1.6 workers, the forecast 2.7, and
the move waited for the backlog; docs/simulator.md e).

**A backlog beyond it** (requests waiting for decode blocks, a KV peak) is work to be done once, not a rate:
it needs capacity only to be worked off within ``backlog_horizon_s``, as prefill's queued tokens do. Each
waiting request decodes for ``residence_s`` (its output × the step time), so the excess counts by
min(1, residence / horizon). On the H100 model a request decodes for ~4 s against a 30-s horizon: a KV peak of
1.6 workers at a steady 0.94 read 1.04, and 3P+1D rode it out as the fixed split does, where moving a prefill
worker to decode broke TTFT for a minute. On the CPU model (SmolLM2's outputs scaled to ~20 tokens) a request
decodes for 1–3 s and a backlog counts 4–13 %; a decode whose outputs outlast the horizon counts it in full.
No arrivals in the window (or none reported): the backlog counts in full.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeForecast:
    seqs: float  # sequences decoding in the steady state, at the ITL target
    blocks: float  # KV blocks held in the steady state
    residence_s: float | None  # seconds a request of the window decodes (None: no arrivals in the window)
    step_s: float  # decode step time it is judged at (measured; the ITL target before any step)
    output_ratio: float  # tokens generated / max_tokens asked, of the requests that finished lately
    backlog_share: float  # how much of a backlog beyond the steady state counts: min(1, residence / horizon)
    kv_step_s: float  # the step time the KV blocks are judged at (a full worker's, when fitted)

    def weigh(self, measured: float, steady: float) -> float:
        """A measured load with its excess over the steady state counted by ``backlog_share``."""
        return steady + max(0.0, measured - steady) * self.backlog_share

    def signals(self) -> dict[str, float | None]:
        return {"decode_forecast_seqs": self.seqs, "decode_forecast_blocks": self.blocks,
                "decode_forecast_residence_s": self.residence_s, "decode_forecast_step_s": self.step_s,
                "decode_output_ratio": self.output_ratio, "decode_backlog_share": self.backlog_share,
                "decode_forecast_kv_step_s": self.kv_step_s}


def decode_forecast(hist: Sequence, cfg, horizon_s: float, interval_s: Callable[[int], float]) -> DecodeForecast | None:
    """The forecast as of the latest observation of ``hist`` (the capacities' learning window; ``interval_s(i)``:
    the seconds observation i covers); None when no observation reports an arrival (an observer that does not
    count them: the measured backlog alone)."""
    if not any(o.decode_requests_arrived for o in hist):
        return None

    asked = sum(o.output_tokens_finished_requested for o in hist)
    ratio = min(1.0, sum(o.output_tokens_finished for o in hist) / asked) if asked else 1.0
    window = range(max(0, len(hist) - cfg.estimate_window), len(hist))
    steps = sum(s.decode_steps for i in window for s in hist[i].decode if s.warm)
    busy = sum(s.busy_s for i in window for s in hist[i].decode if s.warm)
    target = cfg.itl_slo_s * cfg.itl_target_fraction
    step_s = busy / steps if steps > 0 and busy > 0 else target
    full = full_step_s(hist, cfg)
    kv_step_s = step_s if full is None else min(max(step_s, full), max(step_s, target))
    seqs = max(hist[i].output_tokens_requested * ratio / interval_s(i) for i in window) * target
    # KV builds up over a request's residence, seconds to a minute: the window's mean rate fills it, not its peak
    blocks = sum(hist[i].kv_block_tokens_requested * ratio for i in window) / sum(interval_s(i) for i in window) \
        * kv_step_s
    arrived = sum(hist[i].decode_requests_arrived for i in window)
    residence = (sum(hist[i].output_tokens_requested for i in window) * ratio / arrived * step_s) if arrived else None
    share = 1.0 if residence is None else min(1.0, residence / horizon_s)
    return DecodeForecast(seqs, blocks, residence, step_s, ratio, share, kv_step_s)


MIN_FIT_POINTS = 4
MIN_FIT_SPAN = 2.0  # the fitted x must span at least this factor (max/min) to trust the slope


def fit_line(pts: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``y = a + b * x`` over ``pts`` (None: fewer than ``MIN_FIT_POINTS``, or x spanning less than
    ``MIN_FIT_SPAN``)."""
    if len(pts) < MIN_FIT_POINTS:
        return None
    xs = [x for x, _ in pts]
    if max(xs) < MIN_FIT_SPAN * max(min(xs), 1e-9):
        return None
    n = len(pts)
    mx, my = sum(xs) / n, sum(y for _, y in pts) / n
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def full_step_s(hist: Sequence, cfg) -> float | None:
    """The decode step time of a worker whose KV cache is at ``decode_kv_target_usage``: a line ``step_s = a + c *
    blocks used`` fitted to the warm decode workers' intervals (None: no fit, or no slope)."""
    samples = [s for o in hist for s in o.decode if s.warm and s.decode_steps > 0 and s.busy_s > 0 and s.kv_blocks_total]
    fit = fit_line([(max(1, s.kv_blocks_used), s.busy_s / s.decode_steps) for s in samples])
    if fit is None or fit[1] <= 0:
        return None
    return fit[0] + fit[1] * cfg.decode_kv_target_usage * sum(s.kv_blocks_total for s in samples) / len(samples)
