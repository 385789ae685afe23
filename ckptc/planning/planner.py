"""The one place where ckptc decides what to keep.

Everything that turns a captured graph and :class:`~ckptc.options.CheckpointOptions`
into a decision lives here:

* the planning margin (:func:`ckptc.planning.account.planning_margin`,
  :func:`~ckptc.planning.account.planning_budget`): solvers plan a little below the user's
  budget, by an amount sized from what the plan controls (the activations kept
  for backward) and the model's own uncertainty (kernels' measured scratch),
  never from the whole budget; a budget at or above the unoptimized peak keeps
  everything;
* the candidates: a solver under the budget (``strategy="auto"``) or a preset
  (``"none"``, ``"layer"``, ``"segment"``, ``"selective"``), or a plan file's
  decisions (``plan_source``);
* the floor (:func:`solvers.lowest_peak_plan`) and the unoptimized peak, and
  the step-wide floor when graph breaks split a step into several graphs;
* what the compiler that runs the plan makes cheaper to recompute than to keep
  (:func:`for_target_compiler`: Inductor's fused pointwise chains);
* what to do when a graph cannot fit (:func:`decide`: refuse, or mark it so
  that :mod:`ckptc.planning.replan` plans the step again with earlier graphs keeping less).

:func:`decide` is called by the compiler at capture time
(:mod:`ckptc.capture.compiler`) and by :class:`CapturedStep`, which plans a step
captured once under any number of budgets without capturing again
(:func:`ckptc.capture`, :func:`ckptc.plan`, the CLI's ``pareto`` and the bench).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import solvers
from ckptc.errors import InvalidArgumentError
from ckptc.options import CheckpointOptions, budget_to_bytes, refuse_unknown
from ckptc.planning import policies
from ckptc.planning.account import (
    StepAccount,
    below_the_floor,
    budget_for_planning_floor,
    cache_allowance,
    planning_budget,
    planning_margin,
)
from ckptc.planning.replan import Replans, settle
from ckptc.plans import ModelPlan, fingerprint, graph_plan
from ckptc.pricing.costs import BACKWARD, FORWARD, FUSING_COMPILERS
from ckptc.pricing.problem import GRADIENT_SUM_NODE, JointProblem, with_later_results
from ckptc.records import GraphInputs, GraphRecord, PlanSource, Progress
from solvers.refine import fill_budget
from solvers.simulator import honour_policies

log = logging.getLogger("ckptc.planning.planner")


def _scored(jp: JointProblem, plan: solvers.Plan, method: str, budget_bytes: int | None) -> solvers.Plan:
    """A policy's plan as the preset ``method``: adjusted to the nodes' policies (must_save,
    must_recompute) and scored by the one simulator (its info holds the predicted peak)."""
    plan = dataclasses.replace(plan, method=method, budget_bytes=budget_bytes)
    if plan.schedule is None:
        plan = dataclasses.replace(plan, kept=honour_policies(jp.problem, plan.kept))
    result = solvers.simulate(jp.problem, plan)
    info = plan.info.replace(predicted_peak_bytes=result.peak_bytes, recompute_cost=result.recompute_cost)
    return solvers.Plan(
        kept=plan.kept, schedule=plan.schedule, method=plan.method, budget_bytes=plan.budget_bytes, info=info
    )


Preset = Callable[[JointProblem, "int | None"], solvers.Plan]


def _applied(policy: Callable[[JointProblem], solvers.Plan], method: str) -> Preset:
    def preset(jp: JointProblem, budget_bytes: int | None = None) -> solvers.Plan:
        return _scored(jp, policy(jp), method, budget_bytes)

    preset.__name__ = preset.__qualname__ = f"{method}_preset"
    preset.__doc__ = policy.__doc__
    return preset


#: No ckptc: what the model does by itself (:func:`ckptc.planning.policies.everything_saveable`), scored.
keep_everything = _applied(policies.everything_saveable, "none")


def chen_segments(jp: JointProblem, budget_bytes: int | None = None) -> solvers.Plan:
    """Chen et al.'s sqrt(n) segments (the solver ``chen_sqrt``), without a budget check."""
    return solvers.solve(jp.problem, budget_bytes if budget_bytes is not None else 2**62, method="chen_sqrt")


#: The presets by strategy name; ``"auto"`` (a solver under the budget) is decided in :func:`candidate`.
PRESETS: dict[str, Preset] = {
    "none": keep_everything,
    "layer": _applied(policies.block_inputs_saveable, "layer"),
    "segment": chen_segments,
    "selective": _applied(policies.selective, "selective"),
}


#: Solver backends imported on first use (the MILP's pulp and HiGHS).
SOLVER_BACKENDS = ("pulp", "highspy")


def import_solver_backends() -> None:
    """Import the solvers' MILP backends on a thread of their own, once.

    pulp keeps exceptions it caught while probing optional backends at import
    (``copt_api``'s), and an exception keeps its traceback's frames and every
    frame above them.  Imported lazily inside a planning call, those would be
    the training call's frames, holding its results (logits) and inputs alive
    for the rest of the process: memory no step's budget counts.  On a fresh
    thread the stack above the import is that thread's only.
    """
    missing = [name for name in SOLVER_BACKENDS if name not in sys.modules]
    if not missing:
        return

    def load() -> None:
        for name in missing:
            try:
                importlib.import_module(name)
            except ImportError:  # optional: the solvers fall back without it
                pass

    loader = threading.Thread(target=load, name="ckptc-import-solver-backends", daemon=True)
    loader.start()
    loader.join()


def candidate(
    jp: JointProblem,
    options: CheckpointOptions,
    budget_bytes: int | None,
    progress: Progress | None = None,
    repeats: tuple[int, int] | None = None,
) -> solvers.Plan:
    """The strategy's plan for ``jp`` at a planning budget (None: no limit).

    ``repeats``: (runs, assumed) for a graph whose ``runs`` earlier runs in the step are in ``jp``'s
    baseline, each counted as keeping ``assumed`` bytes: ``auto`` fills its plan only while it fits
    with each byte kept beyond ``assumed`` counted once more per run (each run keeps what it keeps).

    Raises:
        solvers.InfeasibleBudgetError: with the solver's floor, in planning-budget units.
    """
    if options.strategy != "auto":
        return _never_above_keeping_everything(jp, PRESETS[options.strategy](jp, budget_bytes), options.strategy)
    if budget_bytes is None:
        return keep_everything(jp)
    extra: dict[str, Any] = {} if options.time_limit is None else {"time_limit": options.time_limit}
    if repeats is not None and options.solver == "auto":
        extra["kept_weight"], extra["kept_allowance"] = repeats
    return solvers.solve(jp.problem, budget_bytes, method=options.solver, progress=progress, **extra)


def _never_above_keeping_everything(jp: JointProblem, plan: solvers.Plan, strategy: str) -> solvers.Plan:
    """``plan``, or keeping everything where that peaks no higher: it recomputes nothing, so a preset
    whose recomputation in backward outgrows what it frees is never the better plan."""
    if strategy == "none":
        return plan
    everything = dataclasses.replace(keep_everything(jp), budget_bytes=plan.budget_bytes)
    peak = plan.info.predicted_peak_bytes  # every preset is scored by the simulator
    if peak is None:
        peak = solvers.simulate(jp.problem, plan).peak_bytes
    if everything.info.predicted_peak_bytes <= peak and plan.info.recompute_cost > 0:
        log.warning(
            "strategy %r would peak at %s on this graph, where keeping everything peaks at %s and recomputes "
            "only copies: keeping everything instead",
            strategy,
            solvers.format_bytes(peak),
            solvers.format_bytes(everything.info.predicted_peak_bytes),
        )
        return everything
    return plan


def _choose(
    jp: JointProblem,
    options: CheckpointOptions,
    index: int,
    plan_source: PlanSource | None,
    progress: Progress | None,
    everything_bytes: int,
    margin: int,
    account: StepAccount,
    repeats: tuple[int, int] | None = None,
) -> solvers.Plan:
    """The plan for graph ``index`` under ``account``'s budget (``repeats``: as :func:`candidate`); an
    infeasible budget is reported in the user's units.

    Under ``strategy="auto"`` a budget at or above the unoptimized peak (``everything_bytes``: keeping
    everything, with a caching allocator's allowance) keeps everything: nothing to recompute, and no
    solver's plan peaks above it.
    """
    if plan_source is not None:
        held = (
            " Where the loop keeps the forward's results until backward ends (out = model(...); "
            "out.loss.backward()), make the plan for it: ckptc.plan(..., hold_outputs=True), or ckptc plan "
            "--hold-outputs."
            if account.hold_outputs and not options.hold_outputs
            else ""
        )
        return _within_budget(jp, plan_source(index, jp), account.budget_bytes, "the plan file's plan", held)
    target = options.compiler if options.strategy == "auto" else "eager"  # presets are taken as they are
    budget = account.graph_budget(index)
    if budget is None:
        return for_target_compiler(jp, candidate(jp, options, None, progress), target)
    if options.strategy == "auto" and everything_bytes <= budget:
        everything = dataclasses.replace(keep_everything(jp), budget_bytes=planning_budget(budget, margin))
        return for_target_compiler(jp, everything, target)
    try:
        plan = for_target_compiler(
            jp, candidate(jp, options, planning_budget(budget, margin), progress, repeats), target
        )
    except solvers.InfeasibleBudgetError as error:
        floor = error.min_feasible_bytes
        if floor is not None:
            floor = budget_for_planning_floor(floor, margin)
            if options.strategy == "auto":
                floor = min(floor, everything_bytes)
        raise solvers.InfeasibleBudgetError(account.budget_bytes, floor) from None
    if options.strategy != "auto":
        return _within_budget(jp, plan, budget, f"strategy {options.strategy!r}")
    return plan


def _within_own_margin(
    jp: JointProblem,
    options: CheckpointOptions,
    budget: int,
    floor_plan: solvers.Plan,
    floor_margin: int,
    progress: Progress | None,
) -> solvers.Plan | None:
    """A plan for a budget too close to the floor for the solvers' planning margin (the unoptimized plan's)
    but within the lowest-peak plan's own (``floor_margin``).

    The solvers' plan at the budget less the lowest-peak plan's margin, if it peaks within the margin
    that plan's own kept values need, else the lowest-peak plan (under ``solver="auto"``; a solver the
    caller chose that finds no such plan gives None: refused as at any budget it cannot meet).  Plans
    keep less here than keeping everything does, so their peaks are less uncertain
    (:func:`ckptc.planning.account.planning_margin`).
    """
    try:
        found = candidate(jp, options, planning_budget(budget, floor_margin), progress)
        plan = for_target_compiler(jp, found, options.compiler)
        result = solvers.simulate(jp.problem, plan)
        if result.peak_bytes <= planning_budget(budget, planning_margin(jp.problem, result, jp.memory)):
            return plan
    except solvers.InfeasibleBudgetError:
        pass
    return floor_plan if options.solver == "auto" else None


class _FixedPlanOverBudget(solvers.InfeasibleBudgetError):
    """A preset's or a plan file's plan peaks above the budget: nothing to plan again, refused as is."""


def _within_budget(
    jp: JointProblem, plan: solvers.Plan, budget: int | None, what: str, advice: str = ""
) -> solvers.Plan:
    """``plan`` if its predicted peak (the one simulator's) is within ``budget``; a preset or a plan file
    is applied as it is, so one that does not fit is refused naming its peak (and ``advice``), never run over
    budget."""
    if budget is None:
        return plan
    peak = solvers.simulate(jp.problem, plan).peak_bytes
    if peak <= budget:
        return plan
    raise _FixedPlanOverBudget(
        budget,
        peak,
        f"{what} peaks at {solvers.format_bytes(peak)} ({peak} bytes), above the budget "
        f"{solvers.format_bytes(budget)} ({budget} bytes). What to do: give a budget of at least {peak} bytes, "
        "or plan under this budget with strategy='auto' (ckptc's solvers)." + advice,
    )


def for_target_compiler(jp: JointProblem, plan: solvers.Plan, compiler: str) -> solvers.Plan:
    """``plan`` with the values its compiler recomputes for less than keeping them costs.

    Under a fusing compiler (Inductor) a kept output of a pointwise op costs a
    write in forward and a read in backward (``NodeCost.keep_cost``), while
    recomputing it inside its consumer's fused kernel costs only the reads of
    its inputs (``NodeCost.cost``, :func:`ckptc.pricing.costs.fused_flops`).  So every
    kept pointwise output that is cheaper to recompute than to keep, and whose
    inputs backward has anyway (kept values, inputs, views of them), is
    recomputed instead, as PyTorch's min-cut partitioner does; the solvers
    cannot weigh this themselves, since their objective prices recomputation
    only.  All such values are dropped at once if that does not raise the
    plan's simulated peak, else one by one (largest first) while it does not.
    Plans for the eager compiler and explicit schedules are returned as they are.

    Complexity: O(n) to find the values, then one simulation, or one per value.
    """
    if compiler not in FUSING_COMPILERS or plan.schedule is not None or not plan.kept:
        return plan
    problem = jp.problem
    available: dict[str, bool] = {}

    def in_backward(name: str) -> bool:
        """Backward has ``name`` without recomputing anything but views of what it has."""
        if name not in available:
            node = problem[name]
            available[name] = (
                node.kind != FORWARD
                or name in plan.kept
                or (node.bytes == 0 and node.name in jp.nodes and all(in_backward(p) for p in node.preds))
            )
        return available[name]

    def cheaper_to_recompute(name: str) -> bool:
        node = problem[name]
        if name not in jp.nodes or node.policy is not None or node.output or node.checkpointed:
            return False
        cost = jp.node_cost(name)
        return cost.fused and node.differentiable and cost.cost <= cost.keep_cost

    candidates = sorted(
        (n for n in plan.kept if cheaper_to_recompute(n) and all(in_backward(p) for p in problem[n].preds)),
        key=lambda n: (-problem[n].bytes, n),
    )
    if not candidates:
        return plan
    limit = solvers.simulate(problem, plan).peak_bytes

    def scored(kept: frozenset[str]) -> tuple[solvers.Plan, solvers.SimResult]:
        trial = dataclasses.replace(plan, kept=kept)
        return trial, solvers.simulate(problem, trial)

    best, result = scored(plan.kept - frozenset(candidates))
    if result.peak_bytes > limit:
        best, result = plan, None
        for name in candidates:
            trial, trial_result = scored(best.kept - {name})
            if trial_result.peak_bytes <= limit:
                best, result = trial, trial_result
    if result is None:
        return plan
    log.debug("%s: %d kept values are recomputed in fused kernels instead", compiler, len(plan.kept - best.kept))
    info = best.info.replace(predicted_peak_bytes=result.peak_bytes, recompute_cost=result.recompute_cost)
    return dataclasses.replace(best, info=info)


def decide(
    jp: JointProblem,
    options: CheckpointOptions,
    account: StepAccount,
    *,
    index: int,
    earlier: Sequence[GraphRecord] = (),
    plan_source: PlanSource | None = None,
    progress: Progress | None = None,
    inputs: GraphInputs | None = None,
    started: float | None = None,
    repeat_bytes: int = 0,
) -> GraphRecord:
    """Decide graph ``index`` of a step after the graphs ``earlier`` (their kept bytes are in ``jp``'s
    baseline, and ``repeat_bytes`` of other graphs' runs alive at its last run,
    :meth:`StepAccount.repeated_runs_bytes`, and what a step showed the baseline does not count,
    :attr:`StepAccount.outside_baseline_bytes`), as :func:`decide_at`; for a graph whose own earlier runs in
    the step are alive at its last run (``account.repeat_runs``: layers compiled once, the model called
    again before one backward), with each of them counted at what the chosen plan itself keeps.

    That baseline depends on the plan, so the plan is made under an assumed kept size: first keeping
    everything's (a plan made there keeps no more, so it fits beside its own runs), then, bisecting
    towards the lowest-peak plan's size, smaller ones while their plans still keep no more than assumed
    (at most :data:`REPEAT_SEARCH_STEPS` more plans); the cheapest plan that fits beside its own runs is
    chosen.  Under ``solver="auto"`` each plan is filled only while it fits beside runs keeping what it
    keeps (``repeats``), and a plan that keeps more than assumed but no more than the search's largest
    assumption is judged beside runs keeping what it keeps.  Where none does, the plan with the lowest peak
    beside its own runs, or its refusal.

    That plan, the graph's floor in the step, is the lowest-peak plan or keeping everything, whichever
    peaks lower beside its runs: a model that checkpoints its own layers keeps only their inputs when
    ckptc keeps everything, while its lowest-peak plan may keep more to recompute less at once, which
    each earlier run then holds again."""
    start = time.perf_counter() if started is None else started
    runs = account.repeat_runs.get(index, {}).get(index, 0)
    first_outside, last_outside = account.outside_baseline_bytes.get(index, (0, 0))

    def held_beside(assumed_kept: int) -> int:
        # Its last run's backward runs first, beside its earlier runs; its first run's backward runs
        # last, after the later runs freed what they keep and made their gradients: the larger of the
        # two is held beside it.
        return max(repeat_bytes + runs * assumed_kept + last_outside, first_outside)

    def beside_runs(assumed_kept: int) -> JointProblem:
        return with_baseline(jp, jp.problem.baseline_bytes - repeat_bytes + held_beside(assumed_kept))

    def at(assumed_kept: int, *, lowest_peak: bool = False, plan: solvers.Plan | None = None) -> GraphRecord:
        return decide_at(
            beside_runs(assumed_kept),
            options,
            account,
            index=index,
            earlier=earlier,
            plan_source=plan_source if plan is None else lambda _index, _jp: plan,
            progress=progress,
            inputs=inputs,
            started=start,
            repeat_bytes=held_beside(assumed_kept),
            lowest_peak=lowest_peak,
            floor=floor,
            everything_beside_runs=everything_beside_runs,
            repeats=(runs, assumed_kept) if runs and plan is None else None,
        )

    floor: tuple[solvers.Plan, solvers.SimResult] | None = None
    everything_beside_runs: solvers.SimResult | None = None
    if not runs:
        return at(0)
    if plan_source is not None:  # a plan file's plan is applied as it is: its runs keep what it keeps
        return at(_kept_bytes(jp, plan_source(index, jp)))
    # Each simulated once beside no runs of its own (what it keeps does not depend on the baseline), then
    # beside runs keeping what it keeps.
    everything = unoptimized_plan(jp)
    assumed = unoptimized_result(jp).kept_bytes + jp.held_beside(everything.kept)
    lowest = solvers.lowest_peak_plan(jp.problem)
    lowest_alone = solvers.simulate(jp.problem, lowest)
    floor_kept = lowest_alone.kept_bytes + jp.held_beside(lowest.kept)
    everything_beside_runs = solvers.simulate(beside_runs(assumed).problem, everything)
    floor = min(
        ((lowest, solvers.simulate(beside_runs(floor_kept).problem, lowest)), (everything, everything_beside_runs)),
        key=lambda candidate: candidate[1].peak_bytes,
    )
    budget = account.graph_budget(index)
    if budget is None:
        return at(assumed)
    # The assumed size is searched between the smaller of the two plans' own and the largest beside which
    # the lowest-peak plan still fits (larger: no plan fits); within it a larger assumption leaves less
    # room, so its plan tends to keep less.  Bisection for the smallest assumption whose plan keeps no more
    # than assumed: the cheapest plan that fits beside its own runs.
    margin = planning_margin(jp.problem, unoptimized_result(jp), jp.memory)
    room = (planning_budget(budget, margin) - lowest_alone.peak_bytes) // runs
    low = min(floor_kept, assumed)
    high = top = max(low, min(max(floor_kept, assumed), room))
    fitting: list[tuple[GraphRecord, int]] = []  # plans that keep no more than assumed, with the assumption
    if assumed < high:
        # Keeping everything is planned beside runs keeping what it keeps, whatever the search finds: a model
        # that checkpoints its own layers keeps less so than plans that recompute less, so its plan can fit
        # where larger assumptions' plans do not.
        try:
            record = at(assumed)
            if not record.infeasible and record.step_bytes <= assumed:
                fitting.append((record, assumed))
        except solvers.InfeasibleBudgetError:
            pass
    assumed = high
    for _ in range(1 + REPEAT_SEARCH_STEPS):
        try:
            record: GraphRecord | None = at(assumed)
        except solvers.InfeasibleBudgetError:
            record = None
        if record is not None and not record.infeasible and record.step_bytes <= assumed:
            fitting.append((record, assumed))
            high = assumed
        else:
            if record is not None and not record.infeasible and record.step_bytes <= top:
                # It keeps more than assumed, but no more than the search allows: it may still fit beside
                # runs that keep what it keeps.
                exact = _beside_own_runs(record, planning_budget(budget, margin), at)
                if exact is not None:
                    fitting.append((exact, exact.step_bytes))
            if not fitting and assumed == high:
                break  # not even the largest assumption that can fit: none can
            low = assumed
        if high - low <= high // 100:
            break
        assumed = (low + high) // 2
    if fitting:
        return _cheapest_beside_runs(jp, fitting, runs, planning_budget(budget, margin), beside_runs, at)
    # No plan fits beside runs that keep what it keeps: the plan with the lowest peak beside its own runs,
    # or its refusal with the step's floor.
    return at(_kept_bytes(jp, floor[0]), lowest_peak=True)


def _beside_own_runs(record: GraphRecord, budget: int, at: Callable[..., GraphRecord]) -> GraphRecord | None:
    """``record``'s plan beside runs that keep what it keeps, if it fits ``budget`` there."""
    try:
        exact = at(record.step_bytes, plan=record.plan)
    except solvers.InfeasibleBudgetError:
        return None
    return None if exact.infeasible or exact.result.peak_bytes > budget else exact


def _cheapest_beside_runs(
    jp: JointProblem,
    fitting: Sequence[tuple[GraphRecord, int]],
    runs: int,
    budget: int,
    beside_runs: Callable[[int], JointProblem],
    at: Callable[..., GraphRecord],
) -> GraphRecord:
    """The cheapest plan of ``jp``'s graph beside ``runs`` earlier runs of it, each keeping what it keeps, from
    the plans :func:`decide` found ``fitting`` (each with the kept size it was made for, at least what
    it keeps), each also kept fuller where the planning ``budget`` leaves room.

    A plan made for an assumed size tends to keep far more or far less than assumed, so the plans that
    fit often leave room: a GPT-2 block compiled once for six layers (a break in the layer loop) kept as
    little as it could at 0.6 of its range, recomputing 21% of the step with over half the budget unused.
    Each keeps its recomputed values, best saving per byte first, while its peak beside its runs, every
    byte kept counted once more per run, fits (:func:`solvers.refine.fill_budget`); the plan that fits
    at the least recompute is then judged beside runs keeping what it keeps.  The cheapest plan before
    filling is not always the cheapest after (Wav2Vec2's layer graph at 0.9 of its range: 5.1% of the
    step against 3.0%), so every one is filled."""
    chosen: GraphRecord | None = None
    # Several assumptions often give the same plan: each distinct one is filled once.
    distinct = {frozenset(record.plan.kept): record for record, _ in fitting}
    for record in distinct.values():
        filled = fill_budget(beside_runs(record.step_bytes).problem, record.plan, budget, kept_weight=runs)
        if filled is record.plan:
            continue
        try:
            candidate = at(_kept_bytes(jp, filled), plan=filled)
        except solvers.InfeasibleBudgetError:
            continue
        if candidate.infeasible or candidate.result.peak_bytes > budget:
            continue
        if chosen is None or candidate.result.recompute_cost < chosen.result.recompute_cost:
            chosen = candidate
    best, assumed = min(fitting, key=lambda pair: pair[0].result.recompute_cost)
    if chosen is not None and chosen.result.recompute_cost < best.result.recompute_cost:
        log.debug(
            "graph %d beside its %d earlier runs: recompute cost %.4g filled to %.4g",
            best.index,
            runs,
            best.result.recompute_cost,
            chosen.result.recompute_cost,
        )
        return chosen
    if best.step_bytes < assumed:
        # Planned beside runs assumed to keep more than its plan keeps: the same plan beside runs that
        # keep what it keeps, predicted exactly (a lower peak than the one it was chosen under).
        return at(best.step_bytes, plan=best.plan)
    return best


#: How many more plans :func:`decide` makes for a graph run several times in a step.  The size its plans
#: keep jumps as the assumed size crosses the point where only the lowest-peak plan fits beside the runs,
#: and the cheapest plan that keeps no more than assumed sits just below it: with 4 steps, a GPT-2 block run
#: for 6 layers (128 wide, 128 tokens) recomputed 9.3% and 11.8% of the step at 0.3 and 0.6 of its range,
#: with 8, 2.8% and 2.7% (each step one plan of the block's graph).
REPEAT_SEARCH_STEPS = 8


def _kept_bytes(jp: JointProblem, plan: solvers.Plan) -> int:
    """What a run of ``jp``'s graph under ``plan`` leaves alive after its forward (GraphRecord.step_bytes)."""
    return solvers.simulate(jp.problem, plan).kept_bytes + jp.held_beside(plan.kept)


def decide_at(
    jp: JointProblem,
    options: CheckpointOptions,
    account: StepAccount,
    *,
    index: int,
    earlier: Sequence[GraphRecord] = (),
    plan_source: PlanSource | None = None,
    progress: Progress | None = None,
    inputs: GraphInputs | None = None,
    started: float | None = None,
    repeat_bytes: int = 0,
    lowest_peak: bool = False,
    floor: tuple[solvers.Plan, solvers.SimResult] | None = None,
    everything_beside_runs: solvers.SimResult | None = None,
    repeats: tuple[int, int] | None = None,
) -> GraphRecord:
    """Decide graph ``index`` of a step after the graphs ``earlier`` (their kept bytes are in ``jp``'s
    baseline, and ``repeat_bytes`` of its own earlier runs', :func:`decide`); ``lowest_peak``: its
    lowest-peak plan where that fits the budget (no other plan fits beside its own runs); ``floor``: the
    plan with the lowest peak beside its own runs and its result there, and ``everything_beside_runs``
    keeping everything's, where :func:`decide` found them; ``repeats``: as :func:`candidate`.

    The floor reported (``min_feasible_bytes``) is the step's, the lower of two ways to run the step
    so far: every graph at its lowest-peak plan (earlier graphs would leave their ``slack_bytes`` fewer
    bytes alive), or every graph keeping everything (a model that checkpoints its own layers keeps only
    their inputs so, while a lowest-peak plan may keep more, which later graphs then hold beside them).
    A graph that cannot fit is planned at its lowest peak when it has a graph
    budget of its own and fits the step's budget alone (earlier graphs asked it
    to keep less), or when ``account.defer_infeasible`` asks to see the whole
    step first (marked ``infeasible``); otherwise :class:`solvers.InfeasibleBudgetError`
    gives the step's floor.
    """
    start = time.perf_counter() if started is None else started
    import_solver_backends()
    keep_all = unoptimized_result(jp)
    if floor is not None:
        floor_plan, floor_result = floor
    else:
        floor_plan = solvers.lowest_peak_plan(jp.problem)
        floor_result = solvers.simulate(jp.problem, floor_plan)
        if keep_all.peak_bytes < floor_result.peak_bytes:  # policies can leave keeping everything lowest
            floor_plan, floor_result = unoptimized_plan(jp), keep_all
    margin = planning_margin(jp.problem, keep_all, jp.memory)
    # The lowest-peak plan keeps less than keeping everything, so less of its peak is uncertain.
    floor_margin = min(margin, planning_margin(jp.problem, floor_result, jp.memory))
    # What keeping everything peaks at on the device: on a caching allocator, with its allowance.
    everything = keep_all.peak_bytes + cache_allowance(keep_all, jp.memory)
    slack = sum(r.slack_bytes for r in earlier)
    lowest = floor_result.peak_bytes - slack
    # Keeping everything fits a budget of its own peak, the uncertainty margin or not (nothing left to drop):
    # the floor is never above the unoptimized peak (both with earlier graphs at their floors).
    own_floor = min(budget_for_planning_floor(lowest, floor_margin), max(lowest, everything - slack))
    at_lowest = max([own_floor] + [r.floor_at_lowest_bytes for r in earlier])
    all_kept = keep_all if everything_beside_runs is None else everything_beside_runs
    growth = sum(r.unoptimized_step_bytes - r.step_bytes for r in earlier)
    # Keeping everything, in each of its runs for a graph run several times (with a caching allocator's allowance).
    unoptimized = all_kept.peak_bytes + cache_allowance(all_kept, jp.memory)
    keeping_everything = max([unoptimized + growth] + [r.floor_keeping_everything_bytes for r in earlier])
    step_floor = min(at_lowest, keeping_everything)
    infeasible = False
    try:
        if lowest_peak and floor_result.peak_bytes <= planning_budget(account.budget_bytes or 0, floor_margin):
            plan = floor_plan
        else:
            plan = _choose(jp, options, index, plan_source, progress, everything, margin, account, repeats)
    except solvers.InfeasibleBudgetError as error:
        if isinstance(error, _FixedPlanOverBudget) or plan_source is not None:
            # Applied as they are: a preset or a plan file has no other plan to fall back to.
            fixed = solvers.InfeasibleBudgetError(error.budget_bytes, error.min_feasible_bytes, str(error))
            fixed.held_result_bytes = jp.droppable_output_bytes  # type: ignore[attr-defined]
            raise fixed from None
        fits_alone = floor_result.peak_bytes <= planning_budget(account.budget_bytes or 0, floor_margin)
        graph_budget = account.graph_budget(index)
        if plan_source is None and graph_budget is not None and everything <= graph_budget:
            plan = unoptimized_plan(jp)  # within the budget, only not within the planning margin
        elif (
            options.strategy == "auto"
            and graph_budget is not None
            and floor_result.peak_bytes <= planning_budget(graph_budget, floor_margin)
            and (near := _within_own_margin(jp, options, graph_budget, floor_plan, floor_margin, progress)) is not None
        ):
            plan = near
        elif index in account.graph_budgets and fits_alone:
            plan = floor_plan  # asked to keep less than its budget allows: as little as it can
        elif account.defer_infeasible and plan_source is None and earlier:
            infeasible = True  # earlier graphs of the step (this call's or an earlier call's) may keep less
            plan = floor_plan
        else:
            refusal = _refusal(error, step_floor, options, account, earlier, jp.held_output_bytes)
            refusal.held_result_bytes = jp.droppable_output_bytes  # type: ignore[attr-defined]
            refusal.held_output_bytes = jp.held_output_bytes  # type: ignore[attr-defined]
            raise refusal from None
    result = floor_result if plan is floor_plan else solvers.simulate(jp.problem, plan)
    record = GraphRecord(
        index=index,
        joint_problem=jp,
        plan=plan,
        result=result,
        baseline_bytes=jp.problem.baseline_bytes,
        unoptimized_peak_bytes=unoptimized,
        solve_seconds=time.perf_counter() - start,
        inputs=inputs or GraphInputs(),
        held_output_bytes=jp.held_beside(plan.kept),
        floor_peak_bytes=floor_result.peak_bytes,
        floor_kept_bytes=floor_result.kept_bytes,
        floor_held_output_bytes=jp.held_beside(floor_plan.kept),
        margin_bytes=floor_margin,
        unoptimized_kept_bytes=keep_all.kept_bytes,
        unoptimized_step_bytes=keep_all.kept_bytes + jp.held_beside(unoptimized_plan(jp).kept),
        floor_at_lowest_bytes=at_lowest,
        floor_keeping_everything_bytes=keeping_everything,
        infeasible=infeasible,
        earlier=tuple(earlier),
        repeat_bytes=repeat_bytes,
        gradients_resident=account.gradients_resident,
    )
    record.later_calls_floor = functools.partial(floor_counting_later_calls, record)
    log.info(
        "graph %d: %d nodes, kept %d forward values, predicted peak %s (unoptimized %s), recompute cost %.3g",
        index,
        len(jp.problem),
        len(plan.kept),
        solvers.format_bytes(result.peak_bytes),
        solvers.format_bytes(unoptimized),
        result.recompute_cost,
    )
    return record


def _refusal(
    error: solvers.InfeasibleBudgetError,
    step_floor: int,
    options: CheckpointOptions,
    account: StepAccount | None = None,
    earlier: Sequence[GraphRecord] = (),
    held_output_bytes: int | None = None,
) -> solvers.InfeasibleBudgetError:
    """The error for a graph that cannot fit: the step's floor (with what the step holds beyond a plain
    one, :meth:`StepAccount.beyond_a_plain_step`), or (when ckptc could plan the budget but the chosen
    solver or preset cannot) that solver's own floor and what to do.

    Where the step's floor is within the budget, the graphs ``earlier`` in the step keep too much for
    this one.  The budget named then holds this graph beside them keeping all they can keep
    (:attr:`GraphRecord.growth_bytes`): a budget retried plans them for it, without this graph, and a
    larger budget lets them keep more (the graph's own floor beside what they keep now was named
    before, and a retry at it was refused again).  ``held_output_bytes``: what this graph's results
    counted held weigh (0: the refusal does not name them)."""
    budget = error.budget_bytes
    if step_floor > budget:
        plain = solvers.InfeasibleBudgetError(budget, step_floor)
        if account is None:
            return below_the_floor(plain)
        return account.explained_refusal(
            plain, "; its floor counts what the step holds beyond its graphs' activations", held_output_bytes
        )
    own = error.min_feasible_bytes if error.min_feasible_bytes and error.min_feasible_bytes > budget else None
    if own is not None:
        own += sum(r.growth_bytes for r in earlier)
    if options.strategy == "auto" and options.solver == "auto":
        return solvers.InfeasibleBudgetError(
            budget,
            own,
            f"this graph cannot fit the budget {solvers.format_bytes(budget)} ({budget} bytes) after what the "
            f"step's earlier graphs keep; with them at their own floors the step's floor is "
            f"{solvers.format_bytes(step_floor)} ({step_floor} bytes). What to do: give a budget of at least "
            f"{own if own is not None else step_floor} bytes. (Graphs of one call are planned again together so "
            "that earlier ones keep less; graphs of an earlier call of the model in the same step, as two calls "
            "before one backward, have already run under their plans.)",
        )
    how = f"solver {options.solver!r}" if options.strategy == "auto" else f"strategy {options.strategy!r}"
    return solvers.InfeasibleBudgetError(
        budget,
        own,
        f"{how} found no plan within the budget {solvers.format_bytes(budget)} ({budget} bytes)"
        + ("" if own is None else f"; its smallest feasible budget is {solvers.format_bytes(own)} ({own} bytes)")
        + f"; ckptc's floor is {solvers.format_bytes(step_floor)} ({step_floor} bytes): solver='auto' plans "
        "this budget",
    )


def floor_counting_later_calls(record: GraphRecord, parameters: Mapping[int, int]) -> int:
    """The floor of ``record``, a graph of an earlier call of the step (the model called again before
    one backward), once it counts what the later calls' backwards, which run before its own, leave
    to it (the account it plans under next, :attr:`StepAccount.gradients_summed_by_autograd`): the
    gradients of ``parameters`` (ids -> bytes, those the step's graphs take) resident, and autograd's
    out-of-place sum of two calls' gradients when its backward returns its own.  Its lowest-peak
    plan simulated so; the floor it has where its baseline counts the gradients already."""
    problem = record.problem
    if record.gradients_resident:
        return record.min_feasible_bytes
    # Parameters no graph before it takes were counted already: made by a later graph's backward.
    seen = set(record.inputs.parameters).union(*(e.inputs.parameters for e in record.earlier))
    nodes = problem.nodes
    if record.inputs.parameters:
        gradients = tuple(n.name for n in nodes if n.kind == BACKWARD and n.output)
        summed = max(record.inputs.parameters.values())
        nodes += (solvers.Node(name=GRADIENT_SUM_NODE, bytes=summed, cost=0.0, kind=BACKWARD, preds=gradients),)
    resident = sum(n for i, n in parameters.items() if i in seen)
    counted = solvers.Problem(
        nodes=nodes, baseline_bytes=problem.baseline_bytes + resident, size_groups=problem.size_groups
    )
    peak = solvers.simulate(counted, solvers.lowest_peak_plan(counted)).peak_bytes
    lowest = peak - sum(e.slack_bytes for e in record.earlier)
    return max(record.min_feasible_bytes, budget_for_planning_floor(lowest, record.margin_bytes))


def unoptimized_plan(jp: JointProblem) -> solvers.Plan:
    """The plan keeping every value backward reads (no ckptc), made once per graph."""
    if "_unoptimized_plan" not in jp.__dict__:
        jp.__dict__["_unoptimized_plan"] = keep_everything(jp)
    return jp.__dict__["_unoptimized_plan"]


def unoptimized_result(jp: JointProblem) -> solvers.SimResult:
    """The graph keeping every value backward reads (no ckptc), simulated (once per graph)."""
    if "_unoptimized" not in jp.__dict__:
        jp.__dict__["_unoptimized"] = solvers.simulate(jp.problem, unoptimized_plan(jp))
    return jp.__dict__["_unoptimized"]


def with_baseline(jp: JointProblem, baseline_bytes: int) -> JointProblem:
    """``jp`` with another baseline (the same problem object when it is unchanged, keeping its caches)."""
    if baseline_bytes == jp.problem.baseline_bytes:
        return jp
    return dataclasses.replace(jp, problem=dataclasses.replace(jp.problem, baseline_bytes=baseline_bytes))


class CapturedStep:
    """One training step captured once, planned under any number of budgets.

    Made by :func:`ckptc.capture`.  Holds each captured graph's priced joint
    problem; :meth:`plan` decides every graph again through :func:`decide`
    (with what earlier graphs keep under the new plans counted in later
    graphs' baselines), never running or capturing the model again.

    Attributes:
        options: the options of the capture (must_save, hold_outputs, ...);
            :meth:`plan`'s arguments override the planning ones.
        floor_bytes: the smallest budget ckptc can plan for (below it,
            :class:`~ckptc.InfeasibleBudgetError`).
        unoptimized_peak_bytes: the step's peak keeping every activation.
    """

    def __init__(
        self,
        records: Sequence[GraphRecord],
        options: CheckpointOptions,
        *,
        parameter_bytes: int | None = None,
        gradient_bytes: int | None = None,
        model_name: str = "model",
        coverage: Any = None,
        sequence: Sequence[int] | None = None,
        unnamed_gradient_bytes: int = 0,
        results_let_go: Mapping[tuple[int, int], int] | None = None,
        results_held: bool = False,
    ) -> None:
        if not records:
            raise InvalidArgumentError("a captured step needs at least one graph")
        self.records = list(records)
        # The graphs in the order the step ran them, by position in ``records`` (a graph repeats when
        # identical layers are compiled once).
        self.sequence = list(range(len(self.records))) if sequence is None else list(sequence)
        self.unnamed_gradient_bytes = unnamed_gradient_bytes  # see ckptc.planning.account.repeat_bytes
        self.results_let_go = dict(results_let_go or {})  # seen on the capture's step (StepAccount.results_let_go)
        # The capture's step showed the model holding results of its graphs through backward (a forward hook
        # storing a layer's output): its graphs were planned counting them held, and so is every budget.
        self._hold_outputs = True if results_held and options.hold_outputs is None else options.hold_outputs
        self.options = options
        self.parameter_bytes = parameter_bytes
        self.gradient_bytes = gradient_bytes
        self.model_name = model_name
        self.coverage = (
            coverage  # what the graphs cover of the step (ckptc.capture.coverage), the same for every budget
        )
        self._keep_everything = self._decide_all(
            options.replace(budget_bytes=None, strategy="none"),
            Replans(
                StepAccount(
                    hold_outputs=self._hold_outputs,
                    result_gradients=self._hold_outputs is True,
                    results_let_go=self.results_let_go,
                )
            ),
        )
        for record in self._keep_everything:  # once per graph, not per budget: every plan file carries it
            fingerprint(record.joint_problem)

    @property
    def graphs(self) -> int:
        return len(self.records)

    @property
    def floor_bytes(self) -> int:
        return max(r.min_feasible_bytes for r in self._keep_everything)

    @property
    def unoptimized_peak_bytes(self) -> int:
        return max(r.unoptimized_peak_bytes for r in self._keep_everything)

    def __repr__(self) -> str:
        return (
            f"CapturedStep({self.model_name}, graphs={self.graphs}, "
            f"nodes={sum(len(r.problem) for r in self.records)}, "
            f"floor={solvers.format_bytes(self.floor_bytes)}, "
            f"unoptimized_peak={solvers.format_bytes(self.unoptimized_peak_bytes)}; "
            ".plan(budget_bytes=...) plans without capturing again)"
        )

    def _options(self, budget_gb: float | None, budget_bytes: int | None, **overrides: Any) -> CheckpointOptions:
        """The capture's options under a budget, with ``overrides`` that are not None (validated here, once)."""
        changes = {name: value for name, value in overrides.items() if value is not None}
        return self.options.replace(budget_bytes=budget_to_bytes(budget_gb, budget_bytes), **changes)

    def _decide_under(
        self, options: CheckpointOptions, plan_source: PlanSource | None, progress: Progress | None
    ) -> list[GraphRecord]:
        budget = options.budget_bytes
        account = StepAccount(
            budget_bytes=budget,
            hold_outputs=self._hold_outputs,
            result_gradients=self._hold_outputs is True,  # held results may feed the caller's loss
            defer_infeasible=budget is not None,
            results_let_go=self.results_let_go,
        )
        return self._decide_all(options, Replans(account), plan_source, progress)

    def plan(
        self,
        budget_gb: float | None = None,
        *,
        budget_bytes: int | None = None,
        strategy: str | None = None,
        solver: str | None = None,
        time_limit: float | None = None,
        plan_source: PlanSource | None = None,
        progress: Progress | None = None,
        **unknown: Any,
    ) -> ModelPlan:
        """The :class:`~ckptc.plans.ModelPlan` of this step under a budget (None: no limit).

        ``strategy``, ``solver`` and ``time_limit`` override the capture's options.

        Raises:
            ckptc.UnknownOptionError: a keyword this method does not take (the message lists those it does).
            ValueError: a bad budget, strategy or solver.
            solvers.InfeasibleBudgetError: the budget is below :attr:`floor_bytes`.
        """
        valid = [name for name in inspect.signature(CapturedStep.plan).parameters if name not in ("self", "unknown")]
        refuse_unknown("CapturedStep.plan keyword", unknown, valid, noun="keywords")
        options = self._options(budget_gb, budget_bytes, strategy=strategy, solver=solver, time_limit=time_limit)
        records = self._decide_under(options, plan_source, progress)
        return ModelPlan(
            graphs=[graph_plan(r) for r in records],
            budget_bytes=options.budget_bytes,
            strategy=options.strategy,
            solver=options.solver,
            parameter_bytes=self.parameter_bytes,
            gradient_bytes=self.gradient_bytes,
            hold_outputs=options.hold_outputs,
            coverage=self.coverage,
        )

    def _decide_all(
        self,
        options: CheckpointOptions,
        replans: Replans,
        plan_source: PlanSource | None = None,
        progress: Progress | None = None,
    ) -> list[GraphRecord]:
        """Every graph decided in step order, again until the plans fit together (:func:`ckptc.planning.replan.settle`):
        a graph the step runs several times is decided for its last run, with what its earlier runs keep
        under the new plans counted."""

        def decide_step(account: StepAccount) -> tuple[list[GraphRecord], list[GraphRecord]]:
            records = self._decide_each(options, account, plan_source, progress)
            return records, [records[i] for i in self.sequence]

        return settle(decide_step, replans, lambda ran: self.unnamed_gradient_bytes)

    def _decide_each(
        self,
        options: CheckpointOptions,
        account: StepAccount,
        plan_source: PlanSource | None,
        progress: Progress | None,
    ) -> list[GraphRecord]:
        decided: dict[int, GraphRecord] = {}
        current = dict(enumerate(self.records))  # each graph's latest plan, by index
        out = []
        for position, captured in enumerate(self.records):
            earlier = [decided[id(e)] for e in captured.earlier if id(e) in decided]
            repeated = account.repeated_runs_bytes(position, current)
            baseline = max(0, captured.own_baseline_bytes + account.earlier_bytes(earlier, position) + repeated)
            jp = with_later_results(
                with_baseline(captured.joint_problem, baseline), account.later_results_held.get(position, 0)
            )
            record = decide(
                jp,
                options,
                account,
                index=position,
                earlier=earlier,
                plan_source=plan_source,
                progress=progress,
                inputs=captured.inputs,
                repeat_bytes=repeated,
            )
            record.break_after = captured.break_after
            decided[id(captured)] = current[position] = record
            out.append(record)
        return out
