"""The P:D autoscaler's settings: every key of a YAML ``autoscaler:`` section, validated on construction.

    cfg = AutoscalerConfig(max_total_workers=8, ttft_slo_s=3.0)   # a ConfigError names what is wrong

The policy that reads them is cluster/autoscaler.py; docs/operating.md explains each.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.autoscale_estimate import LEARN_INTERVALS
from router.routing.policy import Role


@dataclass(frozen=True)
class AutoscalerConfig:
    enabled: bool = False
    interval_s: float = 5.0  # 10 until 2026-11-27: a move needs two agreeing intervals and a flip (docs/simulator.md e)
    min_prefill: int = 1
    max_prefill: int = 3
    min_decode: int = 1
    max_decode: int = 3
    max_total_workers: int | None = None  # budget for prefill + decode targets (None: max_prefill + max_decode)
    ttft_slo_s: float = 2.0  # CPU demo defaults (SmolLM2 on 2 vCPUs); set real SLOs on GPUs
    # a request's TTFT target is ttft_slo_s + this x its prompt tokens (0: one target for every prompt). A long
    # prompt's own compute can outlast a flat target at any pool size; judged by one, it reads as prefill pressure
    ttft_slo_per_token_s: float = 0.0
    itl_slo_s: float = 0.25
    prefill_queued_tokens_high: int = 2048  # per warm prefill worker
    decode_kv_usage_high: float = 0.8  # fraction of the warm decode workers' KV blocks in use
    decode_running_high: int = 32  # running + waiting sequences per warm decode worker
    scale_down_fraction: float = 0.5  # N−1 must carry the load under this fraction of every threshold
    scale_down_intervals: int = 3
    warmup_s: float = 10.0  # a new worker's samples are left out this long after it became ready
    # the predictive half (cluster/autoscale_estimate.py)
    prefill_tokens_per_s: float | None = None  # prior per-worker prefill rate until one is measured (None: none)
    prefill_target_utilization: float = 0.7  # a prefill pool is sized to run this busy at the demand it sees
    itl_target_fraction: float = 0.8  # decode sequences per worker are sized for ITL = this x itl_slo_s
    decode_kv_target_usage: float = 0.95  # ... and its KV load for this fraction of a worker's blocks (not the 0.8
    # pressure threshold: KV is room, not throughput — a fuller cache adds no latency until it is full)
    estimate_window: int = 3  # intervals whose largest demand sizes the pools (bursts)
    held_blocks_high: float = 0.3  # prefill blocks held for decode above this fraction: decode's pressure
    rebalance_margin: float = 0.1  # a move must lower the bottleneck's load per worker by this fraction
    overload_margin: float = 0.25  # ... and by this one when it takes a role that was not short past its capacity
    rebalance_intervals: int = 2  # consecutive intervals that must agree on a move
    rebalance_cooldown_intervals: int = 6  # within this many intervals a move is undone only in part (damped)
    donor_peak_intervals: int = 6  # a role gives workers away only if its peak load over this many estimates fits
    failed_move_intervals: int = 12  # a move undone within this many intervals did not pay ...
    failed_move_hold_intervals: int = 60  # ... and is not made again for this many after (cluster/autoscale_moves.py)
    scale_down_load_fraction: float = 0.8  # and N−1 must carry the predicted load at this fraction of each

    def __post_init__(self) -> None:
        from engine.errors import ConfigError

        if self.interval_s <= 0 or self.warmup_s < 0:
            raise ConfigError("autoscaler.interval_s must be > 0 and warmup_s >= 0")
        for role in ("prefill", "decode"):
            lo, hi = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if not (isinstance(lo, int) and isinstance(hi, int)) or lo < (0 if role == "prefill" else 1) or hi < lo:
                raise ConfigError(f"autoscaler: need {'0' if role == 'prefill' else '1'} <= min_{role} <= max_{role}, "
                                  f"got {lo}, {hi}")
        if self.max_total_workers is not None and self.max_total_workers < self.min_prefill + self.min_decode:
            raise ConfigError("autoscaler.max_total_workers is below min_prefill + min_decode")
        if not 0 < self.scale_down_fraction < 1 or self.scale_down_intervals < 1:
            raise ConfigError("autoscaler: scale_down_fraction must be in (0, 1) and scale_down_intervals >= 1")
        if min(self.ttft_slo_s, self.itl_slo_s, self.decode_kv_usage_high) <= 0 or \
                min(self.prefill_queued_tokens_high, self.decode_running_high) < 1:
            raise ConfigError("autoscaler: SLOs and thresholds must be positive")
        if not isinstance(self.ttft_slo_per_token_s, (int, float)) or not 0 <= self.ttft_slo_per_token_s < math.inf:
            raise ConfigError(f"autoscaler.ttft_slo_per_token_s must be >= 0, got {self.ttft_slo_per_token_s!r}")
        if self.prefill_tokens_per_s is not None and self.prefill_tokens_per_s <= 0:
            raise ConfigError("autoscaler.prefill_tokens_per_s must be > 0 (or null: learned)")
        for name in ("prefill_target_utilization", "itl_target_fraction", "decode_kv_target_usage", "held_blocks_high",
                     "scale_down_load_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"autoscaler.{name} must be in (0, 1], got {getattr(self, name)!r}")
        if min(self.rebalance_margin, self.overload_margin, self.rebalance_cooldown_intervals) < 0 \
                or min(self.estimate_window, self.rebalance_intervals, self.donor_peak_intervals) < 1:
            raise ConfigError("autoscaler: rebalance_margin, overload_margin and rebalance_cooldown_intervals must be "
                              ">= 0, estimate_window, rebalance_intervals and donor_peak_intervals >= 1")
        if not 0 <= self.failed_move_intervals <= self.failed_move_hold_intervals:
            raise ConfigError("autoscaler: need 0 <= failed_move_intervals <= failed_move_hold_intervals (a shorter "
                              "hold lets a flap between two splits hold the worse one)")

    def bounds(self, role: Role) -> tuple[int, int]:
        return (self.min_prefill, self.max_prefill) if role == Role.PREFILL else (self.min_decode, self.max_decode)

    @property
    def budget(self) -> int:
        return self.max_total_workers if self.max_total_workers is not None else self.max_prefill + self.max_decode


def history_kept(cfg: AutoscalerConfig) -> int:
    """Observations decide() needs: the capacities' learning window, or a failed move and its hold."""
    return max(LEARN_INTERVALS, cfg.failed_move_intervals + cfg.failed_move_hold_intervals + 1,
               cfg.donor_peak_intervals + cfg.estimate_window + cfg.rebalance_intervals)
