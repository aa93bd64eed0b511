"""Decode's load from what arrives (Little's law), and how much of a measured backlog beyond it counts.

    f = decode_forecast(history, config, horizon_s, interval_s)   # DecodeForecast; None: no arrival reported
    load = f.weigh(measured, f.blocks)                           # what the policy sizes decode for

Pure, like the rest of the policy (cluster/autoscaler.py calls it through cluster/autoscale_estimate.py).

**The steady state.** The router counts, per interval, the requests it places and what they ask of decode: their
``max_tokens`` and their KV block-tokens (blocks held at mid-output × ``max_tokens``: router/demand.py). Over the
requests that finished lately, tokens generated / ``max_tokens`` asked scales the asks (a client asking 4,096
and stopping at 100 is not 40× the load; 1.0 until a request has finished: the bound). Then, at the largest of
``estimate_window`` intervals:
- sequences at the ITL target = output tokens arriving per second × the ITL target (s per token);
- KV blocks held = block-tokens arriving per second × the decode step time measured on warm workers.
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

    def weigh(self, measured: float, steady: float) -> float:
        """A measured load with its excess over the steady state counted by ``backlog_share``."""
        return steady + max(0.0, measured - steady) * self.backlog_share

    def signals(self) -> dict[str, float | None]:
        return {"decode_forecast_seqs": self.seqs, "decode_forecast_blocks": self.blocks,
                "decode_forecast_residence_s": self.residence_s, "decode_forecast_step_s": self.step_s,
                "decode_output_ratio": self.output_ratio, "decode_backlog_share": self.backlog_share}


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
    seqs = max(hist[i].output_tokens_requested * ratio / interval_s(i) for i in window) * target
    blocks = max(hist[i].kv_block_tokens_requested * ratio / interval_s(i)
                 for i in window) * step_s
    arrived = sum(hist[i].decode_requests_arrived for i in window)
    residence = (sum(hist[i].output_tokens_requested for i in window) * ratio / arrived * step_s) if arrived else None
    share = 1.0 if residence is None else min(1.0, residence / horizon_s)
    return DecodeForecast(seqs, blocks, residence, step_s, ratio, share)
