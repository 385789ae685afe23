"""Entry point: ``solve(problem, budget_bytes, method)``, the method registry, and the floor.

Every method is a function ``(problem, budget_bytes, **options) -> Plan``.
:func:`solve` runs one, then re-judges the plan with :func:`solvers.simulate`
(never trusting a method's own bookkeeping) and fills ``plan.info`` (a :class:`~solvers.plan.SolveInfo`).

The "hierarchical" and "ilp" methods live in :mod:`solvers.hierarchical` and
:mod:`solvers.ilp`; they are imported on first use so that ``import solvers``
stays fast and never pulls in numpy or pulp.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import time
from typing import Any, Callable, NamedTuple

from solvers.chen import Progress, chen_greedy, chen_sqrt
from solvers.errors import InfeasibleBudgetError, InvalidPlanError, SolverError, format_bytes
from solvers.plan import Plan
from solvers.problem import Problem
from solvers.refine import drop_unread, fill_budget
from solvers.simulator import SimResult, simulate

__all__ = ["solve", "METHODS", "min_feasible_budget", "lowest_peak_plan", "auto"]

log = logging.getLogger("solvers.api")

Method = Callable[..., Plan]

# auto's size rules: the MILP is exact but its size grows quadratically with
# the graph, so it is only tried on small graphs and stopped by a deterministic
# work limit, never by the clock: plans must not depend on machine load (every
# rank plans on its own).  The time a checkpoint takes grows with the model: a
# random 60-node graph's MILP (about 4,300 variables) takes 0.5 s to its limit,
# a 3-layer MLP's (172 nodes, 53 forward, about 10,100 variables) 27 s on one
# core, for the hierarchical solver's plan; so only models up to about 6,000
# variables are tried.  The estimate (:meth:`MilpModel.estimate_size`) counts the
# keep, recompute and alive-entering-a-stage variables, not the auxiliary liveness
# variables the memory constraints add: a 6-layer MLP of fake-quantized ReLUs
# estimated at 5,920 builds 17,331 and takes 8-20 s to its limit.
AUTO_ILP_MAX_FORWARD_NODES = 60
AUTO_ILP_MAX_NODES = 5000
AUTO_ILP_MAX_VARIABLES = 6000
AUTO_ILP_WORK_LIMIT = 30
# A wall-clock safety only: a MILP still running after this long (a machine
# hundreds of times slower than expected) is dropped, with a warning.
AUTO_ILP_SAFETY_SECONDS = 120.0
#: auto's run of the hierarchical solver on the problem with every data-dependent size at its bound.
AT_BOUNDS = "hierarchical at bounds"


def lowest_peak_plan(problem: Problem) -> Plan:
    """The plan with the lowest simulated peak that ckptc's plan families reach.

    The lower of the hierarchical space's lowest peak (per-block options,
    found by bisection over its DP) and the Chen family's (keep-all, sqrt(n)
    segments, the greedy's thresholds). This is the one floor computation:
    :func:`min_feasible_budget`, :func:`auto`'s errors and ckptc's reports
    all read it. Cached on the problem.
    """
    cached = problem._cache.get("api.lowest_peak_plan")
    if cached is not None:
        return cached
    from solvers.chen import lowest_peak_plan as chen_lowest
    from solvers.hierarchical import lowest_peak_plan as hierarchical_lowest

    plans = []
    candidates = [hierarchical_lowest(problem), chen_lowest(problem)]
    if problem.size_groups:
        # The families search with per-block bytes that a shared total makes non-additive: their plans for
        # every count at its bound are candidates too (priced here), so the floor is never above theirs.
        for plan in (hierarchical_lowest(at_bounds(problem)), chen_lowest(at_bounds(problem))):
            result = simulate(problem, plan)
            info = plan.info.replace(predicted_peak_bytes=result.peak_bytes, recompute_cost=result.recompute_cost)
            candidates.append(dataclasses.replace(plan, info=info))
    for plan in candidates:
        trimmed = drop_unread(problem, plan)
        if trimmed is not plan:
            result = simulate(problem, trimmed)
            trimmed = dataclasses.replace(
                trimmed,
                info=plan.info.replace(predicted_peak_bytes=result.peak_bytes, recompute_cost=result.recompute_cost),
            )
        plans.append(trimmed)
    best = min(plans, key=lambda p: (p.info.predicted_peak_bytes, p.info.recompute_cost))
    problem._cache["api.lowest_peak_plan"] = best
    return best


def at_bounds(problem: Problem) -> Problem:
    """``problem`` with every data-dependent size at its bound (no :class:`~solvers.problem.SizeGroup`).

    A plan that fits it fits ``problem``: the groups' worst split never exceeds the bounds.
    """
    if not problem.size_groups:
        return problem
    plain = problem._cache.get("api.at_bounds")
    if plain is None:
        plain = problem._cache["api.at_bounds"] = Problem(problem.nodes, problem.baseline_bytes)
    return plain


def min_feasible_budget(problem: Problem) -> int:
    """The smallest budget for which ``solve(method="auto")`` succeeds.

    The simulated peak of :func:`lowest_peak_plan`. It is an *upper bound* on
    the true minimum peak over all schedules: ilp may recompute values several
    times and fit below it on small graphs.

    Examples
    --------
    >>> min_feasible_budget(Problem.training_chain(16)) < 17
    True
    """
    return int(lowest_peak_plan(problem).info.predicted_peak_bytes)


def _lazy(module: str, function: str) -> Method:
    """A registry entry that imports ``solvers.<module>`` on first call."""

    def call(problem: Problem, budget_bytes: int, **options: Any) -> Plan:
        fn = getattr(importlib.import_module(f"solvers.{module}"), function)
        return fn(problem, budget_bytes, **options)

    call.__name__ = call.__qualname__ = function
    call.__doc__ = f"Lazy entry for solvers.{module}.{function} (see that module)."
    return call


def _sub_progress(progress: Progress | None, start: float, end: float) -> Progress | None:
    if progress is None:
        return None
    return lambda fraction, message: progress(start + (end - start) * fraction, message)


def auto(
    problem: Problem,
    budget_bytes: int,
    *,
    time_limit: float = 60.0,
    progress: Progress | None = None,
    ilp_max_forward_nodes: int = AUTO_ILP_MAX_FORWARD_NODES,
    ilp_work_limit: int = AUTO_ILP_WORK_LIMIT,
    kept_weight: int = 0,
    kept_allowance: int = 0,
) -> Plan:
    """The cheapest plan that fits, among the methods suited to the graph.

    Order: hierarchical (per-block option menus and an exact chain DP; its
    candidates include keeping everything and per-block checkpointing, so
    the result is never worse than either; stops here if nothing is
    recomputed), chen_greedy, then ilp when the graph is small
    (<= ``ilp_max_forward_nodes`` forward nodes, <= 5,000 nodes and a MILP of
    an estimated <= 6,000 variables, auxiliary ones not counted), started from the best plan found before it, on
    one thread and stopped after ``ilp_work_limit`` units of deterministic work. The plan depends on the
    problem and budget only, never on the machine's load: ``time_limit`` does
    not cut any of these searches (only ``method="ilp"`` honours it); an ILP
    still running after :data:`AUTO_ILP_SAFETY_SECONDS` is dropped with a
    warning. Derived-schedule plans then drop
    kept values no backward step reads (:func:`solvers.refine.drop_unread`) and
    keep more where the budget allows (:func:`solvers.refine.fill_budget`; with ``kept_weight``, each
    byte kept beyond ``kept_allowance`` counted once more per weight: a graph whose earlier runs in the
    step, counted in the baseline at ``kept_allowance`` bytes each, keep what its plan keeps).
    If none fits, the floor plan (:func:`lowest_peak_plan`) is the last
    candidate. Every plan is judged by simulate(); the winner has the least
    recompute cost (ties: lower peak, earlier method). A method that fails
    otherwise than with InfeasibleBudgetError is logged and recorded in
    ``info.tried``; auto goes on.

    Raises
    ------
    InfeasibleBudgetError
        If nothing fits; ``min_feasible_bytes`` is :func:`min_feasible_budget`.
    """
    runs: list[tuple[str, dict[str, Any]]] = [("hierarchical", {}), ("chen_greedy", {})]
    if problem.size_groups:
        # The hierarchical menus add per-block bytes, which a shared total makes non-additive: its plan
        # for every count at its bound is a candidate too (it fits here), so no plan costs more than that.
        runs.insert(1, (AT_BOUNDS, {}))
    if _ilp_is_small(problem, ilp_max_forward_nodes):
        # A refusal's floor is auto's own (the lowest-peak plan): the MILP's least peak is not solved for.
        ilp_options = {
            "time_limit": AUTO_ILP_SAFETY_SECONDS,
            "work_limit": ilp_work_limit,
            "threads": 1,
            "least_feasible": False,
        }
        runs.append(("ilp", ilp_options))

    fitting: list[tuple[bool, float, int, int, Plan]] = []
    tried: dict[str, Any] = {}
    for k, (name, extra) in enumerate(runs):
        options = {
            "time_limit": time_limit,
            **extra,
            "progress": _sub_progress(progress, k / len(runs), (k + 1) / len(runs)),
        }
        if name == "ilp" and fitting:
            options["start"] = _best(fitting)  # the best plan so far, to improve on
        started = time.perf_counter()
        try:
            if name == AT_BOUNDS:
                plan = METHODS["hierarchical"](at_bounds(problem), budget_bytes, **options)
            else:
                plan = METHODS[name](problem, budget_bytes, **options)
            plan, result = _spent(problem, plan, budget_bytes, kept_weight, kept_allowance)
        except InfeasibleBudgetError:
            tried[name] = {"status": "infeasible", "seconds": time.perf_counter() - started}
            log.info("auto: %s found no plan within %s", name, format_bytes(budget_bytes))
            continue
        except Exception as e:
            # A failure of one method (a model too large, an invalid plan, a bug)
            # must not cost the user the plans of the others; calling it directly raises.
            tried[name] = {
                "status": "error",
                "error": f"{type(e).__name__}: {e}",
                "seconds": time.perf_counter() - started,
            }
            if isinstance(e, SolverError) and not isinstance(e, InvalidPlanError):
                log.warning("auto: method %s gave up (%s); continuing without it", name, e)
            else:
                log.error("auto: method %s failed; continuing without it", name, exc_info=True)
            continue
        if plan.info.status == "time_limit":
            # Cut by the clock, not by the work limit: another process could get another plan.
            tried[name] = {"status": "safety_time_limit", "seconds": time.perf_counter() - started}
            log.warning(
                "auto: %s was still solving after its %g s safety limit (a very slow or overloaded machine); "
                "its plan is dropped so that planning stays deterministic",
                name,
                AUTO_ILP_SAFETY_SECONDS,
            )
            continue
        tried[name] = {
            "peak_bytes": result.peak_bytes,
            "recompute_cost": result.recompute_cost,
            "seconds": time.perf_counter() - started,
        }
        if result.peak_bytes > budget_bytes:
            tried[name]["status"] = "over_budget"
            log.warning(
                "auto: %s returned a plan peaking at %d bytes, over the budget %d; ignored",
                name,
                result.peak_bytes,
                budget_bytes,
            )
            continue
        tried[name]["status"] = "fits"
        # Under a kept weight, a plan that keeps so much more than the allowance that it would not fit
        # beside runs keeping what it keeps comes after every plan that would.
        over = bool(kept_weight) and _beside_runs(result, kept_weight, kept_allowance) > budget_bytes
        fitting.append((over, result.recompute_cost, result.peak_bytes, k, plan))
        if result.recompute_cost == 0 and not over:
            break  # nothing recomputed: no other method can be cheaper
    if not fitting:
        floor = lowest_peak_plan(problem)
        if floor.info.predicted_peak_bytes <= budget_bytes:
            fitting.append((False, floor.info.recompute_cost, floor.info.predicted_peak_bytes, len(runs), floor))
            tried["floor"] = {"status": "fits", "peak_bytes": floor.info.predicted_peak_bytes}
    if progress is not None:
        progress(1.0, "auto: done")
    if not fitting:
        raise InfeasibleBudgetError(budget_bytes, min_feasible_budget(problem))
    best = _best(fitting)
    return dataclasses.replace(best, info=best.info.replace(chosen=best.method, tried=tried))


def _best(fitting: list[tuple[bool, float, int, int, Plan]]) -> Plan:
    """The plan auto prefers among ``(over, recompute cost, peak, method index, plan)``: one that fits beside
    its runs first, then the least recompute, then the lowest peak, then the earlier method."""
    return min(fitting, key=lambda t: t[:4])[-1]


def _beside_runs(result: SimResult, kept_weight: int, kept_allowance: int) -> int:
    """A plan's peak beside its graph's earlier runs in the step, each keeping what it keeps: every byte it
    keeps beyond ``kept_allowance`` counted once more per weight (as :func:`fill_budget` counts them)."""
    return result.peak_bytes + kept_weight * max(0, result.kept_bytes - kept_allowance)


def _spent(
    problem: Problem, plan: Plan, budget_bytes: int, kept_weight: int, kept_allowance: int
) -> tuple[Plan, SimResult]:
    """A method's plan as auto judges it, with its simulation.

    A derived-schedule plan keeps no value that no backward step reads and keeps more where the
    budget allows (:func:`fill_budget`).  A plan with an explicit schedule (nested recomputation, the
    MILP's) cannot be filled; its kept set under a derived schedule, filled, is taken instead where
    that fits and recomputes less: a nested plan whose recomputation keeps the peak far below the
    budget left it unspent (a quantization-aware MLP: 15% of the budget left, at 23x the recompute of
    the filled plan of the same kept set).
    """
    allowance = kept_allowance if kept_weight else None

    def filled(plan: Plan) -> tuple[Plan, SimResult]:
        plan = fill_budget(
            problem, drop_unread(problem, plan), budget_bytes, kept_weight=kept_weight, kept_allowance=allowance
        )
        return plan, simulate(problem, plan)

    if plan.schedule is None:
        return filled(plan)
    result = simulate(problem, plan)
    derived, derived_result = filled(dataclasses.replace(plan, schedule=None))
    fits = _beside_runs(derived_result, kept_weight, kept_allowance) <= budget_bytes
    if fits and derived_result.recompute_cost < result.recompute_cost:
        return derived, derived_result
    return plan, result


def _ilp_is_small(problem: Problem, max_forward_nodes: int) -> bool:
    """Whether auto tries the MILP: few forward nodes and nodes, and a small model (estimated before building)."""
    if len(problem._forward_idx) > max_forward_nodes or len(problem) > AUTO_ILP_MAX_NODES:
        return False
    from solvers.milp import MilpModel, stage_graph

    try:
        MilpModel.estimate_size(stage_graph(problem), AUTO_ILP_MAX_VARIABLES)
    except SolverError:
        return False
    return True


METHODS: dict[str, Method] = {
    "chen_sqrt": chen_sqrt,
    "chen_greedy": chen_greedy,
    "hierarchical": _lazy("hierarchical", "hierarchical"),
    "ilp": _lazy("ilp", "ilp"),
    "auto": auto,
}


def solve(
    problem: Problem,
    budget_bytes: int,
    method: str = "auto",
    *,
    time_limit: float = 60.0,
    progress: Progress | None = None,
    **options: Any,
) -> Plan:
    """Find a plan whose simulated peak memory is at most ``budget_bytes``.

    Problem: choose which forward values to keep (and, for some methods, an
    explicit recomputation schedule) so that the step's peak memory fits in
    the budget while recomputing as little as possible.

    Parameters
    ----------
    problem : Problem
    budget_bytes : int
        Peak-memory budget, counting inputs and ``problem.baseline_bytes``.
    method : str
        A key of :data:`METHODS`: "chen_sqrt", "chen_greedy", "hierarchical",
        "ilp" or "auto".
    time_limit : float
        Seconds the method may spend (honoured by ilp only: auto and hierarchical stop at
        deterministic work limits, so their plans never depend on machine load).
    progress : callable(fraction, message) or None
        Called now and then by long solves.
    **options :
        Passed to the method.

    Returns
    -------
    Plan
        With ``budget_bytes`` set and ``info`` holding predicted_peak_bytes
        and recompute_cost (from simulate) and solve_seconds (wall time of
        this call), plus whatever the method added.

    Raises
    ------
    InfeasibleBudgetError
        If the method finds no plan within the budget.
    SolverError
        If a method returns a plan that simulate() finds over budget (a bug).
    ValueError
        For an unknown method or a negative budget.

    Examples
    --------
    >>> plan = solve(Problem.training_chain(16), 12)
    >>> plan.info.predicted_peak_bytes <= 12
    True
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
    function = METHODS.get(method)
    if function is None:
        raise ValueError(f"unknown method {method!r}; choose one of {sorted(METHODS)}")
    started = time.perf_counter()
    memo_key = _memo_key(method, budget_bytes, time_limit, options)
    memo = problem._cache.get(memo_key) if memo_key is not None else None
    if isinstance(memo, _Refused):
        raise InfeasibleBudgetError(*memo)
    if memo is not None:
        log.debug("solve(%s): the plan found earlier for this graph and budget", method)
        return memo
    try:
        plan = _solve(problem, budget_bytes, method, function, time_limit, progress, options, started)
    except InfeasibleBudgetError as e:
        if memo_key is not None:
            # Its fields, not the error: a traceback would keep the frames of the caller's step alive.
            problem._cache[memo_key] = _Refused(e.budget_bytes, e.min_feasible_bytes, str(e))
        raise
    if memo_key is not None:
        problem._cache[memo_key] = plan
    return plan


class _Refused(NamedTuple):
    """A refusal :func:`solve` remembers (:class:`InfeasibleBudgetError`'s arguments)."""

    budget_bytes: int
    min_feasible_bytes: int | None
    message: str


def _memo_key(method: str, budget_bytes: int, time_limit: float, options: dict[str, Any]) -> tuple | None:
    """Where :func:`solve` keeps its answer on the problem: methods are deterministic in the problem,
    the budget and their options (auto's MILP stops at a work limit, not the clock), so a graph planned
    again at a budget it was planned at gets the same plan without solving.  None where an option
    cannot be a key.  A wall-clock ``time_limit`` is part of the key: a longer one is solved again."""
    try:
        # The registry is part of the key: a method replaced there (a wrapper, a test's) solves anew.
        key = ("api.solve", method, tuple(METHODS.items()), budget_bytes, time_limit, tuple(sorted(options.items())))
        hash(key)
    except TypeError:
        return None
    return key


def _solve(
    problem: Problem,
    budget_bytes: int,
    method: str,
    function: Method,
    time_limit: float,
    progress: Progress | None,
    options: dict[str, Any],
    started: float,
) -> Plan:
    plan = function(problem, budget_bytes, time_limit=time_limit, progress=progress, **options)
    if function is not auto:  # auto's candidates are trimmed already
        plan = drop_unread(problem, plan)
    result = simulate(problem, plan)
    if result.peak_bytes > budget_bytes:
        raise SolverError(
            f"method {method!r} returned a plan peaking at {result.peak_bytes} bytes, over the budget "
            f"{budget_bytes} bytes; this is a bug in that method"
        )
    info = plan.info.replace(
        predicted_peak_bytes=result.peak_bytes,
        recompute_cost=result.recompute_cost,
        solve_seconds=time.perf_counter() - started,
    )
    log.info(
        "solve(%s): peak %s within %s, recompute cost %g, %.3f s",
        method,
        format_bytes(result.peak_bytes),
        format_bytes(budget_bytes),
        result.recompute_cost,
        info.solve_seconds,
    )
    return dataclasses.replace(plan, budget_bytes=budget_bytes, info=info)
