"""The autoscaler's reactive signals: what one interval shows per role, which pressure asks for a worker, and
whether a role's load would fit in one worker fewer (cluster/autoscaler.py applies them; pure).

Pressure is attributed to the role that causes it. Prefill workers hold a handed-off prompt's blocks under a
lease until the decode worker pulls them; when decode is full those leases pile up, the prefill workers run
out of free blocks and their queues stall — TTFT over the SLO with the *decode* pool as the cause. So: while
prefill workers hold more than ``held_blocks_high`` of their blocks for decode, or handoffs wait on decode
workers for free blocks, prefill's latency and queue signals count as decode pressure, not prefill's.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from router.routing.policy import Role

# pressure codes that are an SLO broken in the interval, not a threshold standing in for load the estimate measures
SLO_BREACHES = frozenset({"ttft_slo", "prefill_queue_slo", "itl_slo"})


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; 0.0 for no samples (an idle interval has no latency to complain about)."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ttft_targets(obs, cfg) -> list[float]:
    """Each TTFT sample's target: ``ttft_slo_s`` + ``ttft_slo_per_token_s`` x its prompt tokens. A prompt whose own
    compute outlasts a flat target misses it at any pool size: judged by one, the CPU model's 2,048-token prompts
    (14 s of compute against an 11-s target) broke the "SLO" in one interval of eight and, as a burst arrived,
    kept the decode worker it needed in the prefill pool (docs/simulator.md e)."""
    if not obs.ttft_prompt_tokens:
        if cfg.ttft_slo_per_token_s and obs.ttft_s:
            raise ValueError("ttft_slo_per_token_s is set, but the observer does not report the TTFT samples' "
                             "prompt tokens")
        return [cfg.ttft_slo_s] * len(obs.ttft_s)
    return [cfg.ttft_slo_s + cfg.ttft_slo_per_token_s * n for n in obs.ttft_prompt_tokens]


def signals(role: Role, obs, cfg) -> dict[str, float | None]:
    """The role's signals in the latest interval, load averaged over warm workers."""
    samples = obs.prefill if role == Role.PREFILL else obs.decode
    warm = [s for s in samples if s.warm]
    n = len(warm)
    held = sum(s.held_blocks for s in obs.prefill)
    prefill_total = sum(s.kv_blocks_total for s in obs.prefill)
    common = {"warm_workers": n, "warming_workers": len(samples) - n,
              "prefill_blocks_held_for_decode": held / prefill_total if prefill_total else 0.0,
              "handoffs_waiting_for_decode_blocks": sum(s.handoffs_waiting for s in obs.decode)}
    if role == Role.PREFILL:
        targets = ttft_targets(obs, cfg)
        return {**common,
                "queued_prefill_tokens_per_worker": sum(s.queued_prefill_tokens for s in warm) / n if n else None,
                "ttft_p90_s": percentile(obs.ttft_s, 90), "prefill_queue_p90_s": percentile(obs.prefill_queue_s, 90),
                "ttft_over_target_p90": percentile([t / g for t, g in zip(obs.ttft_s, targets)], 90),
                "ttft_target_p90_s": percentile(targets, 90) if targets else cfg.ttft_slo_s,
                "requests": len(obs.ttft_s), **{f"ttft_{k}_p90_s": percentile(v, 90) for k, v in obs.ttft_parts.items()}}
    total = sum(s.kv_blocks_total for s in warm)
    return {**common, "kv_usage": sum(s.kv_blocks_used for s in warm) / total if total else None,
            "running_per_worker": sum(s.running + s.waiting for s in warm) / n if n else None,
            "itl_p90_s": percentile(obs.itl_s, 90), "tokens": len(obs.itl_s)}


def decode_backs_up(sig: Mapping[str, float | None], cfg) -> tuple[str, str] | None:
    """(code, reason) when the decode pool's backlog shows: blocks held for it on prefill, handoffs waiting."""
    held = sig.get("prefill_blocks_held_for_decode") or 0.0
    if held > cfg.held_blocks_high:
        return "prefill_blocks_held_for_decode", (f"prefill workers hold {held:.0%} of their KV blocks for decode "
                                                  f"(> {cfg.held_blocks_high:.0%}): decode does not pull fast enough")
    waiting = sig.get("handoffs_waiting_for_decode_blocks") or 0
    if waiting > 0:
        return "handoffs_waiting", f"{waiting:g} handoff(s) wait for free decode KV blocks"
    return None


def _checks(role: Role, cfg, seq_capacity_learned: bool) -> list[tuple[str, float | str, str, str]]:
    """(signal, limit, code, label) of the role's pressure checks, in the order they are reported; a limit that is
    a string names the signal that holds it."""
    if role == Role.PREFILL:
        return [("queued_prefill_tokens_per_worker", cfg.prefill_queued_tokens_high, "queued_prefill_tokens",
                 "queued prefill tokens per worker"),
                ("ttft_over_target_p90", 1.0, "ttft_slo", "TTFT over its target (ttft_slo_s + ttft_slo_per_token_s "
                 "x prompt tokens), p90"),
                ("prefill_queue_p90_s", "ttft_target_p90_s", "prefill_queue_slo",
                 "prefill queue time p90 (s) over the TTFT targets' p90")]
    checks = [("kv_usage", cfg.decode_kv_usage_high, "kv_usage", "KV-cache use")]
    if not seq_capacity_learned:  # the learned ITL capacity replaces the fixed sequence threshold
        checks.append(("running_per_worker", cfg.decode_running_high, "running_seqs", "running sequences per worker"))
    checks.append(("itl_p90_s", cfg.itl_slo_s, "itl_slo", "inter-token latency p90 (s) over the SLO"))
    return checks


def _broken(role: Role, sig: Mapping[str, float | None], cfg, seq_capacity_learned: bool):
    """(code, label, value, limit) of each of the role's checks the signals break, in ``_checks``' order."""
    for key, limit, code, label in _checks(role, cfg, seq_capacity_learned):
        value, limit = sig.get(key), sig.get(limit) if isinstance(limit, str) else limit
        if value is not None and limit is not None and value > limit:
            yield code, label, value, limit


def pressure(role: Role, sig: Mapping[str, float | None], cfg, *, seq_capacity_learned: bool = False
             ) -> tuple[str, str] | None:
    """(code, reason) when the latest interval asks for one more worker of ``role``, else None."""
    backlog = decode_backs_up(sig, cfg)
    if role == Role.PREFILL and backlog is not None:  # prefill's latency is decode's backlog: not more prefill
        return None
    for code, label, value, limit in _broken(role, sig, cfg, seq_capacity_learned):
        parts = _ttft_parts(sig) if code == "ttft_slo" else []
        return code, f"{label}: {value:.3g} > {limit:.3g}" + (f" (p90 s: {', '.join(parts)})" if parts else "")
    return backlog if role == Role.DECODE else None


def _ttft_parts(sig: Mapping[str, float | None]) -> list[str]:
    """TTFT's p90 in seconds and its parts' (queue, compute, router), for a reason."""
    parts = [p for p in ("queue", "compute", "router") if sig.get(f"ttft_{p}_p90_s")]
    return [f"TTFT {sig['ttft_p90_s']:.3g}"] + [f"{p} {sig[f'ttft_{p}_p90_s']:.3g}" for p in parts]


def distress(role: Role, obs, cfg) -> str | None:
    """What one interval measured that the role's requests suffered from (None: nothing): an SLO broken by the
    role itself (``pressure``'s checks in ``SLO_BREACHES``), or, for decode, its backlog stalling handoffs. A load
    estimate or a full KV cache is no distress: a decode worker at 91 % of its blocks serves as fast as one at 50 %."""
    sig = signals(role, obs, cfg)
    backlog = decode_backs_up(sig, cfg)
    if role == Role.PREFILL and backlog is not None:
        return None  # prefill's latency is decode's backlog
    for code, label, value, limit in _broken(role, sig, cfg, seq_capacity_learned=True):
        if code in SLO_BREACHES:
            return f"{label}: {value:.3g} > {limit:.3g} at t={obs.t_s:g}"
    return f"{backlog[1]} at t={obs.t_s:g}" if role == Role.DECODE and backlog is not None else None


def misfit(role: Role, obs, n: int, cfg) -> str | None:
    """Why the interval's whole load would not fit in ``n`` workers with the hysteresis margin (None: it fits)."""
    f = cfg.scale_down_fraction
    samples = obs.prefill if role == Role.PREFILL else obs.decode
    if role == Role.PREFILL:
        sig = signals(role, obs, cfg)
        checks = [(sum(s.queued_prefill_tokens for s in samples) / n, f * cfg.prefill_queued_tokens_high,
                   "queued prefill tokens per worker"),
                  (sig["ttft_over_target_p90"], f, "TTFT over its target, p90"),
                  (sig["prefill_queue_p90_s"], f * sig["ttft_target_p90_s"], "prefill queue p90 (s)")]
    else:
        per_worker_blocks = sum(s.kv_blocks_total for s in samples) / len(samples) if samples else 0
        used = sum(s.kv_blocks_used for s in samples) + sum(s.held_blocks for s in obs.prefill)
        checks = [(used / (n * per_worker_blocks) if per_worker_blocks else 0.0, f * cfg.decode_kv_usage_high,
                   "KV-cache use"),
                  (sum(s.running + s.waiting + s.handoffs_waiting for s in samples) / n, f * cfg.decode_running_high,
                   "running sequences per worker"),
                  (percentile(obs.itl_s, 90), f * cfg.itl_slo_s, "inter-token latency p90 (s)")]
    for value, limit, label in checks:
        if value >= limit and value > 0:
            return f"{label} {value:.3g} >= {limit:.3g} at t={obs.t_s:g}"
    return None
