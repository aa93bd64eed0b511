"""The P:D autoscaler's policy: a pure function from a window of observations to target pool sizes.

    decisions = decide(history, pools, config)    # {Role: Decision(direction, target, reason, signals)}

No Ray, no clock (times are in the observations), no I/O: cluster/pools.py (and the simulator) observe the
cluster and act on the targets; tests replay signal series. Two halves:

**Predictive** (cluster/autoscale_estimate.py): each role's load in workers = its demand over a per-worker
capacity learned online — prefill: uncached prompt tokens arriving per second over prompt tokens a worker
computes per busy second (at ``prefill_target_utilization``); decode: every sequence decoding or waiting to
(including the prompts prefill workers hold for decode) over the sequences a worker runs at the ITL target
(a fitted step-time line) or over its KV blocks, whichever binds — weighed with the steady state the arriving
requests ask for (cluster/autoscale_forecast.py): that leads a growing load, and a backlog beyond it counts
only as far as it must be worked off within ``backlog_horizon_s``.

**Reactive guards** (cluster/autoscale_signals.py): a load threshold or a latency p90 over its SLO in the
latest interval, on warm workers only, asks for one more worker of the role that causes it — prefill latency
while prefill workers hold blocks for decode, or handoffs wait for decode blocks, is decode's pressure.

The rules, in order, per role:
1. Pinned by the operator → hold. Target outside [min, max] → move it inside.
2. An action in progress (a worker starting, draining or changing role, or ready ≠ target), or a worker still
   warming up → hold: one step at a time, judged on the cluster that step produced.
3. Need = the estimate's workers, at least target + 1 under pressure (the estimate alone when it is larger).
   The load the roles are compared by is the estimate's, raised to target + 1 only by an SLO breach
   (``SLO_BREACHES``) or when the estimate is not measured: a threshold (KV use, queued tokens, blocks held for
   decode) stands in for what the estimate measures, and read as a whole worker of load it moved a prefill
   worker to decode on a KV peak that 3P+1D fixed rode out (the H100 model, budget 4).
   Up (+1) when need > target and the budget (prefill + decode targets ≤ ``max_total_workers``) allows; when
   both roles want the budget's last worker, the busier per worker takes it and the other holds (``budget``).
4. **Rebalance** at the budget, when every one of the last ``rebalance_intervals`` intervals agrees on the
   direction: n workers move — the surplus role −n and the short role +n in the same tick (code
   ``rebalance``; the pool manager flips workers' roles in place when it can), n as far as every interval
   agrees (one whose short role's capacity is not measured yet only agrees on the direction). A move happens
   when one role needs more and the other has workers to spare (n = what one needs and the other spares; what
   it spares is judged on its peak load over the last ``donor_peak_intervals`` estimates, since a worker given
   away does not come back within the cooldown), or
   when the needs exceed the budget and the split that minimises the busier role's load per worker lowers it
   by more than ``rebalance_margin`` (n = the distance to that split; with both roles short, the loads at full
   capacity: prefill's without ``prefill_target_utilization``, headroom a pool past its capacity does not have)
   — by more than ``overload_margin`` when that takes a role that was not short past its capacity (it mostly
   moves the bottleneck: a KV-bound decode pool at its limit flapped between 6P+2D and 7P+1D at a 10 % margin
   in the simulator). Within ``rebalance_cooldown_intervals`` of the last change of split, a move back is damped:
   an overshoot of n workers is corrected by at most n − 1, a one-worker move not at all (no flapping). A move
   from this split in this direction that was undone within ``failed_move_intervals`` is not made again for
   ``failed_move_hold_intervals`` (code ``failed_move_held``: a role's load read at n workers can understate
   what n − 1 meet; cluster/autoscale_moves.py) — when the role it shrank showed distress there
   (``autoscale_signals.distress``: its SLO broken, or handoffs waiting for decode); undone without any, the undo
   was the mistake, and holding it kept 2P+2D for ten minutes of prefill TTFT breaches on the H100 model.
   This is the predictive half acting: it jumps to the split the estimates ask for, where the reactive rules step ±1.
5. Down (−1) only when, for each of the last ``scale_down_intervals`` intervals, the estimate fits N−1 at
   ``scale_down_load_fraction`` of its capacity and the whole load would fit N−1 under ``scale_down_fraction``
   of every threshold and SLO (the hysteresis: a steady load never flips between N and N−1). An idle interval
   is zero load: an idle cluster drains to its minimum.
Every decision carries its reason and the signals it was judged on (TTFT split into its parts included).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cluster.autoscale_config import AutoscalerConfig, history_kept
from cluster.autoscale_estimate import Estimate, estimate
from cluster.autoscale_moves import best_split, failed_move_held, per_worker, recent_move_undone
from cluster.autoscale_signals import SLO_BREACHES, distress, misfit, percentile, pressure, signals
from router.routing.policy import Role

__all__ = ["AutoscalerConfig", "Decision", "Observation", "PoolState", "WorkerSample", "decide", "history_kept",
           "percentile"]


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
    # what the interval's work was (differences of the worker's counters over the interval)
    busy_s: float = 0.0  # seconds its engine spent in steps
    prefill_tokens: int = 0  # prompt tokens it computed
    decode_steps: int = 0  # steps that sampled decode tokens ...
    decode_tokens: int = 0  # ... and the tokens they sampled
    # the decode backlog, wherever it waits (at the end of the interval)
    held_requests: int = 0  # prefill: handed-off prompts whose blocks it holds under a lease for decode ...
    held_blocks: int = 0  # ... and those blocks
    handoffs_waiting: int = 0  # decode: handoffs waiting for free blocks


@dataclass(frozen=True)
class Observation:
    """What one interval showed. Latency samples are of requests served by warm workers only."""

    t_s: float
    prefill: tuple[WorkerSample, ...] = ()
    decode: tuple[WorkerSample, ...] = ()
    ttft_s: tuple[float, ...] = ()
    ttft_prompt_tokens: tuple[int, ...] = ()  # each TTFT sample's prompt tokens (its target; empty: not known)
    prefill_queue_s: tuple[float, ...] = ()
    itl_s: tuple[float, ...] = ()
    prefill_tokens_arrived: int = 0  # uncached prompt tokens of the interval's requests that needed a prefill
    ttft_parts: Mapping[str, tuple[float, ...]] = field(default_factory=dict)  # queue, compute, ... samples (s)
    # live only: the router's requests committed to decode workers (placed, not done). An upper bound on the
    # decode backlog, whose parts are snapshots of different ages (None: no bound; the simulator's are exact)
    decode_requests_inflight: int | None = None
    # what the interval's requests ask of decode, as the router placed them (cluster/autoscale_forecast.py) ...
    decode_requests_arrived: int = 0
    output_tokens_requested: int = 0  # their max_tokens
    kv_block_tokens_requested: int = 0  # their KV blocks at mid-output x max_tokens (router/demand.kv_block_tokens)
    # ... and what the requests that finished in the interval generated, of the max_tokens they asked
    output_tokens_finished: int = 0
    output_tokens_finished_requested: int = 0

    def __post_init__(self) -> None:
        if self.ttft_prompt_tokens and len(self.ttft_prompt_tokens) != len(self.ttft_s):
            raise ValueError(f"{len(self.ttft_prompt_tokens)} prompt lengths for {len(self.ttft_s)} TTFT samples")


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
    code: str  # for metrics labels (few values): below_min, queued_prefill_tokens, rebalance, fits_in_fewer, ...
    signals: Mapping[str, float | None] = field(default_factory=dict)
    t_s: float | None = None


def other_role(role: Role) -> Role:
    return Role.DECODE if role == Role.PREFILL else Role.PREFILL


def decide(history: Sequence[Observation], pools: Mapping[Role, PoolState], config: AutoscalerConfig) -> dict[Role, Decision]:
    history = list(history)  # a deque (the pool manager keeps one) does not slice
    cfg = config
    t_s = history[-1].t_s if history else None
    memo: dict[int, Estimate] = {}
    if history:
        memo[len(history) - 1] = estimate(history, cfg)
    sigs = {role: _role_signals(role, history, memo.get(len(history) - 1), cfg) for role in Role}

    def decision(role: Role, direction: str, target: int, code: str, reason: str) -> Decision:
        return Decision(role, direction, target, reason, code, sigs[role], t_s)

    out = {role: _guard(role, history, pools[role], sigs[role], cfg, decision) for role in Role}
    free = [role for role in Role if out[role] is None]
    if not free:
        return out
    needs = {role: _need(role, history, len(history) - 1, pools[role].target, cfg, memo) for role in Role}
    targets = {role: pools[role].target for role in Role}
    if len(free) == 2:
        move = _rebalance(history, targets, cfg, memo)
        if isinstance(move, str):  # a move that did not pay lately: both roles hold, saying why
            for role in Role:
                out[role] = decision(role, "hold", targets[role], "failed_move_held", move)
            return out
        if move is not None:
            src, dst, n, why = move
            out[src] = decision(src, "down", targets[src] - n, "rebalance", why)
            out[dst] = decision(dst, "up", targets[dst] + n, "rebalance", why)
            return out
    # both roles may want the budget's last worker: the busier per worker takes it, the other sees it taken
    for role in sorted(free, key=lambda r: needs[r][0] / max(targets[r], 1), reverse=True):
        out[role] = _step(role, history, targets, needs[role], cfg, decision, memo)
        if out[role].direction == "up":
            targets[role] = out[role].target
    return out


def _role_signals(role: Role, history: Sequence[Observation], est: Estimate | None, cfg: AutoscalerConfig) -> dict:
    if not history:
        return {}
    need = _estimate_of(role, est)
    return {**signals(role, history[-1], cfg), **need.signals}


def _guard(role: Role, history, pool: PoolState, sig, cfg: AutoscalerConfig, decision) -> Decision | None:
    """Rules 1-2: the decisions that do not look at the load."""
    lo, hi = cfg.bounds(role)
    if pool.pinned:
        return decision(role, "hold", pool.target, "pinned", "pinned by the operator")
    if pool.target < lo:
        return decision(role, "up", lo, "below_min", f"target {pool.target} is below the minimum {lo}")
    if pool.target > hi:
        return decision(role, "down", hi, "above_max", f"target {pool.target} is above the maximum {hi}")
    if pool.starting or pool.draining or pool.ready != pool.target:
        return decision(role, "hold", pool.target, "in_progress", f"action in progress ({pool.ready} ready, "
                        f"{pool.starting} starting, {pool.draining} draining, target {pool.target})")
    if not history:
        return decision(role, "hold", pool.target, "no_data", "no observations yet")
    if sig.get("warming_workers"):
        return decision(role, "hold", pool.target, "warming", f"{sig['warming_workers']} worker(s) still warming up: "
                        "the load has not spread over them yet")
    return None


def _need(role: Role, history: Sequence[Observation], i: int, target: int, cfg: AutoscalerConfig,
          memo: dict[int, Estimate]) -> tuple[float, int, tuple[str, str] | None]:
    """(load in workers, workers needed, pressure) as of observation ``i``: the estimate, raised to target + 1
    under pressure; an unmeasurable estimate counts as the current target. Not capped at the role's maximum
    (the caller says "at_max"). ``memo``: the estimates of this decide() call, by observation index."""
    if i not in memo:
        memo[i] = estimate(history, cfg, upto=i)
    est = memo[i]
    need = _estimate_of(role, est)
    learned = bool(need.signals.get("decode_seq_capacity_learned"))
    push = pressure(role, signals(role, history[i], cfg), cfg, seq_capacity_learned=learned)
    load = need.load if need.load is not None else float(target)
    if push is not None and (need.load is None or push[0] in SLO_BREACHES):
        load = max(load, target + 1.0)
    return load, max(cfg.bounds(role)[0], need.workers if need.load is not None else target,
                     target + 1 if push else 0), push


def _step(role: Role, history, targets: Mapping[Role, int], need, cfg: AutoscalerConfig, decision, memo) -> Decision:
    """Rules 3 and 5 for one role."""
    target, other = targets[role], targets[other_role(role)]
    lo, hi = cfg.bounds(role)
    load, workers, push = need
    if workers > target:
        code, why = push if push is not None else ("predicted_demand", f"predicted load {load:.2f} workers "
                                                   f"({_estimate_of(role, memo[len(history) - 1]).explain()}) "
                                                   f"needs {workers} (> {target})")
        if target >= hi:
            return decision(role, "hold", target, "at_max", f"{why}, but the pool is at its maximum {hi}")
        if target + 1 + other > cfg.budget:
            return decision(role, "hold", target, "budget", f"{why}, but the budget of {cfg.budget} workers is used")
        return decision(role, "up", target + 1, code, why)
    if target <= lo:
        return decision(role, "hold", target, "at_min", "no pressure; at the minimum")
    window = range(len(history) - cfg.scale_down_intervals, len(history))
    if window.start < 0:
        return decision(role, "hold", target, "short_history", f"no pressure; {len(history)} of "
                        f"{cfg.scale_down_intervals} intervals observed before a scale-down")
    for i in window:
        load_i, workers_i, push_i = _need(role, history, i, target, cfg, memo)
        measured = _estimate_of(role, memo[i]).load is not None
        if push_i is not None or measured and (workers_i > target - 1 or
                                               load_i > (target - 1) * cfg.scale_down_load_fraction):
            return decision(role, "hold", target, "no_fit", f"no pressure, but the predicted load {load_i:.2f} "
                            f"workers at t={history[i].t_s:g} needs {workers_i}")
        why = misfit(role, history[i], target - 1, cfg)
        if why is not None:
            return decision(role, "hold", target, "no_fit", f"no pressure, but the load would not fit in "
                            f"{target - 1}: {why}")
    return decision(role, "down", target - 1, "fits_in_fewer", f"the load fitted in {target - 1} worker(s) "
                    f"under {cfg.scale_down_fraction:.0%} of every threshold for {cfg.scale_down_intervals} intervals")


def _rebalance(history: Sequence[Observation], targets: Mapping[Role, int], cfg: AutoscalerConfig,
               memo: dict[int, Estimate]) -> tuple[Role, Role, int, str] | str | None:
    """Rule 4: (from role, to role, workers, reason) when workers should move at the budget; the reason a move
    is held when it was made and undone lately (cluster/autoscale_moves.py); else None."""
    if len(history) < cfg.rebalance_intervals:
        return None
    p, d = targets[Role.PREFILL], targets[Role.DECODE]
    if p + d < cfg.budget:
        return None  # below the budget: rule 3 grows the short role instead
    budget = p + d
    moves = []
    for i in range(len(history) - cfg.rebalance_intervals, len(history)):
        needs = {role: _need(role, history, i, targets[role], cfg, memo) for role in Role}
        loads = {role: needs[role][0] for role in Role}
        short = [role for role in Role if needs[role][1] > targets[role]]
        if not short:
            return None  # nobody needs more: rule 5 may scale down
        # an interval whose short role's load is not measured yet (pressure only: "one more") agrees on the
        # direction but does not limit how far the measured intervals move
        measured = all(_estimate_of(role, memo[i]).load is not None for role in short)
        if len(short) == 1 and needs[other_role(short[0])][1] < targets[other_role(short[0])]:
            # one role is short and the other has workers to spare: trade what one needs and the other spares
            dst = short[0]
            src = other_role(dst)
            peak = _peak_load(src, history, i, targets[src], cfg, memo)
            keep = max(cfg.bounds(src)[0], math.ceil(peak / cfg.scale_down_load_fraction - 1e-9))
            n = min(needs[dst][1] - targets[dst], targets[src] - keep, cfg.bounds(dst)[1] - targets[dst])
            if n >= 1:  # the donor keeps headroom: its peak load at most scale_down_load_fraction of what stays
                best_p = p + n if dst == Role.PREFILL else p - n
                moves.append((best_p, loads, per_worker(loads, p, d), per_worker(loads, best_p, budget - best_p),
                              measured, loads))
                continue
        # both short (the budget is too small for the load): the split is judged on the loads at full capacity
        # (``at_capacity``): prefill's target utilization is headroom kept for TTFT bursts, which a pool past its
        # capacity no longer has, and with it a prefill pool at 90 % busy read as 1.28 workers per worker against
        # a decode worker at 148 %: the CPU burst held 7P+1D where 6P+2D met 90 % of it (docs/simulator.md e)
        judged = loads if len(short) == 1 else at_capacity(loads, cfg)
        best_p, best_rho = best_split(judged, budget, cfg)
        now_rho = per_worker(judged, p, d)
        # a move that takes a role that is not short past its capacity must gain more: the bottleneck only moves
        margin = cfg.overload_margin if len(short) == 1 else cfg.rebalance_margin
        if best_p == p or now_rho <= (1 + margin) * best_rho:
            return None
        moves.append((best_p, loads, now_rho, best_rho, measured, judged))
    if len({m[0] > p for m in moves}) != 1:
        return None  # the intervals disagree on the direction
    best_p, loads, now_rho, best_rho, _, judged = moves[-1]
    loads_why = {role: _load_why(role, memo[len(history) - 1], needs[role][2]) for role in Role}  # the latest
    # as far as every interval agrees (the measured ones; one worker when none is measured)
    n = min((abs(m[0] - p) for m in moves if m[4]), default=1)
    undone = recent_move_undone(history, best_p > p, cfg.rebalance_cooldown_intervals)
    if undone:  # damped: a move is only partly undone within the cooldown, a one-worker move not at all
        n = min(n, undone - 1)
        if n < 1:
            return None
        best_p = p + n if best_p > p else p - n
        best_rho = per_worker(judged, best_p, budget - best_p)
    src, dst = (Role.DECODE, Role.PREFILL) if best_p > p else (Role.PREFILL, Role.DECODE)
    why = (f"at the budget of {budget}: load prefill {loads[Role.PREFILL]:.2f} workers ({loads_why[Role.PREFILL]}) "
           f"/ decode {loads[Role.DECODE]:.2f} workers ({loads_why[Role.DECODE]}); "
           + ("" if judged is loads else f"both short, judged at full capacity: prefill {judged[Role.PREFILL]:.2f} "
                                          f"workers (x prefill_target_utilization {cfg.prefill_target_utilization:g}); ")
           + f"{p}P+{d}D runs the bottleneck at "
           f"{now_rho:.2f} per worker, {best_p}P+{budget - best_p}D at {best_rho:.2f}: {n} worker(s) move "
           f"{src.value} → {dst.value}")
    # rule 4's last word: what the cluster measured after a move as far beats the estimate; a shorter one may do
    hold_s, step = cfg.failed_move_hold_intervals * cfg.interval_s, 1 if best_p > p else -1
    held = ""  # why the whole move is held, once it is
    for k in range(n, 0, -1):
        failed = failed_move_held(history, 2 * (p + step * k) - budget, cfg.failed_move_intervals * cfg.interval_s,
                                  hold_s, lambda role, o: distress(role, o, cfg))
        if failed is None:
            return src, dst, k, why if k == n else f"{why}; {k} move: {n} was held ({held})"
        held = held or failed.reason(history[-1].t_s, hold_s)
    return f"{why}; held: {held}"


def _peak_load(role: Role, history: Sequence[Observation], i: int, target: int, cfg: AutoscalerConfig,
               memo: dict[int, Estimate]) -> float:
    """A donor's largest load over the ``donor_peak_intervals`` estimates up to observation ``i`` (each already the
    largest of ``estimate_window`` intervals: 6 estimates span 8 intervals at the defaults). A worker it gives away
    does not come back within the cooldown (a one-worker move is not undone there, and rule 3 cannot grow a role
    at the budget), so the workers it keeps must carry its bursts over that horizon, not the interval-end
    snapshot that decided the move: the simulator's decode pool read 0.58 workers at 2 between bursts, gave one
    away, and the one left filled its KV cache within a minute (docs/simulator.md e)."""
    lo = max(0, i - cfg.donor_peak_intervals + 1)
    return max(_need(role, history, j, target, cfg, memo)[0] for j in range(lo, i + 1))


def at_capacity(loads: Mapping[Role, float], cfg: AutoscalerConfig) -> dict[Role, float]:
    """The roles' loads in workers at full capacity: prefill's without its ``prefill_target_utilization`` (decode's
    targets are its limits: the ITL target and a nearly full KV cache)."""
    return {Role.PREFILL: loads[Role.PREFILL] * cfg.prefill_target_utilization, Role.DECODE: loads[Role.DECODE]}


def _estimate_of(role: Role, est: Estimate):
    return est.prefill if role == Role.PREFILL else est.decode


def _load_why(role: Role, est: Estimate, push: tuple[str, str] | None) -> str:
    """A role's load in a rebalance's reason: the estimate's signals by name, and the pressure that raised it."""
    return _estimate_of(role, est).explain() + (f"; pressure {push[0]}: {push[1]}" if push is not None else "")
