"""The P:D autoscaler's policy: a pure function from a window of observations to target pool sizes.

    decisions = decide(history, pools, config)    # {Role: Decision(direction, target, reason, signals)}

No Ray, no clock (times are in the observations), no I/O: cluster/pools.py observes the cluster and acts
on the targets; tests replay signal series. Each role is judged on its own signals, never a mix
(prefill is compute-bound, decode memory-bound; one average lets the wrong role scale):

  prefill  queued prefill tokens per worker; TTFT p90 and prefill queue-time p90 against the TTFT SLO
  decode   KV-cache use; running + waiting sequences per worker; inter-token latency p90 against its SLO

The rules, in the order they are applied per role:
1. Pinned by the operator → hold. Target outside [min, max] → move it inside.
2. An action in progress (a worker starting or draining, or ready ≠ target) → hold: one step at a time,
   judged on the cluster that step produced — which includes waiting until a new worker is warm
   (``warmup_s`` after it became ready) and the load had time to spread over it.
3. Up (+1) when the latest interval shows pressure: a load signal over its threshold, averaged over the
   *warm* workers only, or a latency p90 over its SLO, measured on warm workers' requests only (a new
   worker's cold-start samples would otherwise scale again). Latency catches what an average hides: one
   saturated worker behind an imbalanced router still pushes the p90 over the SLO. Capped by max and by
   the total budget (prefill + decode targets).
4. Down (−1) only when, for each of the last ``scale_down_intervals`` intervals, the whole load would fit
   in N−1 workers under ``scale_down_fraction`` of every threshold and SLO. The gap between the up
   threshold and that fraction is the hysteresis: a steady load never flips between N and N−1.
5. An idle interval is zero load and no latency samples, i.e. it fits anywhere: no NaN, so an idle
   cluster drains to its minimum.
Every decision carries its reason and the signals it was judged on.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from router.policy import Role


@dataclass(frozen=True)
class AutoscalerConfig:
    enabled: bool = False
    interval_s: float = 10.0
    min_prefill: int = 1
    max_prefill: int = 3
    min_decode: int = 1
    max_decode: int = 3
    max_total_workers: int | None = None  # budget for prefill + decode targets (None: max_prefill + max_decode)
    ttft_slo_s: float = 2.0  # CPU demo defaults (SmolLM2 on 2 vCPUs); set real SLOs on GPUs
    itl_slo_s: float = 0.25
    prefill_queued_tokens_high: int = 2048  # per warm prefill worker
    decode_kv_usage_high: float = 0.8  # fraction of the warm decode workers' KV blocks in use
    decode_running_high: int = 32  # running + waiting sequences per warm decode worker
    scale_down_fraction: float = 0.5  # N−1 must carry the load under this fraction of every threshold
    scale_down_intervals: int = 3
    warmup_s: float = 10.0  # a new worker's samples are left out this long after it became ready

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

    def bounds(self, role: Role) -> tuple[int, int]:
        return (self.min_prefill, self.max_prefill) if role == Role.PREFILL else (self.min_decode, self.max_decode)

    @property
    def budget(self) -> int:
        return self.max_total_workers if self.max_total_workers is not None else self.max_prefill + self.max_decode


@dataclass(frozen=True)
class WorkerSample:
    """One ready worker at the end of an interval."""

    worker_id: str
    warm: bool  # past its warm-up
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0


@dataclass(frozen=True)
class Observation:
    """What one interval showed. Latency samples are of requests served by warm workers only."""

    t_s: float
    prefill: tuple[WorkerSample, ...] = ()
    decode: tuple[WorkerSample, ...] = ()
    ttft_s: tuple[float, ...] = ()
    prefill_queue_s: tuple[float, ...] = ()
    itl_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class PoolState:
    target: int
    ready: int
    starting: int = 0
    draining: int = 0
    pinned: bool = False


@dataclass(frozen=True)
class Decision:
    role: Role
    direction: str  # up | down | hold
    target: int
    reason: str  # for people
    code: str  # for metrics labels (few values): below_min, queued_prefill_tokens, ttft_slo, fits_in_fewer, ...
    signals: Mapping[str, float | None] = field(default_factory=dict)
    t_s: float | None = None


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; 0.0 for no samples (an idle interval has no latency to complain about)."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def decide(history: Sequence[Observation], pools: Mapping[Role, PoolState], config: AutoscalerConfig) -> dict[Role, Decision]:
    history = list(history)  # a deque (the pool manager keeps one) does not slice
    out: dict[Role, Decision] = {}
    for role in (Role.PREFILL, Role.DECODE):
        other = Role.DECODE if role == Role.PREFILL else Role.PREFILL
        out[role] = _decide_role(role, history, pools[role], pools[other].target, config)
    return out


def _decide_role(role: Role, history: Sequence[Observation], pool: PoolState, other_target: int,
                 cfg: AutoscalerConfig) -> Decision:
    lo, hi = cfg.bounds(role)
    t_s = history[-1].t_s if history else None
    signals = _signals(role, history[-1], cfg) if history else {}

    def decision(direction: str, target: int, code: str, reason: str) -> Decision:
        return Decision(role, direction, target, reason, code, signals, t_s)

    if pool.pinned:
        return decision("hold", pool.target, "pinned", "pinned by the operator")
    if pool.target < lo:
        return decision("up", lo, "below_min", f"target {pool.target} is below the minimum {lo}")
    if pool.target > hi:
        return decision("down", hi, "above_max", f"target {pool.target} is above the maximum {hi}")
    if pool.starting or pool.draining or pool.ready != pool.target:
        return decision("hold", pool.target, "in_progress", f"action in progress ({pool.ready} ready, "
                        f"{pool.starting} starting, {pool.draining} draining, target {pool.target})")
    if not history:
        return decision("hold", pool.target, "no_data", "no observations yet")
    if signals.get("warming_workers"):
        return decision("hold", pool.target, "warming", f"{signals['warming_workers']} worker(s) still warming up: "
                        "the load has not spread over them yet")
    pressure = _pressure(role, signals, cfg)
    if pressure is not None:
        code, why = pressure
        if pool.target >= hi:
            return decision("hold", pool.target, "at_max", f"{why}, but the pool is at its maximum {hi}")
        if pool.target + 1 + other_target > cfg.budget:
            return decision("hold", pool.target, "budget", f"{why}, but the budget of {cfg.budget} workers is used")
        return decision("up", pool.target + 1, code, why)
    if pool.target <= lo:
        return decision("hold", pool.target, "at_min", "no pressure; at the minimum")
    window = history[-cfg.scale_down_intervals:]
    if len(window) < cfg.scale_down_intervals:
        return decision("hold", pool.target, "short_history", f"no pressure; {len(window)} of "
                        f"{cfg.scale_down_intervals} intervals observed before a scale-down")
    misfit = next((r for r in (_misfit(role, obs, pool.target - 1, cfg) for obs in window) if r), None)
    if misfit is not None:
        return decision("hold", pool.target, "no_fit", f"no pressure, but the load would not fit in "
                        f"{pool.target - 1}: {misfit}")
    return decision("down", pool.target - 1, "fits_in_fewer", f"the load fitted in {pool.target - 1} worker(s) "
                    f"under {cfg.scale_down_fraction:.0%} of every threshold for {cfg.scale_down_intervals} intervals")


def _signals(role: Role, obs: Observation, cfg: AutoscalerConfig) -> dict[str, float | None]:
    """The role's signals in the latest interval, load averaged over warm workers."""
    samples = obs.prefill if role == Role.PREFILL else obs.decode
    warm = [s for s in samples if s.warm]
    n = len(warm)
    if role == Role.PREFILL:
        return {"warm_workers": n, "warming_workers": len(samples) - n,
                "queued_prefill_tokens_per_worker": sum(s.queued_prefill_tokens for s in warm) / n if n else None,
                "ttft_p90_s": percentile(obs.ttft_s, 90), "prefill_queue_p90_s": percentile(obs.prefill_queue_s, 90),
                "requests": len(obs.ttft_s)}
    total = sum(s.kv_blocks_total for s in warm)
    return {"warm_workers": n, "warming_workers": len(samples) - n,
            "kv_usage": sum(s.kv_blocks_used for s in warm) / total if total else None,
            "running_per_worker": sum(s.running + s.waiting for s in warm) / n if n else None,
            "itl_p90_s": percentile(obs.itl_s, 90), "tokens": len(obs.itl_s)}


def _pressure(role: Role, sig: Mapping[str, float | None], cfg: AutoscalerConfig) -> tuple[str, str] | None:
    """(code, reason) when the latest interval asks for one more worker, else None."""
    if role == Role.PREFILL:
        checks = [("queued_prefill_tokens_per_worker", cfg.prefill_queued_tokens_high, "queued_prefill_tokens",
                   "queued prefill tokens per worker"),
                  ("ttft_p90_s", cfg.ttft_slo_s, "ttft_slo", "TTFT p90 (s) over the SLO"),
                  ("prefill_queue_p90_s", cfg.ttft_slo_s, "prefill_queue_slo",
                   "prefill queue time p90 (s) over the TTFT SLO")]
    else:
        checks = [("kv_usage", cfg.decode_kv_usage_high, "kv_usage", "KV-cache use"),
                  ("running_per_worker", cfg.decode_running_high, "running_seqs", "running sequences per worker"),
                  ("itl_p90_s", cfg.itl_slo_s, "itl_slo", "inter-token latency p90 (s) over the SLO")]
    for key, limit, code, label in checks:
        value = sig.get(key)
        if value is not None and value > limit:
            return code, f"{label}: {value:.3g} > {limit:.3g}"
    return None


def _misfit(role: Role, obs: Observation, n: int, cfg: AutoscalerConfig) -> str | None:
    """Why the interval's whole load would not fit in ``n`` workers with the hysteresis margin (None: it fits)."""
    f = cfg.scale_down_fraction
    samples = obs.prefill if role == Role.PREFILL else obs.decode
    if role == Role.PREFILL:
        checks = [(sum(s.queued_prefill_tokens for s in samples) / n, f * cfg.prefill_queued_tokens_high,
                   "queued prefill tokens per worker"),
                  (percentile(obs.ttft_s, 90), f * cfg.ttft_slo_s, "TTFT p90 (s)"),
                  (percentile(obs.prefill_queue_s, 90), f * cfg.ttft_slo_s, "prefill queue p90 (s)")]
    else:
        per_worker_blocks = sum(s.kv_blocks_total for s in samples) / len(samples) if samples else 0
        used = sum(s.kv_blocks_used for s in samples)
        checks = [(used / (n * per_worker_blocks) if per_worker_blocks else 0.0, f * cfg.decode_kv_usage_high,
                   "KV-cache use"),
                  (sum(s.running + s.waiting for s in samples) / n, f * cfg.decode_running_high,
                   "running sequences per worker"),
                  (percentile(obs.itl_s, 90), f * cfg.itl_slo_s, "inter-token latency p90 (s)")]
    for value, limit, label in checks:
        if value >= limit and value > 0:
            return f"{label} {value:.3g} >= {limit:.3g} at t={obs.t_s:g}"
    return None
