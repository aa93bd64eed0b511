"""Moves at the budget: the split that evens the load per worker, and the policy's memory of its own moves.

    undone = recent_move_undone(history, to_prefill, cooldown)   # workers the last move took the other way
    held = failed_move_held(history, target, fail_s, hold_s)     # why this move was tried and undone lately
    p, rho = best_split(loads, budget, cfg)                      # the split that evens the load per worker

Pure, like the rest of the policy (cluster/autoscaler.py): the split is read from the observations (the ready
workers of each role), so a replayed history gives the same answers. ``P - D`` measures the split: moving one
worker changes it by 2, starting or stopping one by 1. A change of ``P - D`` is a move only as far as one role
gained what the other lost (``traded``): a scale-down and a regrow of one role moved no worker.

Two memories, two failure modes:
- **An overshoot** (``recent_move_undone``): within the cooldown after a move of n workers, a move back is
  damped to at most n − 1 (a one-worker move not at all) — corrections shrink to nothing.
- **A move that does not pay** (``failed_move_held``): the estimates are measured at the current split, and a
  role's load measured at n workers can read lower than what n − 1 of them meet — decode's backlog grows as its
  pool shrinks (queueing), so a KV-bound decode pool read 0.7 workers of load at 2 workers and 2.8 at 1. The
  policy then takes a worker from it, gives it back within a minute or two, and does it again (the simulator's
  CPU budget 8 Mooncake run: 6P+2D → 7P+1D → 6P+2D every 70–250 s, each round losing goodput to the flips and
  the overloaded interval). A move from this split that was undone within ``fail_s`` is not tried again, nor
  one that goes as far or further the same way, for ``hold_s`` after it was undone: the lesson is the measured
  outcome, not the estimate. A shorter move the same way stays open (7P+1D failing from 5P+3D says nothing of
  6P+2D).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from router.routing.policy import Role


def split_sizes(history: Sequence) -> list[int]:
    """``P - D`` of each observation's ready workers."""
    return [len(o.prefill) - len(o.decode) for o in history]


def recent_move_undone(history: Sequence, to_prefill: bool, cooldown: int) -> int:
    """How many workers the last change of split moved (as the observed ready workers show), when it was less
    than ``cooldown`` intervals ago and in the other direction; else 0. A move back is damped to fewer workers
    than that: an overshoot is corrected, and a sequence of corrections shrinks to nothing (no flapping).

    A change counts only as far as one role gained what the other lost (``traded``): a pool that scaled down
    and grew back (7P+1D → 6P+1D → 7P+1D) moved no worker, and damping the next move on it held a single decode
    worker through a burst in the simulator (CPU budget 8, burst window 3)."""
    sizes = split_sizes(history)
    moved, start = 0, len(sizes) - 1
    for back in range(1, min(cooldown, len(sizes) - 1) + 1):
        change = sizes[-back] - sizes[-back - 1]
        if change and moved and (change > 0) != (moved > 0):
            break  # an earlier change the other way ends the last move
        moved += change
        start = len(sizes) - 1 - back
    if not moved or (moved > 0) == to_prefill:
        return 0
    return traded(history[start], history[-1], to_prefill=moved > 0)


def traded(before, after, *, to_prefill: bool) -> int:
    """Workers that went from one role to the other between two observations: as many as the receiving role
    gained and the donor lost (a start or a stop alone trades none)."""
    dp, dd = len(after.prefill) - len(before.prefill), len(after.decode) - len(before.decode)
    return max(0, min(dp, -dd) if to_prefill else min(dd, -dp))


@dataclass(frozen=True)
class FailedMove:
    """A move from the current split in the proposed direction that was undone: when it left, when it came
    back, and the split it reached."""

    left_t_s: float
    back_t_s: float
    reached: str  # the split at the far end, "7P+1D"

    def reason(self, now_t_s: float, hold_s: float) -> str:
        return (f"a move as far ({self.reached}) was made at t={self.left_t_s:g} s and undone at t={self.back_t_s:g} s "
                f"({self.back_t_s - self.left_t_s:g} s later): not tried again until t={self.back_t_s + hold_s:g} s "
                f"({self.back_t_s + hold_s - now_t_s:g} s from now)")


def failed_move_held(history: Sequence, target: int, fail_s: float, hold_s: float,
                     distressed: Callable[[Role, object], object] | None = None) -> FailedMove | None:
    """The latest move from the current split (or past it, the other way) whose far end ``target`` (``P - D``
    after the proposed move) reaches or passes, that came back within ``fail_s``, less than ``hold_s`` ago; None
    when there is none.

    Only the move that was undone is held, not the move that undid it: the split the cluster held longer is the
    one the measurements chose. A return from a split the cluster *started* in, or reached by a long stay, is
    not a failed move (it left there more than ``fail_s`` before it came back), nor is an excursion that traded no
    worker (a pool scaled down and grown back: 7P+1D → 6P+1D → 7P+1D held every move toward decode for 10 minutes
    in the simulator's burst)."""
    if not history or hold_s <= 0:
        return None
    sizes = split_sizes(history)
    sign = 1 if target > sizes[-1] else -1
    sizes = [sign * s for s in sizes]  # the proposed direction is "up"
    now, t_now, target = sizes[-1], history[-1].t_s, sign * target
    found = None
    left = None  # index of the last observation at or below ``now`` before a stay above it
    for i, s in enumerate(sizes):
        if s <= now:
            if left is not None and i > left + 1 and max(sizes[left + 1:i]) <= target:
                # went above now at left+1, at most as far as the target, and came back at i
                t_left, t_back = history[left + 1].t_s, history[i].t_s
                far = history[max(range(left + 1, i), key=sizes.__getitem__)]
                donor = Role.DECODE if sign > 0 else Role.PREFILL
                if t_back - t_left <= fail_s and t_now - t_back < hold_s \
                        and traded(history[left], far, to_prefill=sign > 0) \
                        and (distressed is None or any(distressed(donor, o) for o in history[left + 2:i + 1])):
                    found = FailedMove(t_left, t_back, f"{len(far.prefill)}P+{len(far.decode)}D")
            left = i
    return found


def best_split(loads: Mapping[Role, float], budget: int, cfg) -> tuple[int, float]:
    """(prefill workers, bottleneck load per worker) of the split of ``budget`` that minimises the busier
    role's load per worker; ties go to more decode workers (decode's backlog also stalls prefill)."""
    lo_p, hi_p = cfg.bounds(Role.PREFILL)
    lo_d, hi_d = cfg.bounds(Role.DECODE)
    best = None
    for p in range(max(lo_p, budget - hi_d), min(hi_p, budget - lo_d) + 1):
        rho = per_worker(loads, p, budget - p)
        if best is None or rho < best[1] - 1e-12:
            best = (p, rho)
    return best if best is not None else (lo_p, float("inf"))


def per_worker(loads: Mapping[Role, float], p: int, d: int) -> float:
    """The bottleneck's load per worker of a split (no prefill worker: the decode workers prefill too)."""
    if d <= 0:
        return float("inf")
    if p == 0:
        return (loads[Role.PREFILL] + loads[Role.DECODE]) / d
    return max(loads[Role.PREFILL] / p, loads[Role.DECODE] / d)
