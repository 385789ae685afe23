"""Chen et al.'s checkpointing heuristics: sqrt(n) segments and the budgeted greedy.

Reference: Tianqi Chen, Bing Xu, Chiyuan Zhang, Carlos Guestrin, "Training
Deep Nets with Sublinear Memory Cost", arXiv:1604.06174, 2016.

Both methods keep only *cut points* of the forward path (the forward nodes
the forward phase computes: ancestors of forward outputs). A cut point is a
node that every forward path passes through: no forward-path edge jumps over
it (on a chain every node is one). Keeping cut points splits the forward pass
into segments that the derived schedule recomputes one at a time during
backward, so memory is roughly kept boundaries + one segment. Real joint
graphs need two refinements: forward nodes off the forward path (transposes
of activations that only backward reads) are ignored, so their reads never
jump over a node; and a node
also counts as a cut point when the values jumping over it hold at most half
of its bytes (an attention mask or rotary table read by every block); those
values are then kept with it.

* :func:`chen_sqrt` keeps a boundary every ~sqrt(n) forward nodes
  (O(sqrt(n)) memory on a chain of n equal nodes, one extra forward pass).
* :func:`chen_greedy` is the budgeted greedy of section 4.2: walk the forward
  nodes accumulating bytes and keep the next cut point once the running sum
  exceeds a threshold ``b``; ``b`` is searched so that the plan fits the
  budget with the least recomputation.

Every candidate is judged by :func:`solvers.simulate` (derived schedule), so a
returned plan always fits. Time: O(nodes + edges) per candidate, at most
~30 candidates for chen_greedy.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

from solvers.errors import InfeasibleBudgetError, format_bytes
from solvers.graph import forward_path, keep_all_mask
from solvers.plan import Plan, SolveInfo
from solvers.problem import INPUT_CODE, RECOMPUTE_CODE, Problem
from solvers.simulator import evaluate_mask, honour_policies_mask, names_of

__all__ = ["chen_sqrt", "chen_greedy", "cut_points", "keep_all_plan", "lowest_peak_plan"]

log = logging.getLogger("solvers.chen")

Progress = Callable[[float, str], None]

# Threshold grid of chen_greedy's memory search: 0 plus this many geometric points.
_GRID_POINTS = 11
_GOLDEN_STEPS = 5
_BISECTION_STEPS = 8


@dataclass(frozen=True)
class _Candidate:
    """One kept set of the Chen family and what simulate() said about it."""

    label: str  # "keep_all", "sqrt" or "b=<threshold>"
    threshold: float | None
    mask: bytearray
    peak_bytes: int
    recompute_cost: float
    n_kept: int


# ------------------------------------------------------------------ building blocks
def _cut_structure(problem: Problem) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]]]:
    """Cut points of the forward path, and the small values crossing each one.

    A forward-path node v is a cut point when the values computed before v
    and read by a forward-path node after v (its *crossing* values) hold at
    most half of v's bytes. Keeping v and those values lets every later
    forward value be recomputed from kept values alone. With nothing
    crossing this is the classic articulation point (every node of a chain);
    the tolerance admits the block boundaries of networks where a small
    value, such as an attention mask or rotary table, is read by every block.
    Bytes are those of the storage a value pins (a view counts its base;
    views of inputs count 0). One sweep with expiry lists: O(nodes + edges).
    Returns (cut points in order, cut point -> crossing values with bytes).
    """
    cached = problem._cache.get("chen.cut_structure")
    if cached is not None:
        return cached
    kind, consumers, nbytes, root = problem._kind, problem._consumers, problem._bytes, problem._alias_root
    path = forward_path(problem)
    position = [-1] * len(problem.nodes)
    for k, v in enumerate(path):
        position[v] = k

    def storage_bytes(v: int) -> int:
        r = root[v]
        return 0 if kind[r] == INPUT_CODE else nbytes[r]

    crossing: dict[int, int] = {}  # value -> its storage bytes, while it crosses the sweep position
    crossing_bytes = 0
    expires: dict[int, list[int]] = {}  # position of a value's last forward-path reader -> values
    cuts: list[int] = []
    extras: dict[int, tuple[int, ...]] = {}
    for k, v in enumerate(path):
        for u in expires.pop(k, ()):
            crossing_bytes -= crossing.pop(u)
        own = storage_bytes(v)
        if 2 * crossing_bytes <= own:
            cuts.append(v)
            if crossing_bytes:
                extras[v] = tuple(u for u, b in crossing.items() if b)
        last = max((position[c] for c in consumers[v] if position[c] > k), default=-1)
        if last >= 0:
            crossing[v] = own
            crossing_bytes += own
            expires.setdefault(last, []).append(v)
    result = (tuple(cuts), extras)
    problem._cache["chen.cut_structure"] = result
    return result


def cut_points(problem: Problem) -> tuple[str, ...]:
    """Names of the forward cut points (see :func:`_cut_structure`), in order.

    >>> cut_points(Problem.training_chain(3))
    ('f1', 'f2', 'f3')
    """
    cuts, _ = _cut_structure(problem)
    return tuple(problem.nodes[v].name for v in cuts)


def _checkpoint(problem: Problem, mask: bytearray, v: int, extras: dict[int, tuple[int, ...]]) -> None:
    """Keep cut point v and the values crossing it (outputs and "recompute" nodes excepted)."""
    output, policy = problem._output, problem._policy
    for u in (v, *extras.get(v, ())):
        if not output[u] and policy[u] != RECOMPUTE_CODE:  # outputs stay alive anyway
            mask[u] = 1


def _honour(problem: Problem, mask: bytearray) -> bytearray:
    # Most graphs have no policies: skip the extra derivation pass then.
    return honour_policies_mask(problem, mask) if any(problem._policy) else mask


def _sqrt_mask(problem: Problem) -> bytearray:
    """Keep a cut point once ~sqrt(n) forward-path nodes have passed since the last one."""
    cuts, extras = _cut_structure(problem)
    path = forward_path(problem)
    segment = max(1, round(math.sqrt(len(path))))
    is_cut = bytearray(len(problem.nodes))
    for v in cuts:
        is_cut[v] = 1
    policy = problem._policy
    mask = bytearray(len(problem.nodes))
    since_last = 0
    for v in path:
        since_last += 1
        if is_cut[v] and since_last >= segment and policy[v] != RECOMPUTE_CODE:
            _checkpoint(problem, mask, v, extras)
            since_last = 0
    return _honour(problem, mask)


def _greedy_mask(problem: Problem, threshold: float) -> bytearray:
    """Chen's sec. 4.2 greedy: checkpoint the next cut point once the running bytes exceed ``threshold``."""
    cuts, extras = _cut_structure(problem)
    is_cut = bytearray(len(problem.nodes))
    for v in cuts:
        is_cut[v] = 1
    nbytes, policy = problem._bytes, problem._policy
    mask = bytearray(len(problem.nodes))
    running = 0
    for v in forward_path(problem):
        running += nbytes[v]
        if is_cut[v] and running > threshold and policy[v] != RECOMPUTE_CODE:
            _checkpoint(problem, mask, v, extras)
            running = 0
    return _honour(problem, mask)


class _Evaluator:
    """Simulates kept masks, memoising identical ones (many thresholds give the same set)."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.by_mask: dict[bytes, _Candidate] = {}
        self.simulations = 0

    def __call__(self, label: str, threshold: float | None, mask: bytearray) -> _Candidate:
        key = bytes(mask)
        found = self.by_mask.get(key)
        if found is None:
            self.simulations += 1
            core = evaluate_mask(self.problem, mask)
            found = _Candidate(label, threshold, mask, core.peak_bytes, core.recompute_cost, sum(mask))
            self.by_mask[key] = found
            return found
        # Same kept set as an earlier candidate: reuse its numbers, keep this threshold.
        return dataclasses.replace(found, label=label, threshold=threshold)


def _thresholds(problem: Problem) -> list[float]:
    """0 plus a geometric grid from the smallest node size to all forward-path bytes (= keep none)."""
    sizes = [problem._bytes[v] for v in forward_path(problem) if problem._bytes[v] > 0]
    if not sizes:
        return [0.0]
    low, high = float(min(sizes)), float(sum(sizes))
    if high <= low:
        return [0.0, high]
    ratio = (high / low) ** (1.0 / (_GRID_POINTS - 1))
    grid = [low * ratio**t for t in range(_GRID_POINTS)]
    grid[-1] = high
    return [0.0] + grid


def _memory_search(
    problem: Problem, progress: Progress | None = None
) -> tuple[tuple[_Candidate, ...], tuple[_Candidate, ...]]:
    """Evaluate keep-all, sqrt and the threshold grid, then refine around the lowest peak.

    Deterministic, and cached on the problem: :func:`lowest_peak_plan`
    (hence min_feasible_budget) and :func:`chen_greedy` see the same family,
    so chen_greedy succeeds for every budget >= min_feasible_budget.
    Returns (every distinct candidate, the threshold candidates sorted by threshold).
    """
    cached = problem._cache.get("chen.memory_search")
    if cached is not None:
        return cached
    evaluate = _Evaluator(problem)
    expected = 2 + _GRID_POINTS + 1 + _GOLDEN_STEPS + 1

    def report(message: str) -> None:
        if progress is not None:
            progress(min(0.99, evaluate.simulations / (expected + _BISECTION_STEPS)), message)

    evaluate("keep_all", None, keep_all_mask(problem))
    evaluate("sqrt", None, _sqrt_mask(problem))
    grid: list[_Candidate] = []
    for b in _thresholds(problem):
        grid.append(evaluate(f"b={b:.6g}", b, _greedy_mask(problem, b)))
        report(f"chen_greedy: threshold {format_bytes(b)}")

    # Peak is roughly U-shaped in b (small b keeps many boundaries, large b
    # leaves long segments): golden-section search between the neighbours of
    # the best grid point.
    best = min(range(len(grid)), key=lambda j: (grid[j].peak_bytes, grid[j].threshold))
    lo = grid[max(best - 1, 0)].threshold or 0.0
    hi = grid[min(best + 1, len(grid) - 1)].threshold or 0.0
    refined: list[_Candidate] = []
    inv_phi = (math.sqrt(5) - 1) / 2
    x1, x2 = hi - inv_phi * (hi - lo), lo + inv_phi * (hi - lo)
    c1 = evaluate(f"b={x1:.6g}", x1, _greedy_mask(problem, x1))
    c2 = evaluate(f"b={x2:.6g}", x2, _greedy_mask(problem, x2))
    refined += [c1, c2]
    for _ in range(_GOLDEN_STEPS - 1):
        if hi - lo < 1.0:
            break
        if c1.peak_bytes <= c2.peak_bytes:
            hi, x2, c2 = x2, x1, c1
            x1 = hi - inv_phi * (hi - lo)
            c1 = evaluate(f"b={x1:.6g}", x1, _greedy_mask(problem, x1))
            refined.append(c1)
        else:
            lo, x1, c1 = x1, x2, c2
            x2 = lo + inv_phi * (hi - lo)
            c2 = evaluate(f"b={x2:.6g}", x2, _greedy_mask(problem, x2))
            refined.append(c2)
        report("chen_greedy: refining the lowest-memory threshold")

    by_threshold = tuple(sorted(grid + refined, key=lambda c: c.threshold or 0.0))
    result = (tuple(evaluate.by_mask.values()), by_threshold)
    problem._cache["chen.memory_search"] = result
    log.debug("chen memory search: %d simulations, lowest peak %d", evaluate.simulations, _lowest(result[0]).peak_bytes)
    return result


def _lowest(candidates) -> _Candidate:
    return min(candidates, key=lambda c: (c.peak_bytes, c.recompute_cost))


def _to_plan(
    problem: Problem, cand: _Candidate, method: str, budget_bytes: int | None, started: float, simulations: int
) -> Plan:
    info = SolveInfo(
        predicted_peak_bytes=cand.peak_bytes,
        recompute_cost=cand.recompute_cost,
        solve_seconds=time.perf_counter() - started,
        candidate=cand.label,
        simulations=simulations,
        # Whole bytes, as SolveInfo declares and plan files read them: for the integer running bytes the greedy
        # compares, "running > b" and "running > floor(b)" pick the same cut points.
        threshold_bytes=None if cand.threshold is None else math.floor(cand.threshold),
    )
    return Plan(kept=names_of(problem, cand.mask), method=method, budget_bytes=budget_bytes, info=info)


# ------------------------------------------------------------------------- public
def keep_all_plan(problem: Problem, *, own_checkpoints: bool = False) -> Plan:
    """The plan that keeps every forward value a backward node reads (:func:`solvers.graph.keep_all_mask`).

    This is what eager PyTorch does; its peak is the "keep-all peak", the
    largest budget worth asking for.  ``own_checkpoints=True``: except what
    the model's own ``torch.utils.checkpoint`` regions recompute as written.
    """
    return Plan(kept=names_of(problem, keep_all_mask(problem, own_checkpoints=own_checkpoints)), method="keep_all")


def lowest_peak_plan(problem: Problem) -> Plan:
    """The lowest-peak plan of the Chen family (keep-all, sqrt, and the thresholds chen_greedy tries).

    Its ``info.predicted_peak_bytes`` is :func:`solvers.min_feasible_budget`.
    Cached on the problem; about 20 simulations the first time.
    """
    started = time.perf_counter()
    family, _ = _memory_search(problem)
    return _to_plan(problem, _lowest(family), "chen_greedy", None, started, len(family))


def chen_sqrt(
    problem: Problem,
    budget_bytes: int | None = None,
    *,
    progress: Progress | None = None,
    time_limit: float | None = None,
) -> Plan:
    """Keep a cut point every ~sqrt(n) forward nodes (Chen et al. 2016, sec. 4.1).

    Parameters
    ----------
    problem : Problem
    budget_bytes : int or None
        Not used to build the plan; if given and the plan's simulated peak
        exceeds it, InfeasibleBudgetError is raised.
    progress, time_limit :
        Accepted for a uniform method signature; this method takes one pass.

    Complexity: O(nodes + edges).

    Examples
    --------
    >>> plan = chen_sqrt(Problem.training_chain(9))
    >>> sorted(plan.kept)   # f9, the loss, is an output: alive anyway
    ['f3', 'f6']
    """
    started = time.perf_counter()
    evaluate = _Evaluator(problem)
    cand = evaluate("sqrt", None, _sqrt_mask(problem))
    if budget_bytes is not None and cand.peak_bytes > budget_bytes:
        lowest = _lowest(_memory_search(problem)[0]).peak_bytes
        raise InfeasibleBudgetError(
            budget_bytes,
            lowest,
            f"chen_sqrt's plan peaks at {format_bytes(cand.peak_bytes)} ({cand.peak_bytes} bytes), above the "
            f"budget {format_bytes(budget_bytes)} ({budget_bytes} bytes); the smallest feasible budget for "
            f"this graph is {format_bytes(lowest)} ({lowest} bytes) (try method='chen_greedy' or 'auto')",
        )
    if progress is not None:
        progress(1.0, "chen_sqrt: done")
    return _to_plan(problem, cand, "chen_sqrt", budget_bytes, started, evaluate.simulations)


def chen_greedy(
    problem: Problem, budget_bytes: int, *, progress: Progress | None = None, time_limit: float | None = None
) -> Plan:
    """Chen's budgeted greedy: the cheapest plan of the threshold family that fits.

    Problem: choose forward cut points to keep so that the derived schedule's
    simulated peak is <= ``budget_bytes`` and the recomputation cost is small.

    Algorithm (Chen et al. 2016, sec. 4.2): for a threshold b, walk forward
    nodes in order summing their bytes and keep the next cut point once the
    sum exceeds b (then restart the sum). The peak is roughly U-shaped in b
    and recomputation shrinks as b shrinks, so: evaluate keep-all, the sqrt
    plan and a geometric grid of b; golden-section refine the lowest peak;
    then bisect b between the largest grid point that does not fit and the
    smallest that does, to find the smallest fitting b. The cheapest fitting
    candidate wins (ties: lower peak).

    Complexity: O(nodes + edges) per candidate, at most ~30 candidates.

    Raises
    ------
    InfeasibleBudgetError
        If no candidate fits; its min_feasible_bytes is the lowest peak of the
        family, which is :func:`solvers.min_feasible_budget`.

    Examples
    --------
    >>> p = Problem.training_chain(16)
    >>> plan = chen_greedy(p, 12)
    >>> plan.info.predicted_peak_bytes <= 12
    True
    """
    started = time.perf_counter()
    family, by_threshold = _memory_search(problem, progress)
    # A fresh memo per call, so the result never depends on earlier calls.
    evaluate = _Evaluator(problem)
    evaluate.by_mask = {bytes(c.mask): c for c in family}
    lowest = _lowest(family)
    if lowest.peak_bytes > budget_bytes:
        raise InfeasibleBudgetError(budget_bytes, lowest.peak_bytes)

    def cheapest() -> _Candidate:
        fitting = [c for c in evaluate.by_mask.values() if c.peak_bytes <= budget_bytes]
        return min(fitting, key=lambda c: (c.recompute_cost, c.peak_bytes, c.n_kept))

    # Bisection for the smallest fitting threshold, bracketed by the
    # memoised search (peak decreases with b left of the U's bottom).
    if cheapest().recompute_cost > 0:
        fits = [j for j, c in enumerate(by_threshold) if c.peak_bytes <= budget_bytes]
        if fits and fits[0] > 0:
            first = fits[0]
            lo, hi = by_threshold[first - 1].threshold or 0.0, by_threshold[first].threshold or 0.0
            for _ in range(_BISECTION_STEPS):
                if hi - lo < 1.0:
                    break
                mid = (lo + hi) / 2
                cand = evaluate(f"b={mid:.6g}", mid, _greedy_mask(problem, mid))
                if cand.peak_bytes <= budget_bytes:
                    hi = mid
                else:
                    lo = mid
                if progress is not None:
                    progress(0.9, f"chen_greedy: bisecting the threshold ({format_bytes(mid)})")
    best = cheapest()
    if progress is not None:
        progress(1.0, "chen_greedy: done")
    log.debug(
        "chen_greedy: %s, peak %d, recompute cost %g (%d bisection simulations)",
        best.label,
        best.peak_bytes,
        best.recompute_cost,
        evaluate.simulations,
    )
    return _to_plan(problem, best, "chen_greedy", budget_bytes, started, len(family) + evaluate.simulations)
