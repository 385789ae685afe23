"""Spend leftover budget: keep more of what a derived-schedule plan recomputes.

Heuristic plans (Chen's segments, the budgeted greedy) and the chain DP's
block options often peak well below the budget: they cut at coarse points.
:func:`fill_budget` keeps additional recomputed values, best ratio of
recompute cost saved to bytes first, as long as the simulated peak stays
within the budget.  Keeping a value never adds a recomputation, so the cost
can only fall; the simulator decides the peak.

Each round reads the current plan's memory timeline (one simulation) and
walks the ranking once: keeping value ``v`` holds its storage from its forward
step to its recomputation in backward, so ``v`` is estimated to fit when the
timeline's maximum over that span plus its bytes fits, and a value taken adds
its bytes to the span for those after it.  A value that does not fit is passed
over, not the end of the walk: the values ranked after a large one that cannot
fit are still tried.  The values taken are then simulated together; where the
estimate was wrong (a kept view pins its base's storage, recomputations of
other values change), a binary search finds their longest prefix that fits.
Rounds repeat on what was left, from the new plan's timeline, while one keeps
something.  A prefix whose kept storages alone (all alive at the end of the
forward phase) exceed the budget is refused without simulating it.
Time: O(rounds * (log(n) simulations + n * steps)); in practice one to three
simulations per round (the estimate is right most of the time).

Example:
    >>> from solvers import Problem, Plan, simulate
    >>> p = Problem.training_chain(8)
    >>> sparse = Plan(kept=set())
    >>> better = fill_budget(p, sparse, simulate(p, sparse).peak_bytes + 3)
    >>> simulate(p, better).recompute_cost <= simulate(p, sparse).recompute_cost
    True
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
from typing import Any, Callable

from solvers.plan import BACKWARD_PHASE, Plan
from solvers.problem import FORWARD_CODE, RECOMPUTE_CODE, SAVE_CODE, Problem
from solvers.simulator import (
    derived_schedule,
    evaluate_mask_schedule,
    honour_policies_mask,
    mask_of,
    names_of,
    simulate,
)

__all__ = ["fill_budget", "drop_unread"]

log = logging.getLogger("solvers.refine")

_ROUNDS = 4


def fill_budget(
    problem: Problem, plan: Plan, budget_bytes: int, *, kept_weight: int = 0, kept_allowance: int | None = None
) -> Plan:
    """A plan at most as costly as ``plan`` (derived schedule) that still fits the budget.

    ``kept_weight``: every byte a trial keeps beyond ``kept_allowance`` (default: what ``plan`` keeps)
    also raises the peak by this many bytes.  A graph run several times in a step (layers compiled
    once) is planned with its earlier runs in the baseline, each counted at the allowance: a trial
    that keeps more keeps it in each of them too.  A plan that does not fit so already is returned
    unchanged, as are plans with an explicit schedule.
    """
    if plan.schedule is not None:
        return plan
    mask = honour_policies_mask(problem, mask_of(problem, plan.kept))
    start = _Trial(mask, *evaluate_mask_schedule(problem, mask))
    core = start.result
    if core.peak_bytes > budget_bytes or core.recompute_steps == 0:
        return plan
    nbytes, cost, policy, kind = problem._bytes, problem._cost, problem._policy, problem._kind
    recomputed = dict.fromkeys(v for v in start.nodes[start.n_fwd :] if kind[v] == FORWARD_CODE)
    candidates = [v for v in recomputed if policy[v] != RECOMPUTE_CODE]
    # Best saving per byte first; free values (views) first of all.
    candidates.sort(key=lambda v: (-(cost[v] / nbytes[v]) if nbytes[v] else float("-inf"), v))
    weighed = _Weighed(kept_weight, core.kept_bytes if kept_allowance is None else kept_allowance)
    if weighed.peak(core) > budget_bytes:
        return plan
    best = _fill_rounds(problem, start, candidates, budget_bytes, weighed)
    if best.result.recompute_cost >= core.recompute_cost:
        return plan
    # A value kept now can leave an earlier kept one unread (a kept ReLU output needs its input no
    # more): the rewritten graphs would not save it, so neither does the plan.
    refined = drop_unread(problem, dataclasses.replace(plan, kept=names_of(problem, best.mask)))
    result = simulate(problem, refined)
    log.debug("fill_budget: recompute cost %.4g -> %.4g", core.recompute_cost, result.recompute_cost)
    info = plan.info.replace(predicted_peak_bytes=result.peak_bytes, recompute_cost=result.recompute_cost, refined=True)
    return dataclasses.replace(refined, info=info)


@dataclasses.dataclass(frozen=True)
class _Weighed:
    """A trial's peak as :func:`fill_budget` judges it: its simulated peak plus ``weight`` bytes per
    byte it keeps beyond ``kept_bytes``."""

    weight: int = 0
    kept_bytes: int = 0

    def peak(self, result) -> int:
        return result.peak_bytes + self.weight * max(0, result.kept_bytes - self.kept_bytes)


@dataclasses.dataclass(frozen=True)
class _Trial:
    """A kept mask with its derived schedule and simulated result (what the next round reads)."""

    mask: bytearray
    nodes: list[int]
    n_fwd: int
    result: Any


def _fill_rounds(
    problem: Problem, start: _Trial, candidates: list[int], budget_bytes: int, weighed: _Weighed
) -> _Trial:
    """Up to ``_ROUNDS`` rounds: keep the candidates the current timeline says fit (in ranking
    order), or their longest prefix that does.  Returns the last trial that fit (``start`` if none)."""
    best = start
    for _ in range(_ROUNDS):
        if not candidates:
            break
        taken = _taken_by_timeline(problem, best, candidates, budget_bytes, weighed)
        if not taken:
            break
        held = _held_after(problem, best.mask, taken)
        fitting: dict[int, _Trial] = {}  # prefix length -> its trial, to reuse
        fits = functools.partial(_prefix_fits, problem, best, taken, held, budget_bytes, weighed, fitting)
        lo = len(taken) if fits(len(taken)) else _longest_prefix(fits, len(taken) - 1)
        settled = set(taken[: max(lo, 1)])  # kept now, or a first value that does not fit even alone
        candidates = [v for v in candidates if v not in settled]
        if lo:
            best = fitting[lo]
    return best


def _taken_by_timeline(
    problem: Problem, trial: _Trial, candidates: list[int], budget_bytes: int, weighed: _Weighed
) -> list[int]:
    """The candidates, in ranking order, that ``trial``'s timeline says fit one after another.

    Kept, a recomputed value's storage lives from its forward step (or, for a value the forward
    phase does not compute, where it would enter it) to its recomputation in backward, on top of
    the timeline: it is taken if the timeline's maximum over that span plus its bytes (and
    ``weighed``'s count of them) fits, and then adds them there.  Values the plan no longer
    recomputes (those taken made them unnecessary) are skipped.  Storages the lower bound of
    :func:`_held_after` leaves out (inputs' views, multi-output values) count no bytes here either.
    """
    import numpy as np

    nodes, n_fwd = trial.nodes, trial.n_fwd
    timeline = np.asarray(trial.result.timeline, dtype=np.int64)
    recomputed_at = {v: i for i, v in enumerate(nodes[n_fwd:], n_fwd)}
    forward_order = nodes[:n_fwd]  # by node index, as the derived schedule orders it
    new_bytes, _ = _new_bytes(problem, trial.mask)
    extra = weighed.peak(trial.result) - trial.result.peak_bytes
    taken = []
    for v in candidates:
        end = recomputed_at.get(v)
        if end is None:
            continue
        # Its forward step, or where it would enter the forward phase.
        begin = max(0, min(bisect.bisect_left(forward_order, v), n_fwd - 1))
        size = new_bytes(v, peek=True)
        if int(timeline[begin:end].max()) + size + extra + weighed.weight * size <= budget_bytes:
            taken.append(v)
            if size:
                new_bytes(v)
                timeline[begin:end] += size
                extra += weighed.weight * size
    return taken


def drop_unread(problem: Problem, plan: Plan) -> Plan:
    """``plan`` without the kept values that no backward step reads.

    A block option that keeps everything keeps values backward never reads (the input of a
    ``tanh`` whose backward reads its output): they save no recomputation, the rewritten graphs
    do not save them (they die after their last forward use), and the simulator would hold
    them to the end of forward, over-predicting a peak there (a loss computed by the caller
    runs there).  Values whose policy is "save" and outputs stay; a plan with an explicit
    schedule keeps the values its backward steps read.  One derived schedule: O(nodes + edges).

    Example (``h = tanh(a)``, whose backward reads ``h`` only):
        >>> from solvers import Node, Plan, Problem
        >>> p = Problem(nodes=(
        ...     Node("x", 4, 0.0, "input"),
        ...     Node("a", 4, 1.0, "forward", ("x",)),
        ...     Node("h", 4, 1.0, "forward", ("a",)),
        ...     Node("loss", 1, 1.0, "forward", ("h",), output=True),
        ...     Node("grad_h", 4, 1.0, "backward", ("loss",)),
        ...     Node("grad_a", 4, 1.0, "backward", ("grad_h", "h"), output=True),
        ... ))
        >>> sorted(drop_unread(p, Plan(kept={"a", "h"})).kept)
        ['h']
    """
    if not plan.kept:
        return plan
    mask = mask_of(problem, plan.kept)
    if plan.schedule is None:
        nodes, n_fwd = derived_schedule(problem, mask)
        backward = nodes[n_fwd:]
    else:
        backward = [problem.index[step.node] for step in plan.schedule if step.phase == BACKWARD_PHASE]
    read = bytearray(len(problem.nodes))
    fwd_preds = problem._fwd_preds
    for v in backward:
        for q in fwd_preds[v]:
            read[q] = 1
    policy, output = problem._policy, problem._output
    unread = [v for v in problem._forward_idx if mask[v] and not read[v] and not output[v] and policy[v] != SAVE_CODE]
    if not unread:
        return plan
    for v in unread:
        mask[v] = 0
    log.debug("drop_unread: %d kept values no backward step reads", len(unread))
    return dataclasses.replace(plan, kept=names_of(problem, mask))


def _prefix_fits(
    problem: Problem,
    base: _Trial,
    candidates: list[int],
    held: list[int],
    budget_bytes: int,
    weighed: _Weighed,
    fitting: dict[int, _Trial],
    k: int,
) -> bool:
    """Whether ``base`` plus the first ``k`` candidates fits at no more cost; a fitting trial is
    recorded in ``fitting``."""
    if held[k] > budget_bytes:
        return False  # its kept storages alone exceed the budget
    # No policy to honour again: ``base`` honours them, no candidate must be recomputed, and
    # keeping more only shrinks the set of recomputed values (so no "save" value joins it).
    mask = bytearray(base.mask)
    for v in candidates[:k]:
        mask[v] = 1
    trial = _Trial(mask, *evaluate_mask_schedule(problem, mask, check=False))
    if weighed.peak(trial.result) <= budget_bytes and trial.result.recompute_cost <= base.result.recompute_cost:
        fitting[k] = trial
        return True
    return False


def _longest_prefix(fits: Callable[[int], bool], n: int) -> int:
    """The longest k in [0, n] with ``fits(k)``, for a predicate that holds up to some k and then
    fails: a binary search, ceil(log2(n + 1)) calls at most."""
    lo, hi = 0, n  # the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _new_bytes(problem: Problem, mask: bytearray) -> tuple[Callable[..., int], int]:
    """``new_bytes(v)``: the bytes keeping ``v`` adds to those ``mask`` keeps, its storage counted
    once (a view pins its base's); ``peek=True`` does not count it as kept afterwards.  With it, the
    bytes of the storages ``mask`` keeps.

    Storages of inputs (resident already) and of multi-output values (their getitems take bytes
    over) count nothing, and values that grow with a routed count (:class:`solvers.SizeGroup`) only
    their fixed part, so that sums of them never exceed what the simulator counts."""
    root, kind = problem._alias_root, problem._kind
    nbytes = problem._cache.get("refine.fixed_bytes")
    if nbytes is None:
        nbytes = problem._cache["refine.fixed_bytes"] = list(problem._bytes)
        for group in problem.size_groups:
            for bound, members in group.members:
                for name, unit in members:
                    nbytes[problem.index[name]] -= unit * bound
    shared = problem._cache.get("refine.multi_output")
    if shared is None:
        shared = problem._cache["refine.multi_output"] = frozenset(p for p in problem._part_of if p >= 0)
    seen: set[int] = set()

    def new_bytes(v: int, *, peek: bool = False) -> int:
        r = root[v]
        if kind[r] != FORWARD_CODE or r in shared or r in seen:
            return 0
        if not peek:
            seen.add(r)
        return nbytes[r]

    kept = sum(new_bytes(v) for v in problem._forward_idx if mask[v])
    return new_bytes, kept


def _held_after(problem: Problem, mask: bytearray, candidates: list[int]) -> list[int]:
    """A lower bound on the peak of ``mask`` plus each prefix of ``candidates`` (entry k: the first k).

    At the last forward step every kept value's storage is alive, with the
    resident bytes: their sum (:func:`_new_bytes`) bounds the peak from below,
    never exceeding the simulator's peak.  O(nodes + candidates).
    """
    new_bytes, kept = _new_bytes(problem, mask)
    total = problem.resident_bytes + kept
    held = [total]
    for v in candidates:
        total += new_bytes(v)
        held.append(total)
    return held
