"""Spend leftover budget: keep more of what a derived-schedule plan recomputes.

Heuristic plans (Chen's segments, the budgeted greedy) often peak well below
the budget: they cut at coarse points.  :func:`fill_budget` keeps additional
recomputed values, best ratio of recompute cost saved to bytes first, as long
as the simulated peak stays within the budget.  Keeping a value never adds a
recomputation, so the cost can only fall; the simulator decides the peak.

Candidates are ranked once; a binary search finds the longest prefix of the
ranking that still fits, then the rest are retried in smaller prefixes, by an
exponential search from the short end (after the first round most of them no
longer fit, and finding that out costs one simulation instead of log2(n)).
A prefix whose kept storages alone (all alive at the end of the forward phase)
exceed the budget is refused without simulating it.
Time: O(log(n) * rounds) simulations, each O((nodes + edges) log nodes).

Example:
    >>> from solvers import Problem, Plan, simulate
    >>> p = Problem.training_chain(8)
    >>> sparse = Plan(kept=set())
    >>> better = fill_budget(p, sparse, simulate(p, sparse).peak_bytes + 3)
    >>> simulate(p, better).recompute_cost <= simulate(p, sparse).recompute_cost
    True
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

from solvers.plan import BACKWARD_PHASE, Plan
from solvers.problem import SAVE_CODE, Problem
from solvers.simulator import derived_schedule, evaluate_mask, honour_policies_mask, mask_of, names_of, simulate

__all__ = ["fill_budget", "drop_unread"]

log = logging.getLogger("solvers.refine")

_FORWARD = 1
_RECOMPUTE = 2
_ROUNDS = 4


def fill_budget(problem: Problem, plan: Plan, budget_bytes: int, *, kept_weight: int = 0) -> Plan:
    """A plan at most as costly as ``plan`` (derived schedule) that still fits the budget.

    ``kept_weight``: every byte a trial keeps beyond what ``plan`` keeps also raises the peak by this
    many bytes.  A graph run several times in a step (layers compiled once) is planned with its
    earlier runs in the baseline, each keeping what ``plan`` keeps: a trial that keeps more keeps it
    in each of them too.  Plans with an explicit schedule are returned unchanged.
    """
    if plan.schedule is not None:
        return plan
    mask = honour_policies_mask(problem, mask_of(problem, plan.kept))
    core = evaluate_mask(problem, mask)
    if core.peak_bytes > budget_bytes or core.recompute_steps == 0:
        return plan
    recomputed = _recomputed(problem, mask)
    nbytes, cost, policy = problem._bytes, problem._cost, problem._policy
    candidates = [v for v in recomputed if policy[v] != _RECOMPUTE]
    # Best saving per byte first; free values (views) first of all.
    candidates.sort(key=lambda v: (-(cost[v] / nbytes[v]) if nbytes[v] else float("-inf"), v))
    weighed = _Weighed(kept_weight, core.kept_bytes)
    mask, best_cost, _ = _fill_rounds(problem, mask, candidates, budget_bytes, core.recompute_cost, weighed)
    if best_cost >= core.recompute_cost:
        return plan
    # A value kept now can leave an earlier kept one unread (a kept ReLU output needs its input no
    # more): the rewritten graphs would not save it, so neither does the plan.
    refined = drop_unread(problem, dataclasses.replace(plan, kept=names_of(problem, mask)))
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


def _fill_rounds(
    problem: Problem,
    mask: bytearray,
    candidates: list[int],
    budget_bytes: int,
    best_cost: float,
    weighed: _Weighed = _Weighed(),
) -> tuple[bytearray, float, list[int]]:
    """Keep the longest fitting prefix of ``candidates`` on top of ``mask``, then of what is left, for
    up to ``_ROUNDS`` rounds.  Returns the new mask, its recompute cost and the candidates left."""
    for round_ in range(_ROUNDS):
        if not candidates:
            break
        held = _held_after(problem, mask, candidates)
        fitting: dict[int, tuple[bytearray, float]] = {}  # prefix length -> (mask, cost), to reuse
        fits = functools.partial(
            _prefix_fits, problem, mask, candidates, held, budget_bytes, best_cost, fitting, weighed
        )
        lo = _longest_prefix(fits, len(candidates), gallop=round_ > 0)
        if lo == 0:
            candidates = candidates[1:]  # the best single candidate does not fit: skip it
            continue
        mask, best_cost = fitting[lo]  # simulated already
        candidates = candidates[lo:]
    return mask, best_cost, candidates


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
    mask: bytearray,
    candidates: list[int],
    held: list[int],
    budget_bytes: int,
    best_cost: float,
    fitting: dict[int, tuple[bytearray, float]],
    weighed: _Weighed,
    k: int,
) -> bool:
    """Whether ``mask`` plus the first ``k`` candidates fits; a fitting trial is recorded in ``fitting``."""
    if held[k] > budget_bytes:
        return False  # its kept storages alone exceed the budget
    # No policy to honour again: ``mask`` honours them, no candidate must be recomputed, and
    # keeping more only shrinks the set of recomputed values (so no "save" value joins it).
    trial = bytearray(mask)
    for v in candidates[:k]:
        trial[v] = 1
    result = evaluate_mask(problem, trial, check=False)
    if weighed.peak(result) <= budget_bytes and result.recompute_cost <= best_cost:
        fitting[k] = (trial, result.recompute_cost)
        return True
    return False


def _longest_prefix(fits: Callable[[int], bool], n: int, *, gallop: bool) -> int:
    """The longest k in [0, n] with ``fits(k)``, for a predicate that holds up to some k and then fails.

    Binary search (log2(n) calls), or with ``gallop`` an exponential search
    from the short end (1, 2, 4, ... then binary search below the first
    failure: about 2*log2(k) calls), cheaper when the answer k is small, as
    in the rounds after the first, where most remaining candidates no longer fit.
    """
    lo, hi = 0, n  # the answer is in [lo, hi]
    if gallop:
        step = 1
        while step <= n and fits(step):
            lo, step = step, step * 2
        hi = min(step - 1, n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _held_after(problem: Problem, mask: bytearray, candidates: list[int]) -> list[int]:
    """A lower bound on the peak of ``mask`` plus each prefix of ``candidates`` (entry k: the first k).

    At the last forward step every kept value's storage is alive, with the
    resident bytes: their sum bounds the peak from below.  Storages of inputs
    (resident already) and of multi-output values (their getitems take bytes
    over) are left out, and values that grow with a routed count
    (:class:`solvers.SizeGroup`) count only their fixed part, so the bound
    never exceeds the simulator's peak.  O(nodes + candidates).
    """
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

    def new_bytes(v: int) -> int:
        r = root[v]
        if kind[r] != _FORWARD or r in shared or r in seen:
            return 0
        seen.add(r)
        return nbytes[r]

    total = problem.resident_bytes + sum(new_bytes(v) for v in problem._forward_idx if mask[v])
    held = [total]
    for v in candidates:
        total += new_bytes(v)
        held.append(total)
    return held


def _recomputed(problem: Problem, mask: bytearray) -> list[int]:
    """Forward nodes the derived schedule of ``mask`` recomputes in backward."""
    nodes, n_fwd = derived_schedule(problem, mask)
    kind = problem._kind
    return list(dict.fromkeys(v for v in nodes[n_fwd:] if kind[v] == _FORWARD))
