"""Optimal rematerialization as a mixed-integer linear program (Checkmate-style).

Problem
-------
Find the explicit schedule with the least recomputation cost whose peak, as
measured by :func:`solvers.simulate`, fits a memory budget.

Reference
---------
Paras Jain, Ajay Jain, Aniruddha Nrusimha, Amir Gholami, Pieter Abbeel,
Kurt Keutzer, Ion Stoica, Joseph E. Gonzalez, "Checkmate: Breaking the Memory
Wall with Optimal Tensor Rematerialization", MLSys 2020. Checkmate's matrices
``R`` (compute value i in stage t), ``S`` (value i is alive entering stage t)
and its memory accounting ``U``/``FREE`` are kept in spirit, but re-derived
for this package's memory model, so that the MILP's peak *is* the simulator's
peak on the schedules it describes (Checkmate's own model frees differently).

The family of schedules ("stage schedules")
-------------------------------------------
* forward phase: forward nodes in problem order, each at most once; a subset
  ``K`` is kept;
* backward phase: one stage per backward node, in problem order; stage t
  recomputes a set of forward values in problem order (each at most once per
  stage) and then runs backward node t.

Formulation
-----------
Binary ``C[i]`` (i computed in forward; fixed to 1 for ancestors of outputs),
``K[i]`` (kept), ``R[t,i]`` (recomputed in stage t); continuous ``S[t,i]`` in
[0, 1] (i alive entering stage t, ``S[0,i] = K[i]``) and liveness helpers.

* correctness: a recomputation or backward node finds each forward pred
  alive or recomputed earlier in the stage (``R[t,j] <= R[t,i] + S[t,i]``,
  ``1 <= R[t,i] + S[t,i]``); ``S[t+1,i] <= S[t,i] + R[t,i]``;
  ``R[t,i] + S[t,i] <= 1`` (no second copy of a live value);
* memory, one constraint per step (peak right after an allocation): resident
  bytes + backward values alive then (fixed by the order) + the allocation +
  every forward value alive then. A forward value before the step is alive
  iff it is read at or after the step in the same stage, read by the stage's
  backward node, or alive into the next stage (``S[t+1,i]``); a value after
  the step is alive iff ``S[t,i]``. The forward phase is the same with ``C``
  and ``K``. Alias groups count their root's bytes once while any member is
  alive; recomputing a root while an older view is alive is forbidden (it
  would need two copies).
* objective: minimise the sum of ``cost[i] * R[t,i]``.

Size: O(B·F) binaries for B backward and F forward nodes (fewer: a value is
only a candidate in stages that may still need it). Graphs whose model exceeds
``max_variables`` (default 300,000) are refused with :class:`SolverError`.

Solver: HiGHS through pulp when highspy is importable (warm-started with the
hierarchical plan when it fits), else CBC (``pulp.PULP_CBC_CMD``). On time-out the best
integer solution is returned with ``info.status == "time_limit"`` and the
solver's gap and bound, and a warning is logged.

Example
-------
>>> from solvers import Problem, simulate
>>> p = Problem.training_chain(6)
>>> plan = ilp(p, 5, time_limit=10)
>>> simulate(p, plan).peak_bytes <= 5, plan.info.status
(True, 'optimal')
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from solvers.errors import InfeasibleBudgetError, SolverError, format_bytes
from solvers.milp import (
    WORK_LIMIT_STATUS,
    MilpBuildTimeout,
    MilpModel,
    SolveOutcome,
    StageGraph,
    highs_available,
    solve_model,
    stage_graph,
)
from solvers.plan import BACKWARD_PHASE, FORWARD_PHASE, Plan, SolveInfo, Step
from solvers.problem import BACKWARD_CODE, Problem
from solvers.simulator import simulate

__all__ = ["ilp", "build_model", "MAX_VARIABLES"]

log = logging.getLogger("solvers.ilp")

Progress = Callable[[float, str], None]


#: Models with more variables than this are refused (pulp builds them too slowly).
MAX_VARIABLES = 300_000
_RETRIES = 3


# ============================================================== plans
def _prune(
    problem: Problem, graph: StageGraph, kept: set[int], rec: list[list[int]]
) -> tuple[set[int], list[list[int]]]:
    """Drop recomputations nobody reads and kept values backward never reads (both only free memory)."""
    fwd_preds = problem._fwd_preds
    g = graph
    B = len(g.backward)
    changed = True
    rec = [list(r) for r in rec]
    while changed:
        changed = False
        # Which instance each read resolves to, walking the backward phase.
        latest: dict[int, tuple[int, int]] = {}  # forward pos -> (stage, index) of its latest recompute
        read_inst: set[tuple[int, int, int]] = set()
        kept_read: set[int] = set()
        for t in range(B):
            for idx, i in enumerate(rec[t]):
                for p in fwd_preds[g.forward[i]]:
                    ip = g.pos.get(p)
                    if ip is None or g.resident[ip]:
                        continue
                    if ip in latest:
                        read_inst.add((ip,) + latest[ip])
                    else:
                        kept_read.add(ip)
                latest[i] = (t, idx)
            for ip in g.reads[t]:
                if ip in latest:
                    read_inst.add((ip,) + latest[ip])
                else:
                    kept_read.add(ip)
        for t in range(B):
            keep = [i for idx, i in enumerate(rec[t]) if (i, t, idx) in read_inst]
            if len(keep) != len(rec[t]):
                rec[t] = keep
                changed = True
        unused = {i for i in kept if i not in kept_read}
        if unused:
            kept -= unused
            changed = True
    return kept, rec


def _to_plan(problem: Problem, graph: StageGraph, kept: set[int], rec: list[list[int]], budget: int | None) -> Plan:
    g = graph
    names = problem.nodes
    output = problem._output
    kept_nodes = {g.forward[i] for i in kept}
    # Members of storages an output shares: their forward instances serve backward.
    kept_nodes |= {v for i, v in enumerate(g.forward) if g.resident[i] and not output[v]}
    needed = set(kept_nodes) | {v for v in problem._forward_idx if output[v]}
    for v in reversed(problem._forward_idx):
        if v in needed:
            needed.update(problem._fwd_preds[v])
    steps = [Step(names[v].name, FORWARD_PHASE) for v in problem._forward_idx if v in needed]
    for t, b in enumerate(g.backward):
        steps += [Step(names[g.forward[i]].name, BACKWARD_PHASE) for i in rec[t]]
        steps.append(Step(names[b].name, BACKWARD_PHASE))
    return Plan(
        kept=frozenset(names[v].name for v in kept_nodes), schedule=tuple(steps), method="ilp", budget_bytes=budget
    )


def _start_from_plan(problem: Problem, model: MilpModel, plan: Plan) -> dict[str, float] | None:
    """Variable values of a stage schedule (e.g. the hierarchical plan's), to warm-start the MILP."""
    g = model.g
    index = problem.index
    B = len(g.backward)
    values: dict[str, float] = {}
    kept = {g.pos[index[n]] for n in plan.kept if index[n] in g.pos}
    stage = -1
    rec: list[list[int]] = [[] for _ in range(B)]
    stage_of = {b: q for q, b in enumerate(g.backward)}
    forward_done: set[int] = set()
    for step in plan.schedule or ():
        v = index[step.node]
        if step.phase == FORWARD_PHASE:
            if v in g.pos:
                forward_done.add(g.pos[v])
            continue
        if problem._kind[v] == BACKWARD_CODE:
            stage = stage_of[v]
            continue
        if v not in g.pos:
            return None
        rec[stage + 1].append(g.pos[v]) if stage + 1 < B else None
    # Stage schedules only: each value at most once per stage, in problem order.
    for r in rec:
        if r != sorted(set(r)):
            return None
    for i, var in model.K.items():
        values[var.name] = 1.0 if i in kept else 0.0
    for i, var in model.C.items():
        if not isinstance(var, int):
            values[var.name] = 1.0 if i in forward_done else 0.0
    # Liveness S from reads: an instance is alive entering stage t if read at or after t before being replaced.
    fwd_preds = problem._fwd_preds
    latest_stage: dict[int, int] = {i: 0 for i in kept}  # stage the current instance appeared (0: kept)
    holds: list[tuple[int, int, int]] = []  # (pos, from_stage_exclusive_or_0, read_stage)
    for t in range(B):
        rset = set(rec[t])
        for i in rec[t]:
            for p in fwd_preds[g.forward[i]]:
                ip = g.pos.get(p)
                if ip is None or g.resident[ip] or ip in rset and ip < i:
                    continue
                holds.append((ip, latest_stage.get(ip, 0), t))
        for ip in g.reads[t]:
            if ip in rset:
                continue
            holds.append((ip, latest_stage.get(ip, 0), t))
        for i in rec[t]:
            latest_stage[i] = t + 1
    S_val: dict[tuple[int, int], float] = {}
    for ip, since, until in holds:
        for t in range(since, until + 1):
            if t == 0:
                continue
            S_val[(t, ip)] = 1.0
    for t in range(1, B):
        for i, var in model.S[t].items():
            values[var.name] = S_val.get((t, i), 0.0)
    for t in range(B):
        for i, var in model.R[t].items():
            values[var.name] = 1.0 if i in rec[t] else 0.0

    # Auxiliary liveness variables: the least value their lower bounds allow.
    def val(e: Any) -> float:
        if isinstance(e, (int, float)):
            return float(e)
        name = getattr(e, "name", None)
        if name is not None and name in values:
            return values[name]
        return 0.0

    for var, bounds in model.aux:
        values[var.name] = min(1.0, max([0.0] + [val(e) for e in bounds]))
    return values


def _keep_all(problem: Problem) -> tuple[Plan, Any]:
    from solvers.chen import keep_all_plan

    plan = keep_all_plan(problem)
    return dataclasses.replace(plan, method="ilp"), simulate(problem, plan)


def _explicit(problem: Problem, plan: Plan) -> Plan:
    from solvers.simulator import schedule

    return Plan(kept=plan.kept, schedule=schedule(problem, plan), method=plan.method, budget_bytes=plan.budget_bytes)


def build_model(problem: Problem, budget_bytes: int | None, *, max_variables: int = MAX_VARIABLES) -> Any:
    """The pulp ``LpProblem`` of the MILP (``budget_bytes=None``: minimise the peak instead).

    Exposed for inspection and tests; :func:`ilp` builds and solves it.
    """
    return MilpModel(problem, stage_graph(problem), budget_bytes, max_variables).lp


def ilp(
    problem: Problem,
    budget_bytes: int,
    *,
    time_limit: float = 60.0,
    progress: Progress | None = None,
    max_variables: int = MAX_VARIABLES,
    threads: int | None = None,
    mip_gap: float = 1e-6,
    warm_start: bool = True,
    start: Plan | None = None,
    work_limit: int | None = None,
    least_feasible: bool = True,
) -> Plan:
    """Least-recomputation stage schedule within ``budget_bytes``, by MILP (Checkmate).

    Problem: minimise total recomputation cost over the stage schedules (see
    the module docstring) whose :func:`solvers.simulate` peak is at most
    ``budget_bytes``. On graphs without aliases the MILP's memory accounting
    equals the simulator's, so the optimum is exact for that family.

    Parameters
    ----------
    problem : Problem
    budget_bytes : int
    time_limit : float
        Seconds for the MILP solver (model building is not counted).
    progress : callable(fraction, message) or None
    max_variables : int
        Refuse (SolverError) models larger than this.
    threads : int or None
        Solver threads (None: solver default).
    mip_gap : float
        Relative optimality gap at which the solver stops.
    warm_start : bool
        Give the solver a first incumbent (HiGHS/CBC): ``start``, else the hierarchical plan when it fits.
    start : Plan or None
        The incumbent to start from, a plan of ``problem`` within the budget (``auto`` passes the best
        plan its other methods found).
    work_limit : int or None
        Stop the MILP after this much deterministic work (see :func:`solvers.milp.make_milp_solver`);
        with ``threads=1`` the plan is then the same at any machine load (``info.status``
        "work_limit" when it cut), while ``time_limit`` stays a wall-clock safety.
    least_feasible : bool
        When no stage schedule fits, solve a second MILP for the least peak one reaches (the error's
        ``min_feasible_bytes``).  False: the error gives None (``auto``, which names its own floor,
        spent about half of a refused call on it).

    Returns
    -------
    Plan
        Explicit schedule; ``info``: status ("optimal", "work_limit" or "time_limit"),
        gap, bound (lower bound on the recompute cost), solve_seconds,
        build_seconds, variables, constraints, predicted_peak_bytes and
        recompute_cost (from simulate), solver.

    Raises
    ------
    InfeasibleBudgetError
        If no stage schedule fits; min_feasible_bytes is the least peak the
        MILP can reach (solved as a second MILP within the time left), or None
        without ``least_feasible``.
    SolverError
        If the model is too large, or the solver found no integer solution in time.

    Complexity: model size O(B·F + B·E_f) for B backward nodes, F forward nodes
    and E_f forward edges; solving is exponential in the worst case.

    Examples
    --------
    >>> p = Problem.training_chain(8)
    >>> ilp(p, 6).info.recompute_cost
    3.0
    """
    started = time.perf_counter()
    keep_all, keep_all_core = _keep_all(problem)
    if keep_all_core.peak_bytes <= budget_bytes and keep_all_core.recompute_cost == 0:
        plan = _explicit(problem, keep_all)
        return _finish(
            problem, plan, budget_bytes, started, SolveInfo(status="optimal", gap=0.0, bound=0.0, candidate="keep_all")
        )
    graph = stage_graph(problem)
    if not graph.backward:
        plan = _explicit(problem, keep_all)
        return _finish(problem, plan, budget_bytes, started, SolveInfo(status="optimal", gap=0.0, bound=0.0))
    MilpModel.estimate_size(graph, max_variables)  # refuse huge graphs before any work
    start_plan = _explicit(problem, start) if warm_start and start is not None else None
    if warm_start and start_plan is None:
        try:
            from solvers.hierarchical import hierarchical

            start_plan = _explicit(problem, hierarchical(problem, budget_bytes))
        except (InfeasibleBudgetError, SolverError):
            start_plan = None
    target = budget_bytes
    last_error = None
    for _attempt in range(_RETRIES):
        try:
            attempt = _build_and_solve(
                problem,
                graph,
                target,
                max_variables,
                start_plan,
                max(0.5, time_limit - (time.perf_counter() - started)),
                threads,
                mip_gap,
                progress,
                work_limit,
                deadline=started + time_limit,
            )
        except MilpBuildTimeout as timeout:
            if start_plan is None:
                raise SolverError(
                    f"ilp: {timeout} of {time_limit:g} s, and no plan was found to start from. What to do: "
                    "solver='auto' (block menus and an exact chain DP, seconds on any graph), or a larger time_limit"
                ) from None
            log.warning("ilp: %s of %g s; returning the plan it would have started from", timeout, time_limit)
            return _finish(
                problem, start_plan, budget_bytes, started, SolveInfo(status="time_limit", candidate="warm start")
            )
        model, outcome = attempt.model, attempt.outcome
        if outcome.status not in ("optimal", "time_limit", "feasible", WORK_LIMIT_STATUS):
            remaining = max(1.0, time_limit - (time.perf_counter() - started))
            plan, info = _without_a_solution(
                problem,
                graph,
                outcome,
                budget_bytes,
                keep_all,
                keep_all_core.peak_bytes,
                start_plan,
                time_limit,
                remaining,
                max_variables,
                threads,
                least_feasible,
            )
            return _finish(problem, plan, budget_bytes, started, info)
        kept, _, rec = model.schedule()
        kept, rec = _prune(problem, graph, kept, rec)
        plan = _to_plan(problem, graph, kept, rec, budget_bytes)
        result = simulate(problem, plan)
        if result.peak_bytes <= budget_bytes:
            if keep_all_core.peak_bytes <= budget_bytes and keep_all_core.recompute_cost < result.recompute_cost:
                log.info("ilp: keep-all is cheaper than the MILP's plan (conservative multi-output model)")
                return _finish(
                    problem,
                    _explicit(problem, keep_all),
                    budget_bytes,
                    started,
                    SolveInfo(status="fallback", bound=outcome.bound, candidate="keep_all"),
                )
            info = attempt.solve_info()
            if info.status != "optimal" and start_plan is not None:
                # A cut solve may end on an incumbent worse than the plan it was offered (a start the
                # solver could not use, or a re-solve without it): never return worse than that plan.
                started_from = simulate(problem, start_plan)
                if started_from.peak_bytes <= budget_bytes and started_from.recompute_cost < result.recompute_cost:
                    log.log(
                        _cut_level(info.status),
                        "ilp: the solve was cut (%s) at recompute cost %g, above the plan it started from (%g); "
                        "returning that plan",
                        info.status,
                        result.recompute_cost,
                        started_from.recompute_cost,
                    )
                    return _finish(
                        problem,
                        start_plan,
                        budget_bytes,
                        started,
                        dataclasses.replace(info, candidate="warm start"),
                    )
            if info.status == "time_limit":
                log.warning(
                    "ilp: time limit of %.1f s reached; returning the best plan found "
                    "(recompute cost %g, lower bound %s, gap %s)",
                    time_limit,
                    result.recompute_cost,
                    outcome.bound,
                    outcome.gap,
                )
            return _finish(problem, plan, budget_bytes, started, info)
        # Aliases shared with the backward phase can make the model optimistic.
        last_error = result.peak_bytes
        log.debug("ilp: model peak within %d but simulate() says %d; retrying", target, result.peak_bytes)
        target -= result.peak_bytes - budget_bytes
    raise SolverError(
        f"ilp: the MILP's plans exceed the budget in simulate() (last peak {last_error} bytes "
        f"for budget {budget_bytes}); the graph uses aliases the model does not capture"
    )


@dataclass
class _Attempt:
    """One MILP built for a target peak and solved."""

    model: MilpModel
    outcome: SolveOutcome
    build_seconds: float
    solving_seconds: float
    warm_started: bool

    def solve_info(self) -> SolveInfo:
        outcome = self.outcome
        return SolveInfo(
            status=outcome.status if outcome.status in ("optimal", WORK_LIMIT_STATUS) else "time_limit",
            gap=outcome.gap,
            bound=outcome.bound,
            objective=outcome.objective,
            details={
                "build_seconds": self.build_seconds,
                "milp_seconds": outcome.seconds,
                "variables": self.model.n_variables,
                "constraints": self.model.lp.numConstraints(),
                "solver": "HiGHS" if highs_available() else "CBC",
                "warm_start": self.warm_started,
            },
        )


def _build_and_solve(
    problem: Problem,
    graph: StageGraph,
    target: int,
    max_variables: int,
    start_plan: Plan | None,
    time_limit: float,
    threads: int | None,
    mip_gap: float,
    progress: Progress | None,
    work_limit: int | None = None,
    deadline: float | None = None,
) -> _Attempt:
    """Build the MILP for peak ``target`` and solve it (from ``start_plan`` when given); if the solver's
    solution disagrees with its objective, solve again without the start."""
    build_started = time.perf_counter()
    if progress is not None:
        progress(0.05, "ilp: building the MILP")
    model = MilpModel(problem, graph, target, max_variables, deadline=deadline)
    build_seconds = time.perf_counter() - build_started
    start = _start_from_plan(problem, model, start_plan) if start_plan is not None else None
    if progress is not None:
        progress(0.2, f"ilp: solving ({model.n_variables:,} variables)")
    outcome = solve_model(model, time_limit, start, threads, mip_gap, work_limit)
    spent = outcome.seconds
    if outcome.status == "inconsistent":
        log.debug("ilp: the solver's solution disagrees with its objective; re-solving without a start")
        start = None
        model = MilpModel(problem, graph, target, max_variables)
        outcome = solve_model(model, max(0.5, time_limit - spent), None, threads, mip_gap, work_limit)
        spent += outcome.seconds
    log.debug(
        "ilp: %s in %.2f s (objective %s, bound %s)", outcome.status, outcome.seconds, outcome.objective, outcome.bound
    )
    return _Attempt(model, outcome, build_seconds, spent, start is not None)


def _without_a_solution(
    problem: Problem,
    graph: StageGraph,
    outcome: SolveOutcome,
    budget_bytes: int,
    keep_all: Plan,
    keep_all_peak: int,
    start_plan: Plan | None,
    time_limit: float,
    remaining: float,
    max_variables: int,
    threads: int | None,
    least_feasible: bool,
) -> tuple[Plan, SolveInfo]:
    """The plan to return when the MILP gave no solution: keep-all if it fits, else the warm start.

    Raises:
        InfeasibleBudgetError: the MILP is infeasible and keep-all does not fit (with the least peak
            the MILP can reach, solved within ``remaining`` seconds, where ``least_feasible``).
        SolverError: the solver found no integer solution in time and there is no warm start.
    """
    if outcome.status == "infeasible":
        if keep_all_peak <= budget_bytes:
            # The model counts multi-output storages conservatively: keep-all can
            # fit where the MILP sees no room. Never fail where keep-all fits.
            log.info("ilp: the MILP found no schedule within the budget; keep-all fits, returning it")
            return _explicit(problem, keep_all), SolveInfo(status="fallback", candidate="keep_all")
        if not least_feasible:
            raise InfeasibleBudgetError(
                budget_bytes,
                None,
                f"ilp: budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) fits no stage schedule of this graph",
            )
        lowest = _min_feasible(problem, graph, max_variables, remaining, threads, keep_all_peak)
        raise InfeasibleBudgetError(
            budget_bytes,
            lowest,
            f"ilp: budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below the smallest feasible "
            f"budget {format_bytes(lowest)} ({lowest} bytes) of any stage schedule for this graph",
        )
    if start_plan is not None:
        log.log(
            _cut_level(outcome.status),
            "ilp: no MILP solution within %.1f s (%s); returning the hierarchical plan",
            time_limit,
            outcome.status,
        )
        return (
            Plan(kept=start_plan.kept, schedule=start_plan.schedule, method="ilp"),
            SolveInfo(
                status=WORK_LIMIT_STATUS if outcome.status.startswith(WORK_LIMIT_STATUS) else "time_limit",
                candidate="hierarchical",
                details={"solver_status": outcome.status},
            ),
        )
    raise SolverError(
        f"ilp: the solver found no integer solution ({outcome.status}) within "
        f"{time_limit:g} s; try a longer time_limit or method='hierarchical'"
    )


def _min_feasible(
    problem: Problem, graph: StageGraph, max_variables: int, time_limit: float, threads: int | None, fallback: int
) -> int:
    """Least simulated peak of the minimum-memory MILP (or ``fallback`` if it cannot be solved)."""
    try:
        model = MilpModel(problem, graph, None, max_variables)
        outcome = solve_model(model, time_limit, None, threads, 1e-6)
        if outcome.status in ("optimal", "time_limit", "feasible"):
            kept, _, rec = model.schedule()
            kept, rec = _prune(problem, graph, kept, rec)
            plan = _to_plan(problem, graph, kept, rec, None)
            return min(simulate(problem, plan).peak_bytes, fallback)
    except SolverError:
        pass
    return fallback


def _cut_level(status: str) -> int:
    """The log level of a solve cut at ``status``: a work limit cuts it on purpose (auto's deterministic
    limit; a user training under auto saw a warning on every replan), so INFO; the clock, WARNING."""
    return logging.INFO if status.startswith(WORK_LIMIT_STATUS) else logging.WARNING


def _finish(problem: Problem, plan: Plan, budget_bytes: int, started: float, outcome: SolveInfo) -> Plan:
    result = simulate(problem, plan)
    info = outcome.replace(
        predicted_peak_bytes=result.peak_bytes,
        recompute_cost=result.recompute_cost,
        solve_seconds=time.perf_counter() - started,
    )
    log.info(
        "ilp: %s, peak %s within %s, recompute cost %g, %.2f s",
        info.status,
        format_bytes(result.peak_bytes),
        format_bytes(budget_bytes),
        result.recompute_cost,
        info.solve_seconds,
    )
    return Plan(kept=plan.kept, schedule=plan.schedule, method="ilp", budget_bytes=budget_bytes, info=info)
